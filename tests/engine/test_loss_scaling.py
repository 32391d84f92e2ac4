"""fp16 dynamic loss scaling: an overflow skips the step everywhere and never touches the
masters; the scale backs off, then grows back after a run of clean steps."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from tests.training import batches, config, tiny_gpt


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


def test_fp16_loss_curve_follows_fp32() -> None:
    def curve(dtype: str) -> tuple[list[float], int]:
        cfg = config(precision={"compute_dtype": dtype, "loss_scaling": "dynamic"}, optim={"lr": 1e-3})
        eng = Engine(tiny_gpt(), cfg, total_steps=10)
        data = batches(4)
        losses = []
        for _ in range(10):
            loss = eng(*data.next())
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
        eng.close()
        return losses, eng.skipped_steps

    fp16, skipped = curve("fp16")
    fp32, _ = curve("fp32")
    assert skipped == 0
    assert fp16 == pytest.approx(fp32, rel=1e-2)
    assert fp16 != fp32, "fp16 compute should not give exactly the fp32 losses"
