"""What one optimizer step cost, split the way a user tuning offload tiers needs it.

The split answers "what is my step waiting on": ``compute_s`` is the time the step's
thread spent neither blocked on a parameter fetch nor on the optimizer's I/O. Waiting
that a prefetch hid costs nothing and is not counted, so ``param_wait_s`` and
``optimizer_wait_s`` are the *exposed* I/O seconds.

The same split is kept for each phase of the step (``phases``): its forwards, its backwards, its
update (``step()``), and ``other``, the training loop's own time between them. A step's waits
say what it waits on; the phases say when, which is what moving a tier or the prefetch window
changes.

What moving the bytes cost the CPU is split by stage of the stores' path (system calls,
CRC-32C, copies, casts, zeroing: ``offload.costs``), per GB moved, beside the CPU the whole
process used: when the disk is fast and the cores few, that cost, not the disk, bounds a step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from offload import CostAccount, per_gb

if TYPE_CHECKING:
    from engine.runtime.budget import DeviceBudget
    from engine.runtime.device import Device
    from engine.tiers.optimizer import OptimizerState
    from engine.zero.params import Params
    from engine.zero.step import StepControl


PHASES = ("forward", "backward", "update")
"""The engine's calls a step is made of: ``eng(...)``, ``eng.backward(loss)`` and ``eng.step()``."""
OTHER = "other"
"""The rest of a step: the training loop's own time between those calls (data, logging)."""


@dataclass
class PhaseStats:
    """Wall time and exposed waits of one phase of a step, summed over its calls (every
    micro-batch's forward, evaluation forwards between steps included)."""

    seconds: float = 0.0
    param_wait_s: float = 0.0
    optimizer_wait_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return max(self.seconds - self.param_wait_s - self.optimizer_wait_s, 0.0)

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"compute_s": self.compute_s}


@dataclass
class StepStats:
    """One optimizer step (all its micro-batches), on this rank."""

    seconds: float = 0.0
    """Wall time from the end of the previous ``step()`` to the end of this one."""
    param_wait_s: float = 0.0
    """Blocked waiting for parameter shards (tier read, host-to-device copy, all-gather)."""
    optimizer_wait_s: float = 0.0
    """Blocked on optimizer-state I/O: reads not ready in time, the last writes, fsync, commit."""
    optimizer_s: float = 0.0
    """Spent in the AdamW update itself (on the step's thread or hidden in backward)."""
    bytes_read: int = 0
    """Bytes read from the store (optimizer state, spilled gradients and parameter shards)."""
    bytes_written: int = 0
    """Bytes written to the store."""
    prefetch_hits: int = 0
    """Stage 3 gathers that found the unit already gathered (or in flight) by prefetch."""
    prefetch_misses: int = 0
    """Stage 3 gathers that had to start from nothing."""
    device_high_water: int = 0
    """Most device bytes the engine held at once during the step."""
    bytes_copied: int = 0
    """Bytes copied between host and device (``Device.copy``) during the step."""
    cpu_s: float = 0.0
    """CPU seconds the whole process used during the step, every thread's (I/O threads too)."""
    io_cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds the I/O threads spent in each stage of the stores' path (``offload.costs.STAGES``)."""
    io_bytes: int = 0
    """Bytes the stores' chunk I/O moved during the step, read plus written, which ``io_cpu_s`` is
    per: the step's own, except that a deferred commit's writes land in the next step's, and a
    checkpoint's copy in the step that takes it."""
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    """The same seconds and waits split by phase (``PHASES`` and ``OTHER``); they sum to the step's."""

    @property
    def compute_s(self) -> float:
        """The rest of the step: forward, backward and everything else not waiting on I/O."""
        return max(self.seconds - self.param_wait_s - self.optimizer_wait_s, 0.0)

    @property
    def prefetch_hit_rate(self) -> float:
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 1.0

    @property
    def io_cpu_s_per_gb(self) -> dict[str, float]:
        """CPU-seconds per GB moved for each stage of ``io_cpu_s``, and their ``total``; empty
        when the step moved nothing through a store."""
        return per_gb({"seconds": self.io_cpu_s, "bytes": {"moved": self.io_bytes}})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "phases": {name: phase.to_dict() for name, phase in self.phases.items()},
            "compute_s": self.compute_s,
            "prefetch_hit_rate": self.prefetch_hit_rate,
            "io_cpu_s_per_gb": self.io_cpu_s_per_gb,
        }


class StepClock(NamedTuple):
    """Where a step started, on the wall clock and on the process's CPU clock."""

    wall: float
    cpu: float

    @classmethod
    def now(cls) -> StepClock:
        return cls(time.perf_counter(), time.process_time())


class PhaseClock:
    """Times each phase of the step in flight as its call ends, and takes the parameter and
    optimizer waits counted since the last take: the waits land in the phase they held up, and
    those between phases (a ``gathered()`` between steps) in ``OTHER``."""

    def __init__(self, params: Params, step: StepControl):
        self._params, self._step = params, step
        self._phases: dict[str, PhaseStats] = {}

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        self._add(OTHER, 0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add(phase, time.perf_counter() - start)

    def _add(self, phase: str, seconds: float) -> None:
        stats = self._phases.setdefault(phase, PhaseStats())
        stats.seconds += seconds
        stats.param_wait_s += self._params.take_wait_s()
        stats.optimizer_wait_s += self._step.take_wait_s()

    def take(self, step_seconds: float) -> dict[str, PhaseStats]:
        """The step's phases, ``OTHER`` given the rest of its ``step_seconds``; the clock starts afresh."""
        self._add(OTHER, 0.0)
        phases, self._phases = self._phases, {}
        other = phases.setdefault(OTHER, PhaseStats())
        other.seconds = max(step_seconds - sum(p.seconds for n, p in phases.items() if n != OTHER), 0.0)
        return phases


def measure_step(
    started: StepClock,
    step: StepControl,
    optimizer_state: OptimizerState,
    params: Params,
    budget: DeviceBudget,
    device: Device,
    costs: CostAccount,
    phases: PhaseClock,
) -> StepStats:
    """The step started at ``started`` and just ended, from the counters each part keeps (and
    resets as they are taken); ``costs`` is the account of every store's I/O; gradients spilled
    to disk count as optimizer-state I/O."""
    ended = StepClock.now()
    split = phases.take(ended.wall - started.wall)
    io = costs.take()
    reads, writes = optimizer_state.take_io_bytes()
    spill_reads, spill_writes = step.take_spill_io_bytes()
    reads, writes = reads + spill_reads, writes + spill_writes
    param_reads, param_writes = params.take_io_bytes()
    hits, misses = params.prefetch_counts()
    return StepStats(
        seconds=ended.wall - started.wall,
        param_wait_s=sum(p.param_wait_s for p in split.values()),
        optimizer_wait_s=sum(p.optimizer_wait_s for p in split.values()),
        optimizer_s=step.take_compute_s(),
        bytes_read=reads + param_reads,
        bytes_written=writes + param_writes,
        prefetch_hits=hits,
        prefetch_misses=misses,
        device_high_water=budget.high_water,
        bytes_copied=device.take_copied_bytes(),
        cpu_s=ended.cpu - started.cpu,
        io_cpu_s=io["seconds"],
        io_bytes=sum(io["bytes"].values()),
        phases=split,
    )
