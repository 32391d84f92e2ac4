"""What one optimizer step cost, split the way a user tuning offload tiers needs it.

The split answers "what is my step waiting on": ``compute_s`` is the time the step's
thread spent neither blocked on a parameter fetch nor on the optimizer's I/O. Waiting
that a prefetch hid costs nothing and is not counted, so ``param_wait_s`` and
``optimizer_wait_s`` are the *exposed* I/O seconds.

What moving the bytes cost the CPU is split by stage of the stores' path (system calls,
CRC-32C, copies, casts, zeroing: ``offload.costs``), per GB moved, beside the CPU the whole
process used: when the disk is fast and the cores few, that cost, not the disk, bounds a step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from offload import CostAccount, per_gb

if TYPE_CHECKING:
    from engine.runtime.budget import DeviceBudget
    from engine.runtime.device import Device
    from engine.tiers.optimizer import OptimizerState
    from engine.zero.params import Params
    from engine.zero.step import StepControl


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


def measure_step(
    started: StepClock,
    step: StepControl,
    optimizer_state: OptimizerState,
    params: Params,
    budget: DeviceBudget,
    device: Device,
    costs: CostAccount,
) -> StepStats:
    """The step started at ``started`` and just ended, from the counters each part keeps (and
    resets as they are taken); ``costs`` is the account of every store's I/O; gradients spilled
    to disk count as optimizer-state I/O."""
    ended = StepClock.now()
    io = costs.take()
    reads, writes = optimizer_state.take_io_bytes()
    spill_reads, spill_writes = step.take_spill_io_bytes()
    reads, writes = reads + spill_reads, writes + spill_writes
    param_reads, param_writes = params.take_io_bytes()
    hits, misses = params.prefetch_counts()
    return StepStats(
        seconds=ended.wall - started.wall,
        param_wait_s=params.take_wait_s(),
        optimizer_wait_s=step.wait_s,
        optimizer_s=step.compute_s,
        bytes_read=reads + param_reads,
        bytes_written=writes + param_writes,
        prefetch_hits=hits,
        prefetch_misses=misses,
        device_high_water=budget.high_water,
        bytes_copied=device.take_copied_bytes(),
        cpu_s=ended.cpu - started.cpu,
        io_cpu_s=io["seconds"],
        io_bytes=sum(io["bytes"].values()),
    )
