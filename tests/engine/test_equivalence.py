"""The engine against plain PyTorch AdamW on the same model, data and seed."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import run_ranks
from tests.training import (
    change_error,
    config,
    initial_params,
    rel_diff,
    train_engine,
    train_engine_on_ranks,
    train_reference,
)

STEPS = 5


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
@pytest.mark.parametrize("tier", ["device", "cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_one_rank_is_bit_identical_every_step(stage: int, tier: str, kernel: str, tmp_path) -> None:
    cfg = config(
        zero={"stage": stage},
        offload={"optimizer": tier, "nvme_path": str(tmp_path / "store")},
        optim={"kernel": kernel},
    )
    ours = train_engine(cfg, STEPS)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    for step, (a, b) in enumerate(zip(ours["history"], ref["history"], strict=False)):
        differing = [name for name in b if not torch.equal(a[name], b[name])]
        assert not differing, f"step {step}: parameters differ from torch AdamW: {differing[:3]}"


@pytest.mark.parametrize("stage", [2, 3])
def test_tied_embeddings_bit_identical(stage: int) -> None:
    cfg = config(zero={"stage": stage})
    ours = train_engine(cfg, STEPS, tie=True)
    ref = train_reference(cfg, STEPS, micro_batch=4, tie=True)
    assert ours["params"].keys() == ref["params"].keys()
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])


# Two ranks with the state on nvme are also held to one rank on the cpu tier by test_nvme_tier: slow here.
@pytest.mark.parametrize(
    ("stage", "tier"),
    [(3, "cpu")]
    + [pytest.param(s, t, marks=pytest.mark.slow) for t in ("cpu", "nvme") for s in (1, 2, 3) if (s, t) != (3, "cpu")],
)
def test_two_gloo_ranks_match_one_process(stage: int, tier: str, tmp_path) -> None:
    cfg = config(zero={"stage": stage}, offload={"optimizer": tier, "nvme_path": str(tmp_path / "store")})
    ranks = run_ranks(2, train_engine_on_ranks, cfg, STEPS, 2)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    for result in ranks:
        assert rel_diff(result["params"], ref["params"]) <= 1e-6
    assert torch.equal(ranks[0]["params"]["tok_emb.weight"], ranks[1]["params"]["tok_emb.weight"])
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=False)]
    assert mean_losses == pytest.approx(ref["losses"], rel=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_equals_one_large_batch(stage: int) -> None:
    accumulated = train_engine(config(zero={"stage": stage, "grad_accum_steps": 4}), STEPS, micro_batch=2)
    large = train_reference(config(), STEPS, micro_batch=2, concat=4)
    assert rel_diff(accumulated["params"], large["params"]) <= 1e-6


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_is_bit_identical_to_clip_grad_norm_every_step(stage: int, tier: str, tmp_path) -> None:
    cfg = config(
        zero={"stage": stage},
        offload={"optimizer": tier, "nvme_path": str(tmp_path / "store")},
        optim={"grad_clip": 0.05},
    )
    ours = train_engine(cfg, STEPS)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    for step, (a, b) in enumerate(zip(ours["history"], ref["history"], strict=False)):
        differing = [name for name in b if not torch.equal(a[name], b[name])]
        assert not differing, f"step {step}: parameters differ from torch AdamW + clip_grad_norm_: {differing[:3]}"
    unclipped = train_reference(config(zero={"stage": stage}), STEPS, micro_batch=4)
    assert rel_diff(unclipped["params"], ref["params"]) > 1e-4, "the test's clip threshold never bites"


def test_two_gloo_ranks_clip_the_global_norm(tmp_path) -> None:
    cfg = config(optim={"grad_clip": 0.05})
    ranks = run_ranks(2, train_engine_on_ranks, cfg, STEPS, 2)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    for result in ranks:
        assert rel_diff(result["params"], ref["params"]) <= 1e-6
    unclipped = train_reference(config(), STEPS, micro_batch=4)
    assert rel_diff(unclipped["params"], ref["params"]) > 1e-4, "the test's clip threshold never bites"


BF16_TOLERANCE = 0.15
"""Largest ``change_error`` of bf16 compute against the autocast reference (fp32 parameters,
bf16 matmuls) after 8 steps at lr 1e-3: about 2.5 times the most measured, 0.0565-0.0586 over
seeds 0-4 (the same at stages 1, 2 and 3). Half the learning rate measures 0.52, so a step of
the wrong size is far outside it, where the losses (within 1% of each other over a drop of 3%)
could not tell."""


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_follows_autocast_reference(stage: int) -> None:
    seed = stage - 1  # a seed per stage: three models for the price of one each
    cfg = config(zero={"stage": stage}, precision={"compute_dtype": "bf16"}, optim={"lr": 1e-3})
    ours = train_engine(cfg, 8, seed=seed)
    ref = train_reference(cfg, 8, micro_batch=4, seed=seed)
    error = change_error(ours["params"], ref["params"], initial_params(seed))
    assert 0 < error < BF16_TOLERANCE, error
    assert ours["losses"][-1] < ours["losses"][0]
