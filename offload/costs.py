"""What moving bytes costs the CPU, stage by stage: a cost account per store.

Each I/O task times its stages with ``time.thread_time`` (CPU seconds of the thread that
runs it, so waiting on the disk costs nothing and another thread's work is not counted):
opening and closing chunk files, the read and write system calls, CRC-32C, copies between
buffers, dtype casts and zeroing. Divided by the bytes moved, that is CPU-seconds per GB
for each stage of the path, the number to cut when the disk is fast and the cores few.
A clock read costs well under a microsecond; a chunk is megabytes, so accounting is
always on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

STAGES = ("open/close", "write syscalls", "read syscalls", "fsync", "crc32c", "copy", "cast", "zero")
"""The stages of the path, in the order a table shows them."""

R = TypeVar("R")


class CostAccount:
    """CPU seconds per stage and bytes moved per direction, summed across threads.

    Thread-safe; ``snapshot`` and ``take`` read it, ``per_gb`` turns a snapshot into
    CPU-seconds per GB moved.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self._bytes = {"read": 0, "written": 0}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds

    def moved(self, direction: str, nbytes: int) -> None:
        """Count ``nbytes`` of payload ``read`` or ``written``."""
        with self._lock:
            self._bytes[direction] += nbytes

    def timed(self, stage: str, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)``, its thread's CPU time added to ``stage``."""
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.add(stage, time.thread_time() - start)

    @contextmanager
    def stage(self, stage: str) -> Iterator[None]:
        start = time.thread_time()
        try:
            yield
        finally:
            self.add(stage, time.thread_time() - start)

    def snapshot(self) -> dict[str, Any]:
        """``{"seconds": {stage: s}, "bytes": {"read": n, "written": n}}``, a copy."""
        with self._lock:
            return {"seconds": dict(self._seconds), "bytes": dict(self._bytes)}

    def take(self) -> dict[str, Any]:
        """The snapshot, and the account started afresh."""
        with self._lock:
            snap = {"seconds": dict(self._seconds), "bytes": dict(self._bytes)}
            self._seconds = dict.fromkeys(STAGES, 0.0)
            self._bytes = {"read": 0, "written": 0}
        return snap


def per_gb(snapshot: dict[str, Any]) -> dict[str, float]:
    """CPU-seconds per GB moved (read plus written) for each stage of ``snapshot``, and their sum."""
    gb = sum(snapshot["bytes"].values()) / 1e9
    if gb <= 0:
        return {}
    rates = {stage: seconds / gb for stage, seconds in snapshot["seconds"].items()}
    rates["total"] = sum(rates.values())
    return rates


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What was accounted between two snapshots."""
    return {
        key: {name: after[key][name] - before[key].get(name, 0) for name in after[key]} for key in ("seconds", "bytes")
    }
