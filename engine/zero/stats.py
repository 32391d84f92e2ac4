"""What one optimizer step cost, split the way a user tuning offload tiers needs it.

The split answers "what is my step waiting on": ``compute_s`` is the time the step's
thread spent neither blocked on a parameter fetch nor on the optimizer's I/O. Waiting
that a prefetch hid costs nothing and is not counted, so ``param_wait_s`` and
``optimizer_wait_s`` are the *exposed* I/O seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.runtime.budget import DeviceBudget
    from engine.runtime.device import Device
    from engine.tiers.grad_spill import GradSpill
    from engine.tiers.optimizer import OptimizerState
    from engine.zero.params import ReplicatedParams, ShardedParams
    from engine.zero.update import Update


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

    @property
    def compute_s(self) -> float:
        """The rest of the step: forward, backward and everything else not waiting on I/O."""
        return max(self.seconds - self.param_wait_s - self.optimizer_wait_s, 0.0)

    @property
    def prefetch_hit_rate(self) -> float:
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 1.0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self) | {"compute_s": self.compute_s, "prefetch_hit_rate": self.prefetch_hit_rate}


def measure_step(
    seconds: float,
    update: Update,
    optimizer_state: OptimizerState,
    params: ReplicatedParams | ShardedParams,
    budget: DeviceBudget,
    device: Device,
    spill: GradSpill | None = None,
) -> StepStats:
    """The step just ended, from the counters each part keeps (and resets as they are taken);
    gradients spilled to disk count as optimizer-state I/O."""
    reads, writes = optimizer_state.take_io_bytes()
    if spill is not None:
        spill_reads, spill_writes = spill.take_io_bytes()
        reads, writes = reads + spill_reads, writes + spill_writes
    param_reads, param_writes = params.take_io_bytes()
    hits, misses = params.prefetch_counts()
    return StepStats(
        seconds=seconds,
        param_wait_s=params.take_wait_s(),
        optimizer_wait_s=update.wait_s,
        optimizer_s=update.compute_s,
        bytes_read=reads + param_reads,
        bytes_written=writes + param_writes,
        prefetch_hits=hits,
        prefetch_misses=misses,
        device_high_water=budget.high_water,
        bytes_copied=device.take_copied_bytes(),
    )
