"""A step's seconds and waits split by phase (``StepStats.phases``): each wait lands in the phase
it held up, and the phases add up to the step.

Parameter gathers and optimizer write-backs are slowed by a fixed delay each, so every phase's
share is known from what runs in it: gathers in the forward and backward (none in the update:
prefetching is off), write-backs in the update after clipping, in the backward when each unit is
updated as its gradient is reduced.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.tiers.grad_spill import GradSpill
from engine.tiers.parameters import StoreParamTier
from engine.zero.stats import OTHER, PHASES, StepStats
from engine.zero.step import UnitWork
from engine.zero.unit_params import UnitParams
from tests.training import batches, config, tiny_gpt

DELAY_S = 0.01
LOOP_S = 0.1
"""The training loop's own pause between backward and step, which only ``OTHER`` may hold."""
READ_S = 0.05


def slowed_step(tmp_path: Path, monkeypatch, grad_clip: float) -> tuple[StepStats, int]:
    """The second step of a stage-3 nvme run whose gathers and optimizer write-backs each wait
    ``DELAY_S`` more, and how many units it has."""
    cfg = config(
        zero={"stage": 3, "prefetch_mb": 0},
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path / "store")},
        optim={"grad_clip": grad_clip},
    )
    eng = Engine(tiny_gpt(), cfg, total_steps=2)
    complete = UnitParams.complete

    def slow_complete(entry: UnitParams) -> None:
        time.sleep(DELAY_S)
        complete(entry)

    write_back = eng.optimizer_state.write_back

    def slow_write_back(*args) -> None:
        time.sleep(DELAY_S)
        write_back(*args)

    monkeypatch.setattr(UnitParams, "complete", slow_complete)
    monkeypatch.setattr(eng.optimizer_state, "write_back", slow_write_back)
    data = batches(2)
    try:
        for _ in range(2):
            x, y = data.next()
            eng.backward(eng(x, y))
            time.sleep(LOOP_S)
            eng.step()
        return eng.last_step_stats, len(eng.layout.units)
    finally:
        eng.close()


def assert_adds_up(stats: StepStats) -> None:
    phases = stats.phases
    assert set(phases) == {*PHASES, OTHER}
    assert sum(p.seconds for p in phases.values()) == pytest.approx(stats.seconds, abs=1e-9)
    assert sum(p.param_wait_s for p in phases.values()) == pytest.approx(stats.param_wait_s, abs=1e-9)
    assert sum(p.optimizer_wait_s for p in phases.values()) == pytest.approx(stats.optimizer_wait_s, abs=1e-9)
    assert phases[OTHER].seconds >= LOOP_S
    for phase in phases.values():
        assert phase.seconds >= phase.param_wait_s + phase.optimizer_wait_s - 1e-9
        assert phase.to_dict()["compute_s"] == pytest.approx(phase.compute_s)
    assert stats.to_dict()["phases"]["update"]["seconds"] == phases["update"].seconds


def test_clipped_steps_wait_for_parameters_in_forward_and_backward_and_for_the_optimizer_in_the_update(
    tmp_path, monkeypatch
) -> None:
    stats, units = slowed_step(tmp_path, monkeypatch, grad_clip=1.0)
    assert_adds_up(stats)
    phases = stats.phases
    # The root unit persists (it is never gathered); every other unit is, once each way.
    assert phases["forward"].param_wait_s >= (units - 1) * DELAY_S
    assert phases["backward"].param_wait_s >= (units - 1) * DELAY_S
    assert phases["update"].param_wait_s < DELAY_S
    assert phases["update"].optimizer_wait_s >= units * DELAY_S
    assert phases["forward"].optimizer_wait_s == 0.0
    assert phases["backward"].optimizer_wait_s < DELAY_S


def test_units_updated_inside_backward_wait_for_the_optimizer_there(tmp_path, monkeypatch) -> None:
    stats, units = slowed_step(tmp_path, monkeypatch, grad_clip=0.0)
    assert_adds_up(stats)
    phases = stats.phases
    # Each unit is handed on when the next one's gradient is ready: all but the last in backward.
    assert phases["backward"].optimizer_wait_s >= (units - 2) * DELAY_S
    assert phases["forward"].optimizer_wait_s == 0.0


def test_waits_on_the_worker_are_counted_once_and_only_the_training_threads(tmp_path, monkeypatch) -> None:
    """Gradients spilled and units updated on the host worker: the room the worker waited for is
    its own time, which the training thread spends going on (each spill here reports an hour's
    wait), and the training thread's wait for a slow update is counted once."""
    write = GradSpill.write
    monkeypatch.setattr(GradSpill, "write", lambda self, unit, grad: write(self, unit, grad) + 3600.0)
    compute = UnitWork.compute
    monkeypatch.setattr(UnitWork, "compute", lambda *args: time.sleep(0.05) or compute(*args))
    cfg = config(
        zero={"stage": 3},
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path / "store")},
        optim={"grad_clip": 1.0},
    )
    eng = Engine(tiny_gpt(), cfg, total_steps=1)
    try:
        assert eng.step_control.worker is not None and eng.step_control.spill is not None
        eng.backward(eng(*batches(2).next()))
        eng.step()
        stats = eng.last_step_stats
    finally:
        eng.close()
    assert stats.optimizer_wait_s < stats.seconds
    for phase in stats.phases.values():
        assert phase.optimizer_wait_s <= phase.seconds


def test_reads_a_prefetch_pass_waits_for_are_parameter_waits(tmp_path, monkeypatch) -> None:
    """With prefetching on, the forward waits for a slow parameter read mostly in the prefetch
    pass that moves the next unit on (a unit read in place is gathered once its read lands), not
    in a unit's own gather: those waits are the forward's parameter waits all the same, not its
    compute. Every read lands ``READ_S`` late; the tiny model computes in milliseconds."""
    start_read = StoreParamTier._start_read
    late = ThreadPoolExecutor(1)  # the reads land one after another, as from a disk

    def slow_read(self, unit, shard):
        future = start_read(self, unit, shard)
        return late.submit(lambda: time.sleep(READ_S) or future.result())

    monkeypatch.setattr(StoreParamTier, "_start_read", slow_read)
    cfg = config(zero={"stage": 3, "prefetch_mb": 64}, offload={"param": "nvme", "nvme_path": str(tmp_path / "store")})
    eng = Engine(tiny_gpt(), cfg, total_steps=2)
    data = batches(2)
    try:
        for _ in range(2):  # the second step prefetches in the order the first traced
            eng.backward(eng(*data.next()))
            eng.step()
        forward = eng.last_step_stats.phases["forward"]
    finally:
        eng.close()
        late.shutdown()
    assert forward.seconds >= 2 * READ_S  # more than one read was waited for
    assert forward.param_wait_s >= 0.8 * forward.seconds
