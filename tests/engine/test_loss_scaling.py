"""fp16 dynamic loss scaling: an overflow skips the step everywhere and never touches the
masters; the scale backs off, then grows back after a run of clean steps; with clipping, the
parameters follow torch's ``GradScaler`` + ``clip_grad_norm_`` + ``AdamW``."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from tests.training import (
    batches,
    change_error,
    config,
    initial_params,
    tiny_gpt,
    train_engine,
    train_reference,
)


def masters(eng: Engine) -> dict[str, torch.Tensor]:
    return {unit.name: state.master.clone() for unit, state in eng.optimizer_state.read(eng.layout.units)}


def test_inf_gradient_skips_step_and_scale_recovers() -> None:
    cfg = config(
        zero={"stage": 2},
        precision={"compute_dtype": "fp16", "loss_scaling": "dynamic", "initial_scale": 1024.0, "growth_interval": 2},
    )
    eng = Engine(tiny_gpt(), cfg, total_steps=10)
    data = batches(4)

    def step(poison: bool = False) -> bool:
        handle = eng.module.blocks[1].mlp.fc.weight.register_hook(lambda g: g * float("inf")) if poison else None
        eng.backward(eng(*data.next()))
        if handle:
            handle.remove()
        return eng.step()

    assert step() and eng.scaler.scale == 1024.0
    before_masters = masters(eng)
    before_params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}

    assert not step(poison=True)
    assert eng.scaler.scale == 512.0 and eng.skipped_steps == 1
    after = masters(eng)
    assert all(torch.equal(before_masters[k], after[k]) for k in after)
    assert all(torch.equal(before_params[n], p) for n, p in eng.module.named_parameters())
    assert all(torch.isfinite(t).all() for t in after.values())

    assert step() and eng.scaler.scale == 512.0
    assert step() and eng.scaler.scale == 1024.0, "two clean steps (growth_interval) grow the scale back"
    assert any(not torch.equal(before_masters[k], v) for k, v in masters(eng).items())
    eng.close()


FP16_CLIP = 2.0
"""Between the tiny GPT's gradient norms (2.3-2.4 on the first two steps, 1.2-1.8 after): the
clip bites on some steps and not on others. Gradients left scaled by the loss scale would be
clipped on every step, which AdamW, blind to one constant factor, is not blind to."""
FP16_TOLERANCE = 0.055
"""Largest ``change_error`` of fp16 compute with loss scaling and clipping against
``GradScaler`` + ``clip_grad_norm_`` + ``AdamW`` under fp16 autocast after 8 steps: about 2.5
times the most measured, 0.0205-0.0228 over seeds 0-4 (the same at stages 1, 2 and 3).
Gradients never unscaled measure 0.072, and their norm is the loss scale times too large."""


# The default run keeps stage 3.
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_fp16_with_clipping_follows_grad_scaler_and_clip_grad_norm(stage: int) -> None:
    seed = stage - 1
    precision = {"compute_dtype": "fp16", "loss_scaling": "dynamic", "initial_scale": 1024.0}
    cfg = config(zero={"stage": stage}, precision=precision, optim={"lr": 1e-3, "grad_clip": FP16_CLIP})
    ours = train_engine(cfg, 8, seed=seed)
    ref = train_reference(cfg, 8, micro_batch=4, seed=seed)
    norms = ref["grad_norms"]
    assert min(norms) < FP16_CLIP < max(norms), f"the clip must bite on some steps only: {norms}"
    # Measured within 3e-4 of torch's norm of the unscaled gradients, step by step.
    assert ours["grad_norms"] == pytest.approx(norms, rel=1e-3)
    error = change_error(ours["params"], ref["params"], initial_params(seed))
    assert 0 < error < FP16_TOLERANCE, error
