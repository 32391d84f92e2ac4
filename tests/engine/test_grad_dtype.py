"""One bf16 rank keeps its gradients in bf16 from the bucket to the update (``gradient_dtype``):
nothing is summed or scaled in them there, the update widens each as it reads it and clips it
in the same pass, so the run equals the one through fp32 buckets bit for bit, in every place a
gradient can wait for its update, for half the bucket's bytes and half those of each copy."""

from __future__ import annotations

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from engine.tiers.sizing import gradient_dtype
from engine.tools.estimate import run_shape
from engine.tools.estimate.terms import grad_bucket_bytes
from engine.zero.optim import UNIT_NORM_PIECE, unit_norm
from tests.engine.test_grad_spill import assert_same, nvme
from tests.training import config, tiny_gpt, train_engine

CLIP = {"grad_clip": 0.05}
"""Clipping that bites at the tiny model's size."""

WAITS = {
    "in memory, stage 1": {"zero": {"stage": 1}, "optim": CLIP},
    "in memory, stage 2": {"zero": {"stage": 2}, "optim": CLIP},
    "in memory beside nvme state, stage 3": {"zero": {"stage": 3}, "optim": CLIP, "offload": {"grad_spill": False}},
    "spilled as bf16, stage 2": {"zero": {"stage": 2}, "offload": {"grad_spill_dtype": "bf16"}, "optim": CLIP},
    "spilled as bf16, stage 3": {"zero": {"stage": 3}, "offload": {"grad_spill_dtype": "bf16"}, "optim": CLIP},
    "spilled as fp32, stage 3": {"zero": {"stage": 3}, "offload": {"grad_spill": True}, "optim": CLIP},
    "updated inside backward": {"zero": {"stage": 2}, "optim": {"grad_clip": 0.0, "overlap": True}},
}


def bf16_rank(tmp_path, sections: dict) -> Config:
    """The tiny model in bf16 on nvme where ``sections`` spill or keep the state there, else on the host."""
    sections = {"precision": {"compute_dtype": "bf16"}} | sections
    offload = sections.get("offload", {})
    if "grad_spill" in offload or "grad_spill_dtype" in offload:
        return nvme(tmp_path, offload.get("grad_spill", "auto"), **sections)
    return config(**sections)


@pytest.mark.parametrize("where", WAITS)
def test_one_bf16_rank_keeps_its_gradients_in_bf16_with_the_same_result(where: str, tmp_path, monkeypatch) -> None:
    from engine import build
    from engine.tiers import sizing

    eng = Engine(tiny_gpt(), bf16_rank(tmp_path / "probe", WAITS[where]), total_steps=1)
    assert eng.grads.dtype == torch.bfloat16
    eng.close()
    narrow = train_engine(bf16_rank(tmp_path / "narrow", WAITS[where]), 4)
    for module in (build, sizing):  # the buckets and the pinned plan that holds their shards on a GPU
        monkeypatch.setattr(module, "gradient_dtype", lambda config, world_size: torch.float32)
    wide = train_engine(bf16_rank(tmp_path / "wide", WAITS[where]), 4)
    assert narrow["losses"] == wide["losses"] and narrow["grad_norms"] == wide["grad_norms"]
    assert_same(narrow, wide, "the run through fp32 buckets")


WIDE = {
    "summed over micro-batches": {"zero": {"grad_accum_steps": 2}},
    "unscaled": {"precision": {"compute_dtype": "fp16", "loss_scaling": "dynamic"}},
}


@pytest.mark.parametrize("why", WIDE)
def test_gradients_stay_fp32_where_they_are_summed_or_scaled(why: str, tmp_path) -> None:
    assert gradient_dtype(bf16_rank(tmp_path, {}), world_size=1) == torch.bfloat16
    assert gradient_dtype(bf16_rank(tmp_path, {}), world_size=2) == torch.float32, "a reduction over ranks sums in fp32"
    assert gradient_dtype(bf16_rank(tmp_path, WIDE[why]), world_size=1) == torch.float32


def test_estimate_counts_half_the_bucket_bytes(tmp_path) -> None:
    narrow = bf16_rank(tmp_path, WAITS["in memory, stage 2"])
    summed = bf16_rank(tmp_path, WAITS["in memory, stage 2"] | WIDE["summed over micro-batches"])
    assert 2 * grad_bucket_bytes(run_shape(narrow, 1)) == grad_bucket_bytes(run_shape(summed, 1)) > 0


@pytest.mark.parametrize("numel", [100, UNIT_NORM_PIECE, 3 * UNIT_NORM_PIECE + 5])
def test_a_bf16_shards_own_norm_is_its_fp32_copys_bit_for_bit(numel: int) -> None:
    """The norm a unit updated inside backward takes of its shard, over several pieces too."""
    grad = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-3).to(torch.bfloat16)
    narrow, wide = unit_norm(grad), unit_norm(grad.float())
    assert narrow.dtype == torch.float32 and torch.equal(narrow, wide)
    exact = torch.linalg.vector_norm(grad.double()).float()
    whole = torch.linalg.vector_norm(grad.float())  # torch's fp32 sums stray by as much (3e-5 at 3M elements)
    for norm in (wide, whole):
        torch.testing.assert_close(norm, exact, rtol=1e-4, atol=0)
