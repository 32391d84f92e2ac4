"""One bf16 rank keeps its gradients in bf16 from the bucket to the update (``gradient_dtype``):
nothing is summed or scaled in them there, the update widens each as it reads it and clips it
in the same pass, so the run equals the one through fp32 buckets bit for bit, in every place a
gradient can wait for its update, for half the bucket's bytes and half those of each copy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from engine.runtime.scratch import scratch
from engine.tiers.sizing import gradient_dtype
from engine.tools.estimate import run_shape
from engine.tools.estimate.terms import grad_bucket_bytes, norm_scratch_bytes
from engine.zero import optim
from engine.zero.optim import UNIT_NORM_PIECE, piece_norms, unit_norm
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


def test_bf16_pieces_norms_are_their_fp32_copies_bit_for_bit_and_reuse_one_capped_buffer(monkeypatch) -> None:
    """The norms the spill takes of each parameter's gradient (one rank): widened in the thread's
    scratch up to ``NORM_SCRATCH_NUMEL`` elements, by torch above it, the same bits either way.
    Run on a thread of its own, whose scratch starts empty."""
    monkeypatch.setattr(optim, "NORM_SCRATCH_NUMEL", 5000)
    gen = torch.Generator().manual_seed(0)
    shapes = [(40, 100), (7,), (4000,), (3, 3000)]  # the last is above the cap
    pieces = [(torch.randn(shape, generator=gen) * 1e-3).to(torch.bfloat16) for shape in shapes]

    def norms_and_held() -> tuple[list[torch.Tensor], int]:
        norms = piece_norms(pieces)
        return norms, scratch("piece norm", 1, torch.float32, torch.device("cpu")).untyped_storage().nbytes()

    with ThreadPoolExecutor(1) as thread:
        narrow, held = thread.submit(norms_and_held).result()
    wide = piece_norms([p.float() for p in pieces])
    assert all(n.dtype == torch.float32 and torch.equal(n, w) for n, w in zip(narrow, wide, strict=True))
    assert held == 4 * 4000, "the buffer grew to the largest piece under the cap, not to the one above it"


def test_estimate_counts_the_norm_scratch_for_one_bf16_rank_only(tmp_path) -> None:
    spilled = run_shape(bf16_rank(tmp_path, WAITS["spilled as bf16, stage 3"]), 1)
    largest = max(slot.numel for unit in spilled.layout.units for slot in unit.params)
    assert norm_scratch_bytes(spilled) == 4 * largest > 0
    assert norm_scratch_bytes(run_shape(bf16_rank(tmp_path, WAITS["spilled as bf16, stage 3"]), 2)) == 0
    assert norm_scratch_bytes(run_shape(bf16_rank(tmp_path, WAITS["updated inside backward"]), 1)) == 0
    assert norm_scratch_bytes(run_shape(config(), 1)) == 0, "fp32 gradients are normed where they are"
