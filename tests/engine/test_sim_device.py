"""The engine's streams and events, proven on the simulated asynchronous device.

On the simulated device every host<->device copy lands later, on a worker thread, after a
seeded random delay; its destination reads NaN until then and a source changed meanwhile is
reported. Every stage and tier plan must stay bit-identical to torch AdamW there, as on the
CPU, for several seeds; and each guard, taken out again, must be caught (``GUARDS``): the
fetched buffer released before its copy's event, the gather not waiting for the shard's copy
or for the new master's, the master reused before its copy to the device, the optimizer not
waiting for a gradient copy, a gradient added before its copy into the staging shard. (The
host waits that follow a ``wait_for`` cannot be taken out visibly here: on this device
``wait_for`` already blocks the host.)
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from benchmarks.optimizer import synthetic_layout
from engine.engine import Engine
from engine.runtime.budget import DeviceBudget
from engine.runtime.detect import detect_device
from engine.runtime.device import SIM_ENV
from engine.runtime.sim_device import CopyRaceError, SimDevice
from engine.runtime.sizes import MIB
from engine.runtime.staging import StagingRing
from engine.tiers.parameters import MemoryParamTier
from engine.zero import replicated_params
from engine.zero.divergence import DivergedError
from engine.zero.grads import GradientShards, PendingShard
from engine.zero.unit_params import UnitParams, UnitState
from tests.ranks import run_ranks
from tests.training import (
    batches,
    config,
    rel_diff,
    tiny_gpt,
    train_engine,
    train_engine_on_ranks,
    train_reference,
)

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


def test_a_source_dropped_before_its_copy_ran_is_caught() -> None:
    """A GPU keeps no reference to what a queued copy reads: the caching allocator may hand a
    dropped tensor's memory to the next one while the copy still reads it."""
    device = SimDevice(seed=0, delay_ms=20)
    dst = torch.zeros(1000)
    event = device.copy(dst, torch.arange(1000.0))  # the source's last reference is the call's
    with pytest.raises(CopyRaceError, match="dropped before the copy ran"):
        event.synchronize()


def test_it_counts_host_waits_by_caller_stream_waits_apart_and_bytes_by_direction() -> None:
    device = SimDevice(seed=0, delay_ms=1)
    host, on_device = torch.ones(256, dtype=torch.bfloat16), torch.zeros(256)
    up = device.copy(on_device, host, to_device=True)
    device.wait_for(up)
    down = device.copy(host, on_device, to_device=False)
    down.synchronize()
    device.synchronize()
    counts = device.take_counts()
    caller = f"{__name__}:test_it_counts_host_waits_by_caller_stream_waits_apart_and_bytes_by_direction"
    assert counts.host_syncs == {caller: 2} and counts.stream_waits == {caller: 1}
    assert counts.copied == {
        ("to device", "torch.bfloat16", "torch.float32"): 512,
        ("to host", "torch.float32", "torch.bfloat16"): 1024,
    }
    assert counts.bytes_to_device() == 512
    assert device.take_counts().host_syncs == {}, "taken: counting starts again"
    waited = threading.Thread(target=device.copy(on_device, host).synchronize)
    waited.start()
    waited.join()
    assert device.take_counts().host_syncs == {}, "another thread's wait does not hold the launching thread"


def test_a_master_may_be_reused_as_soon_as_it_is_written_back() -> None:
    """The optimizer tier hands a master's buffer to the next unit when ``write_back`` returns:
    the shard on the device is filled from a staged copy of it, in the compute dtype."""
    device = SimDevice(seed=0, delay_ms=20)
    device.bound_pinned(64 * MIB)
    uploads = StagingRing(device, 16 * MIB, "uploads")
    tier = MemoryParamTier(True, device, torch.bfloat16, DeviceBudget(), uploads)
    unit = synthetic_layout([1000], chunk_mb=1).units[0]
    tier.add(unit, torch.zeros(unit.shard_numel))
    master = torch.randn(unit.shard_numel)
    expected = master.to(torch.bfloat16)
    tier.write_back(unit, master)
    master.fill_(7.0)  # the buffer's next unit
    device.synchronize()
    assert torch.equal(tier.read(unit).wait(), expected)
    assert device.take_counts().copied == {("to device", "torch.bfloat16", "torch.bfloat16"): 2 * unit.shard_numel}


def test_closing_lands_the_copies_and_stops_the_streams() -> None:
    """An engine's close closes its device: a test session makes thousands of engines."""
    device = SimDevice(seed=0, delay_ms=5)
    src, dst = torch.arange(10.0), torch.zeros(10)
    device.copy(dst, src)
    device.close()
    assert torch.equal(dst, src)
    assert not any(thread.is_alive() for thread in device._threads)
    with pytest.raises(RuntimeError, match="closed simulated device"):
        device.copy(dst, src)


def test_the_delays_follow_the_seed_and_the_bandwidth() -> None:
    def timed(device: SimDevice) -> float:
        dst, src = torch.empty(2**20), torch.ones(2**20)
        start = time.perf_counter()
        device.copy(dst, src).synchronize()
        return time.perf_counter() - start

    assert timed(SimDevice(seed=0, delay_ms=0, gbps=0.1)) >= 4 * 2**20 / 0.1e9
    first, second = SimDevice(seed=5), SimDevice(seed=5)
    assert [first._rng.random() for _ in range(3)] == [second._rng.random() for _ in range(3)]


def test_a_stream_runs_its_copies_back_to_back_at_the_bandwidth_however_late_its_thread() -> None:
    """A copy engine runs a stream's copies back to back, so the simulated bus does: each copy
    takes its bytes over the bandwidth from when it was queued or the one before it ended,
    even while the stream's thread is held off by a training thread running Python (here with a
    switch interval long enough that every wake-up is late). A late thread lands its copy late
    but starts no later copy later; the benchmarks' copy time is these spans' sum."""
    device = SimDevice(seed=0, delay_ms=0, gbps=0.02)
    sources = [torch.full((2**18,), float(i)) for i in range(4)]  # 1 MiB each: 52 ms on the bus
    targets = [torch.empty_like(s) for s in sources]
    seconds = sources[0].nbytes / 0.02e9
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    try:
        queued = time.perf_counter()
        events = [device.copy(t, s) for t, s in zip(targets, sources, strict=True)]
        while time.perf_counter() - queued < 0.1:  # the training thread holds the interpreter
            pass
    finally:
        sys.setswitchinterval(interval)
    for event in events:
        event.synchronize()
    later = time.perf_counter()
    device.copy(targets[0], sources[0]).synchronize()
    spans = [(start, end) for _, start, end in device.take_counts().busy]
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))
    assert [end - start for start, end in spans] == pytest.approx([seconds] * 5, abs=1e-9)
    assert spans[0][0] >= queued and all(spans[i][0] == spans[i - 1][1] for i in range(1, 4))
    assert spans[4][0] >= later  # queued with the stream idle: it starts when queued
    device.close()


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


@pytest.mark.parametrize(("stage", "optimizer", "param"), [plan for plan in PLANS if plan[0] == 3])
def test_clipped_stage3_plans_are_bit_identical_with_late_copies(
    stage, optimizer, param, tmp_path, monkeypatch
) -> None:
    """After clipping the units are updated in the order the next forward uses them, and the
    first ones go up to the device while the rest are updated: they must carry the new values."""
    cfg = plan_config(stage, optimizer, param, str(tmp_path / "store"), optim={"grad_clip": 0.05})
    monkeypatch.setenv(SIM_ENV, "seed=5,delay_ms=1")
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


def freed_before_the_copy(self: UnitParams) -> None:
    """``UnitParams.free`` of a prefetch dropped with its copy in flight, without waiting for the
    copy: the fetched buffer goes back to its pool (and the next fetch), and the full buffer's
    memory is freed, while the copy may still read the one and write the other."""
    if self.state is UnitState.SHARDED:
        return
    with self.becoming(UnitState.SHARDED):
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.copied = None
        if self.fetch is not None:
            self.fetch.release()
            self.fetch = None
        if self.state is not UnitState.FETCHING:
            self.flat.untyped_storage().resize_(0)
            self._budget.credit(self.nbytes)


def gather_before_the_copy(self: UnitParams) -> None:
    """``UnitParams.start_gather`` without waiting for the shard's copy."""
    with self.becoming(UnitState.GATHERING):
        self.work = self.all_gather()


def gather_before_the_master_copy(device, comm, flat: torch.Tensor, unit, master: torch.Tensor, uploads):
    """``copy_and_gather`` without the compute stream waiting for the new master's copy before
    the all-gather reads it."""
    own = flat[unit.shard_slice(comm.rank)]
    uploads.upload(own, master)
    return comm.all_gather(flat, own)


def gradient_not_waited_for(self: PendingShard) -> torch.Tensor:
    """``PendingShard.wait`` without waiting for the copy: the optimizer (on the host worker,
    which the simulated device turns on) reads the shard at once."""
    return self.shard


def added_before_the_staging_copy(self: GradientShards, unit, reduced: torch.Tensor) -> None:
    """``_fold`` adding a later micro-batch's reduced shard as soon as its copy into the
    staging ring is queued, not once it has landed."""
    if (self._first_micro_batch or not self._early) and self._keeps(unit, reduced):
        self._charge_shard(unit)
        self.shards[unit.name] = reduced
        return
    target = self._shard(unit)
    if self._first_micro_batch or not self._early:
        copied = self._device.copy(target, reduced, to_device=False)
        self._copies[unit.name] = (copied, None if copied.query() else reduced)
        self._newest_copy = copied
        return
    self.ready(unit.name)
    ring = self._adding_ring()
    staged = ring.take(unit.shard_numel, torch.float32)
    copied = self._device.copy(staged, reduced, to_device=False)
    target.add_(staged)
    ring.give_back_after(copied, staged, then=lambda: reduced)


EVALUATING = (("prefetch_mb", 0.8),)
"""A window of four of the tiny GPT's five units: an evaluation forward ends with one unit's
copy queued for the backward that never comes (``test_evaluations_between_steps_...``)."""


@dataclass(frozen=True)
class Guard:
    """A wait the engine makes, and how to take it out: ``name`` of ``owner`` replaced by ``broken``."""

    owner: object
    name: str
    broken: object
    plan: tuple[int, str, str]
    ranks: int = 1
    """On one rank an all-gather moves nothing: a gather that reads too early needs two."""
    zero: tuple[tuple[str, float], ...] = ()
    evaluate: bool = False
    """Whether an evaluation forward follows each step: its prefetch, copies in flight for a
    backward that never comes, is dropped at the next forward (on the simulated device every
    other release follows a gather that already waited)."""


GUARDS = {
    "buffers freed before their copy's event": Guard(
        UnitParams, "free", freed_before_the_copy, (3, "nvme", "nvme"), zero=EVALUATING, evaluate=True
    ),
    "gather before the shard's copy": Guard(UnitParams, "start_gather", gather_before_the_copy, (3, "nvme", "nvme"), 2),
    "gather before the new master's copy": Guard(
        replicated_params, "copy_and_gather", gather_before_the_master_copy, (2, "nvme", "device"), 2
    ),
    "update before the gradient copy": Guard(PendingShard, "wait", gradient_not_waited_for, (2, "nvme", "device")),
    "addition before the staging copy": Guard(
        GradientShards, "_fold", added_before_the_staging_copy, (2, "nvme", "device"), zero=(("grad_accum_steps", 2),)
    ),
}


def train_engine_evaluating(cfg, steps: int) -> dict:
    """``train_engine``'s steps, each followed by an evaluation forward (of the first batch)."""
    eng = Engine(tiny_gpt(), cfg, total_steps=steps)
    data, evaluation = batches(4), batches(4).next()
    for _ in range(steps):
        eng.backward(eng(*data.next()))
        eng.step()
        with torch.no_grad():
            eng(*evaluation)
    with eng.gathered():
        params = {n: p.detach().float().clone() for n, p in eng.module.named_parameters()}
    eng.close()
    return {"params": params}


def test_evaluations_between_steps_change_nothing_with_late_copies(tmp_path, monkeypatch) -> None:
    """An evaluation's prefetch for a backward that never comes is dropped at the next forward,
    a unit's copy still in flight among it; the training is torch's all the same."""
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=5")
    cfg = plan_config(3, "nvme", "nvme", str(tmp_path / "store"))
    cfg.zero = dataclasses.replace(cfg.zero, **dict(EVALUATING))
    dropped = []
    free = UnitParams.free
    monkeypatch.setattr(UnitParams, "free", lambda self: dropped.append(self.state) or free(self))
    ours = train_engine_evaluating(cfg, STEPS)
    assert UnitState.COPYING in dropped, "no unit was dropped with its copy in flight"
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])


def guard_config(guard: Guard, store: str):
    stage, optimizer, param = guard.plan
    cfg = plan_config(stage, optimizer, param, store, train={"steps": STEPS})
    cfg.zero = dataclasses.replace(cfg.zero, **dict(guard.zero))
    return cfg


def train_without(guard_name: str, cfg, steps: int, micro_batch: int) -> dict:
    """On each rank (a process of its own, for ``run_ranks``): train with the guard taken out."""
    guard = GUARDS[guard_name]
    setattr(guard.owner, guard.name, guard.broken)
    return train_engine_on_ranks(cfg, steps, micro_batch)


@pytest.mark.parametrize("guard_name", list(GUARDS))
def test_each_missing_wait_is_caught(guard_name: str, tmp_path, monkeypatch) -> None:
    """With the wait taken out, copies landing late must show: a race or a divergence the
    engine raises, or parameters that are not torch's."""
    guard = GUARDS[guard_name]
    cfg = guard_config(guard, str(tmp_path / "store"))
    ref = train_reference(cfg, STEPS, micro_batch=4)
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=5")  # the ranks inherit it
    try:
        if guard.ranks == 1:
            monkeypatch.setattr(guard.owner, guard.name, guard.broken)
            results = [train_engine_evaluating(cfg, STEPS) if guard.evaluate else train_engine(cfg, STEPS)]
        else:
            results = run_ranks(guard.ranks, functools.partial(train_without, guard_name), cfg, STEPS, 4 // guard.ranks)
    except (DivergedError, CopyRaceError):
        return  # caught by the engine's own checks, on this process
    except RuntimeError as failed:  # a rank stopped by them
        assert "DivergedError" in str(failed) or "CopyRaceError" in str(failed), failed
        return
    assert all(rel_diff(result["params"], ref["params"]) > 1e-6 for result in results), "the missing wait went unseen"
