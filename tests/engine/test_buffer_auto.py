"""``offload.buffer_mb = "auto"`` (the default): the nvme tier's host buffer is sized from the
largest unit, so a model whose embedding unit is over the old fixed 256 MiB's reach trains."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine.build import model_units
from engine.config import Config, ConfigError
from engine.engine import Engine
from engine.runtime.sizes import MIB
from engine.state.forms import FP32_STATE
from engine.tiers.sizing import AUTO_BUFFER_FLOOR_MB, optimizer_buffer_bytes
from engine.tiers.store_checks import check_buffer, check_buffer_memory
from tests.training import config, tiny_gpt

VOCAB, WIDTH = 48_000, 256
"""A 12.3M-parameter embedding: its unit's optimizer state (148 MiB) twice over is more than 256 MiB."""


class BigEmbedding(nn.Module):
    """An embedding in the root unit and one small block, like a language model's ends."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](self.emb(x)).pow(2).mean()


def nvme(tmp_path, **offload) -> Config:
    return config(offload={"optimizer": "nvme", "nvme_path": str(tmp_path / "store"), "chunk_mb": 16, **offload})


def test_the_default_is_auto_and_auto_is_twice_the_largest_unit_at_least_the_floor(tmp_path) -> None:
    cfg = nvme(tmp_path)
    assert Config().offload.buffer_mb == "auto" and cfg.offload.buffer_mb == "auto"
    with torch.device("meta"):
        _, _, layout = model_units(BigEmbedding(), cfg, 1)
    largest = max(FP32_STATE.unit_bytes(u) for u in layout.units)
    auto = optimizer_buffer_bytes(cfg.offload, layout.units)
    assert auto % MIB == 0 and 2 * largest <= auto < 2 * largest + MIB
    check_buffer(layout, auto)  # what the engine then asks of it
    with pytest.raises(ValueError, match=r"unit 'root' needs .* set offload.buffer_mb >= \d+"):
        check_buffer(layout, AUTO_BUFFER_FLOOR_MB * MIB)
    _, _, small = model_units(tiny_gpt(), cfg, 1)
    assert optimizer_buffer_bytes(cfg.offload, small.units) == AUTO_BUFFER_FLOOR_MB * MIB
    assert optimizer_buffer_bytes(nvme(tmp_path, buffer_mb=64).offload, layout.units) == 64 * MIB


def test_a_big_embedding_trains_by_default_where_256_mib_was_refused(tmp_path) -> None:
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"offload.buffer_mb = 256: unit 'root' needs"):
        Engine(BigEmbedding(), nvme(tmp_path, buffer_mb=256), total_steps=1)
    assert not (tmp_path / "store").exists(), "a refused run leaves nothing behind"
    engine = Engine(BigEmbedding(), nvme(tmp_path), total_steps=1)
    before = engine.module.emb.weight.detach().clone()
    loss = engine(torch.randint(0, VOCAB, (2, 8)))
    engine.backward(loss)
    engine.step()
    assert engine.global_step == 1 and not torch.equal(engine.module.emb.weight, before)
    engine.close()


def test_auto_refuses_a_buffer_the_machine_cannot_hold_naming_the_fix(tmp_path, monkeypatch) -> None:
    cfg = nvme(tmp_path)
    with torch.device("meta"):
        _, _, layout = model_units(BigEmbedding(), cfg, 1)
    held = min(optimizer_buffer_bytes(cfg.offload, layout.units), sum(FP32_STATE.unit_bytes(u) for u in layout.units))
    check_buffer_memory(layout, held, held)
    with pytest.raises(ValueError, match=r'buffer_mb = "auto".* MiB of memory are available: free memory'):
        check_buffer_memory(layout, held, held - 1)
    monkeypatch.setattr("engine.build.psutil.virtual_memory", lambda: SimpleNamespace(available=MIB))
    with pytest.raises(ValueError, match=r"needs 1\d\d MiB .* only 1 MiB of memory are available"):
        Engine(BigEmbedding(), cfg, total_steps=1)


@pytest.mark.parametrize("value", [0, -1, "big"])
def test_a_buffer_that_is_neither_a_size_nor_auto_is_refused(value) -> None:
    with pytest.raises(ConfigError, match=r"offload\.buffer_mb"):
        Config.from_dict({"offload": {"buffer_mb": value}})
    assert Config.from_dict({}, ["offload.buffer_mb=auto"]).offload.buffer_mb == "auto"
    assert Config.from_dict({}, ["buffer_mb=512"]).offload.buffer_mb == 512
