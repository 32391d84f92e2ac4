"""The learning-rate schedules (``optim.schedule``) against values worked out by hand: linear
warmup, then a cosine or a linear decay to ``min_lr_ratio`` (or constant), each at the end of
warmup, midway, at the end of the decay and after it."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, LRScheduler, SequentialLR

from engine.config import Config, OptimConfig
from engine.zero.optim import lr_factor, schedule_change
from tests.training import schedule_factor

TOTAL = 24
"""train.steps: with 4 warmup steps and decay_steps = 0 the decay runs over steps 4..24."""

# step: 0-based optimizer step. Warmup: (step + 1) / 4. Decay: progress p = (step - 4) / 20, then
# cosine 0.1 + 0.9 * (1 + cos(pi * p)) / 2, linear 0.1 + 0.9 * (1 - p), each held at 0.1 from p = 1.
EXPECTED = {
    "cosine": {0: 0.25, 2: 0.75, 3: 1.0, 4: 1.0, 9: 0.8681980515339464, 14: 0.55, 19: 0.2318019484660536, 24: 0.1},
    "linear": {0: 0.25, 2: 0.75, 3: 1.0, 4: 1.0, 9: 0.775, 14: 0.55, 19: 0.325, 24: 0.1, 30: 0.1},
    "constant": {0: 0.25, 2: 0.75, 3: 1.0, 4: 1.0, 14: 1.0, 24: 1.0, 30: 1.0},
}


@pytest.mark.parametrize("schedule", sorted(EXPECTED))
def test_each_schedule_warms_up_then_follows_its_curve(schedule: str) -> None:
    config = OptimConfig(schedule=schedule, warmup_steps=4, min_lr_ratio=0.1)
    for step, factor in EXPECTED[schedule].items():
        assert lr_factor(step, config, TOTAL) == pytest.approx(factor, abs=1e-12), f"{schedule} at step {step}"


def test_a_fixed_decay_length_ignores_the_total() -> None:
    config = OptimConfig(schedule="linear", warmup_steps=4, decay_steps=10, min_lr_ratio=0.1)
    for total in (24, 1000):
        assert lr_factor(9, config, total) == pytest.approx(0.55)  # p = 5 / 10
        assert lr_factor(14, config, total) == pytest.approx(0.1)
        assert lr_factor(100, config, total) == pytest.approx(0.1)


def test_linear_without_warmup_decays_to_zero_as_hugging_face_does() -> None:
    config = OptimConfig(schedule="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_factor(step, config, 10) for step in (0, 5, 9, 10)] == pytest.approx([1.0, 0.5, 0.1, 0.0])


def test_linear_is_a_config_value_and_a_resize_of_its_decay_is_told() -> None:
    assert Config.from_dict({"optim": {"schedule": "linear"}}).optim.schedule == "linear"
    message = schedule_change(OptimConfig(schedule="linear", lr=1.0), 50, 100, 200)
    assert message is not None and "linear" in message and "optim.decay_steps = 100" in message
    assert schedule_change(OptimConfig(schedule="linear", decay_steps=100), 50, 100, 200) is None


def torch_schedule(optim: OptimConfig, total: int) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """The schedule of ``optim`` built from torch's own schedulers: ``LinearLR`` warmup from
    ``1 / W``, then ``CosineAnnealingLR`` down to ``min_lr_ratio`` (held by a ``LambdaLR`` after
    it: the cosine would climb again), ``LinearLR`` down to it, or a constant."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio
    decay = optim.decay_steps or total - warmup
    after: list[LRScheduler] = {
        "cosine": lambda: [CosineAnnealingLR(opt, T_max=decay, eta_min=floor), LambdaLR(opt, lambda _: floor)],
        "linear": lambda: [LinearLR(opt, start_factor=1.0, end_factor=floor, total_iters=decay)],
        "constant": lambda: [LambdaLR(opt, lambda _: 1.0)],
    }[optim.schedule]()
    schedulers = [LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1), *after]
    milestones = [warmup, warmup + decay][: len(schedulers) - 1]
    return opt, SequentialLR(opt, schedulers, milestones=milestones)


@pytest.mark.parametrize(
    "optim",
    [
        OptimConfig(schedule="cosine", warmup_steps=4, min_lr_ratio=0.1),
        OptimConfig(schedule="cosine", warmup_steps=3, min_lr_ratio=0.0),
        OptimConfig(schedule="linear", warmup_steps=4, min_lr_ratio=0.1),
        OptimConfig(schedule="linear", warmup_steps=2, decay_steps=7, min_lr_ratio=0.25),
        OptimConfig(schedule="constant", warmup_steps=5),
    ],
    ids=["cosine", "cosine-to-zero", "linear", "linear-fixed-decay", "constant"],
)
def test_the_engine_and_the_tests_reference_follow_torchs_own_schedulers(optim: OptimConfig) -> None:
    """Every step of a run and past its end: the engine's ``lr_factor`` and the references'
    ``schedule_factor`` (``tests.training``) against torch's ``SequentialLR`` of ``LinearLR``,
    ``CosineAnnealingLR`` and ``LambdaLR``, whose cosine is a recurrence: equal to 1e-9."""
    opt, schedule = torch_schedule(optim, TOTAL)
    for step in range(TOTAL + 6):
        expected = opt.param_groups[0]["lr"]
        assert lr_factor(step, optim, TOTAL) == pytest.approx(expected, abs=1e-9), f"engine, step {step}"
        assert schedule_factor(step, optim, TOTAL) == pytest.approx(expected, abs=1e-9), f"reference, step {step}"
        opt.step()
        schedule.step()
