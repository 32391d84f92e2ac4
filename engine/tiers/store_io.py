"""The I/O settings every store a run opens shares, built once from the config.

The optimizer tier, the parameter tier and the memory tiers' checkpoints all read and write
through one ``IORunner``: one pool of I/O threads for the process, so ``offload.io_threads``
bounds the threads the run starts, whichever tiers are on disk. The engine closes it once,
after every tier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.config import OffloadConfig
from offload import IORunner


@dataclass(frozen=True)
class StoreIO:
    """How the tiers' stores move bytes: the shared runner, checksums, direct I/O, and the
    barrier that orders the ranks' work on a store."""

    runner: IORunner
    checksum: bool
    direct_io: bool
    barrier: Callable[[], None]

    @classmethod
    def from_config(cls, offload: OffloadConfig, barrier: Callable[[], None]) -> StoreIO:
        return cls(IORunner(threads=offload.io_threads), offload.checksum, offload.direct_io, barrier)

    def close(self) -> None:
        """Finish the pending I/O and stop the threads (after every tier is closed)."""
        self.runner.close()
