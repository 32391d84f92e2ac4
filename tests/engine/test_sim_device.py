"""The engine's streams and events, proven on the simulated asynchronous device.

On the simulated device every host<->device copy lands later, on a worker thread, after a
seeded random delay; its destination reads NaN until then and a source changed meanwhile is
reported. Every stage and tier plan must stay bit-identical to torch AdamW there, as on the
CPU, for several seeds; and each guard, taken out again (the buffer released before the
copy's event, the gather not waiting for the copy, the optimizer not waiting for a gradient
copy), must be caught.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.runtime.detect import detect_device
from engine.runtime.device import SIM_ENV
from engine.runtime.sim_device import CopyRaceError, SimDevice
from engine.zero.divergence import DivergedError
from engine.zero.grads import PendingShard
from engine.zero.unit_params import UnitParams, UnitState
from tests.ranks import run_ranks
from tests.training import config, rel_diff, train_engine, train_engine_on_ranks, train_reference

STEPS = 3
PLANS = [(1, "cpu", "device"), (2, "device", "device"), (2, "nvme", "device")]
PLANS += [(3, optimizer, param) for optimizer in ("cpu", "nvme") for param in ("device", "cpu", "nvme")]


def plan_config(stage: int, optimizer: str, param: str, store: str, **sections):
    return config(
        zero={"stage": stage}, offload={"optimizer": optimizer, "param": param, "nvme_path": store}, **sections
    )


def test_a_copy_lands_later_and_a_reused_source_is_caught() -> None:
    device = SimDevice(seed=0, delay_ms=20)
    src, dst = torch.arange(1000.0), torch.zeros(1000)
    event = device.copy(dst, src)
    assert dst.isnan().all() and not event.query(), "before its event the destination holds nothing yet"
    device.wait_for(event)
    assert torch.equal(dst, src)
    event = device.copy(dst, src)
    src.add_(1)  # the source buffer reused before the copy ran
    with pytest.raises(CopyRaceError, match="changed after the copy was queued"):
        event.synchronize()


def test_the_delays_follow_the_seed_and_the_bandwidth() -> None:
    def timed(device: SimDevice) -> float:
        start = time.perf_counter()
        device.copy(torch.empty(2**20), torch.ones(2**20)).synchronize()
        return time.perf_counter() - start

    assert timed(SimDevice(seed=0, delay_ms=0, gbps=0.1)) >= 4 * 2**20 / 0.1e9
    first, second = SimDevice(seed=5), SimDevice(seed=5)
    assert [first._rng.random() for _ in range(3)] == [second._rng.random() for _ in range(3)]


def test_the_environment_selects_the_sim_device(monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, "seed=2,delay_ms=0.5")
    assert isinstance(detect_device(), SimDevice)
    monkeypatch.setenv(SIM_ENV, "speed=9")
    with pytest.raises(ValueError, match="unknown field"):
        detect_device()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("stage", "optimizer", "param"), PLANS)
def test_every_plan_is_bit_identical_with_late_copies(stage, optimizer, param, seed, tmp_path, monkeypatch) -> None:
    cfg = plan_config(stage, optimizer, param, str(tmp_path / "store"))
    monkeypatch.setenv(SIM_ENV, f"seed={seed},delay_ms=1")
    ours = train_engine(cfg, STEPS)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])


def test_gradient_accumulation_with_late_copies(monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, "seed=3,delay_ms=1")
    accumulated = train_engine(config(zero={"stage": 2, "grad_accum_steps": 3}), STEPS, micro_batch=2)
    large = train_reference(config(), STEPS, micro_batch=2, concat=3)
    assert rel_diff(accumulated["params"], large["params"]) <= 1e-6


def test_two_ranks_with_late_copies(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, "seed=4,delay_ms=1")  # the ranks inherit it
    cfg = plan_config(3, "nvme", "nvme", str(tmp_path / "store"))
    ranks = run_ranks(2, train_engine_on_ranks, cfg, STEPS, 2)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert all(rel_diff(result["params"], ref["params"]) <= 1e-6 for result in ranks)


def gather_before_the_copy(self: UnitParams) -> None:
    """``UnitParams.start_gather`` without waiting for the shard's copy."""
    with self.becoming(UnitState.GATHERING):
        self.work = self.all_gather()


def train_gathering_before_the_copy(cfg, steps: int, micro_batch: int) -> dict:
    """On each rank (a process of its own): train with ``gather_before_the_copy``."""
    UnitParams.start_gather = gather_before_the_copy  # type: ignore[method-assign]
    return train_engine_on_ranks(cfg, steps, micro_batch)


def gradient_not_waited_for(self: PendingShard) -> torch.Tensor:
    """``PendingShard.wait`` without waiting for the copy: the optimizer (on the host worker,
    which the simulated device turns on) reads the shard at once."""
    return self.shard


@pytest.mark.parametrize(
    ("owner", "name", "broken", "stage"),
    [(PendingShard, "wait", gradient_not_waited_for, 2)],
    ids=["update before the gradient copy"],
)
def test_a_missing_wait_is_caught(owner, name, broken, stage, tmp_path, monkeypatch) -> None:
    cfg = plan_config(
        stage, "nvme", "nvme" if stage == 3 else "device", str(tmp_path / "store"), train={"steps": STEPS}
    )
    ref = train_reference(cfg, STEPS, micro_batch=4)
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=5")
    monkeypatch.setattr(owner, name, broken)
    try:
        ours = train_engine(cfg, STEPS)
    except (DivergedError, CopyRaceError):
        return  # caught by the engine's own checks
    assert not all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"]), (
        "the missing wait went unseen"
    )


def test_a_gather_that_does_not_wait_for_its_copy_is_caught(tmp_path, monkeypatch) -> None:
    """On two ranks the all-gather sends each rank's shard to the other: one not yet copied
    into place sends NaN (on one rank the gather moves nothing, so it takes two)."""
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=5")
    cfg = plan_config(3, "nvme", "nvme", str(tmp_path / "store"))
    ref = train_reference(cfg, STEPS, micro_batch=4)
    try:
        ranks = run_ranks(2, train_gathering_before_the_copy, cfg, STEPS, 2)
    except RuntimeError as failed:  # a rank stopped at a diverged step
        assert "DivergedError" in str(failed) or "CopyRaceError" in str(failed), failed
        return
    assert all(rel_diff(result["params"], ref["params"]) > 1e-6 for result in ranks), "the missing wait went unseen"
