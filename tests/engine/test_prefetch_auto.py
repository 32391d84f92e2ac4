"""``zero.prefetch_mb = "auto"`` (the default): the stage-3 window holds two of the largest
unit in the compute dtype, the root unit aside, so a model whose units are larger than a fixed
window still has one read in flight while the next lands."""

from __future__ import annotations

import torch
from torch import nn

from engine.build import model_units
from engine.config import Config
from engine.runtime.sizes import MIB
from engine.state.partition import ROOT_UNIT
from engine.tiers.sizing import AUTO_PREFETCH_FLOOR_MB, module_numels, param_window_bytes, prefetch_bytes
from tests.training import config, tiny_gpt

VOCAB, WIDTH, WIDE = 64_000, 2048, 6144
"""Blocks of 12.6M parameters (48 MiB in fp32, 24 MiB in bf16) beside a 131M-parameter root."""


class WideBlocks(nn.Module):
    """A large embedding in the root unit and two blocks, each larger than half the floor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDE, bias=False), nn.Linear(WIDE, WIDTH, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](self.emb(x))).pow(2).mean()


def stage3(**zero) -> Config:
    return config(zero={"stage": 3, **zero}, offload={"optimizer": "cpu", "param": "cpu", "chunk_mb": 16})


def test_auto_is_two_of_the_largest_block_in_the_compute_dtype_the_root_aside() -> None:
    cfg = stage3()
    assert Config().zero.prefetch_mb == "auto" and cfg.zero.prefetch_mb == "auto"
    with torch.device("meta"):
        _, _, layout = model_units(WideBlocks(), cfg, 1)
    numels = module_numels(layout)
    block = max(n for name, n in numels.items() if name != ROOT_UNIT)
    assert numels[ROOT_UNIT] > 4 * block, "the root alone would make the window far larger"
    for dtype in (torch.bfloat16, torch.float32):
        auto = prefetch_bytes(cfg.zero, layout, dtype)
        assert auto == max(2 * block * dtype.itemsize, AUTO_PREFETCH_FLOOR_MB * MIB)
    assert prefetch_bytes(cfg.zero, layout, torch.float32) == 2 * block * 4 > AUTO_PREFETCH_FLOOR_MB * MIB
    assert prefetch_bytes(cfg.zero, layout, torch.bfloat16) == AUTO_PREFETCH_FLOOR_MB * MIB


def test_small_units_get_the_floor_and_a_set_window_is_kept() -> None:
    with torch.device("meta"):
        _, _, layout = model_units(tiny_gpt(), stage3(), 2)
    assert prefetch_bytes(stage3().zero, layout, torch.float32) == AUTO_PREFETCH_FLOOR_MB * MIB
    assert prefetch_bytes(stage3(prefetch_mb=0).zero, layout, torch.float32) == 0
    assert prefetch_bytes(stage3(prefetch_mb=1.5).zero, layout, torch.float32) == int(1.5 * MIB)
    assert param_window_bytes(stage3().zero, layout, torch.float32) == AUTO_PREFETCH_FLOOR_MB * MIB // 2
