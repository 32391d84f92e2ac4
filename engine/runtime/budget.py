"""The device bytes the engine holds, against ``zero.device_memory_limit_mb``.

Every device allocation the engine makes for model state (parameter shards, gathered
units, gradient buckets, shards of the optimizer tier) is charged here and credited when
freed, so the high-water mark is a count, not a guess from an allocator that on a CPU
build does not exist. Only prefetch is optional: it asks ``fits`` first and is skipped
when the answer is no; everything else is required, and a required charge that exceeds
the limit is an error naming what asked for it.
"""

from __future__ import annotations

from engine.runtime.sizes import MIB


class DeviceMemoryError(MemoryError):
    """The engine needs more device memory than ``zero.device_memory_limit_mb`` allows."""


class DeviceBudget:
    """Bytes charged against an optional limit (0: unlimited), with a high-water mark."""

    def __init__(self, limit_bytes: int = 0):
        self.limit = limit_bytes
        self.used = 0
        self.high_water = 0
        self.run_high_water = 0
        """The most ever held, across every step (``high_water`` restarts with each step)."""

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would stay within the limit."""
        return not self.limit or self.used + nbytes <= self.limit

    def charge(self, nbytes: int, what: str) -> None:
        """Hold ``nbytes`` more for ``what``; raises if that breaks the limit."""
        if not self.fits(nbytes):
            raise DeviceMemoryError(
                f"{what} needs {nbytes / MIB:.2f} MiB of device memory with {self.used / MIB:.2f} MiB already "
                f"held, over zero.device_memory_limit_mb = {self.limit / MIB:.4g}; raise the limit or use "
                f"smaller units (zero.unit_classes)"
            )
        self.used += nbytes
        self.high_water = max(self.high_water, self.used)
        self.run_high_water = max(self.run_high_water, self.used)

    def credit(self, nbytes: int) -> None:
        """``nbytes`` charged earlier are free again."""
        self.used -= nbytes

    def start_step(self) -> None:
        """Measure the next step's high-water mark from what is held now."""
        self.high_water = self.used
