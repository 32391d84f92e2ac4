"""A bound on what the process's heap keeps of the memory it was given back.

With the engine's heap (``engine.runtime.heap``) buffers under the mmap threshold come from
glibc's heap and go back to it when freed, so the next step's temporaries of the same sizes
reuse memory already resident instead of faulting fresh pages in. The heap returns little of
it by itself: holes between live buffers stay resident. ``HeapBound`` watches the process's
resident set from a thread of its own and hands every free page back (``malloc_trim``)
whenever the resident set has grown by more than ``keep`` since the last time it did, and
every ``REFRESH_S`` whatever it holds; so the resident set stays within ``keep`` of the
largest live set seen at a trim, which is what the memory estimate charges for the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time

KEEP_UNITS = 4
"""The heap keeps this many of the largest unit's compute-dtype buffers: a unit's forward and
backward make temporaries the size of its weights (their gradients, matmuls' packed copies)."""
KEEP_MIN = 32 << 20
"""Nor less than this, the process's keep before a model is built (its data read, its store probed)."""
KEEP_LIMIT = 1 << 30
"""Nor more than this, whatever the unit: a mixture of experts' fused expert unit is computed
expert by expert, in temporaries of one expert's size."""
POLL_S = 0.005
"""How often the resident set is read: each read costs about 10 us, and between two reads the
training thread can grow the resident set by what it allocates in that time."""
REFRESH_S = 10.0
"""At least this often the heap hands back what it keeps, however little: the bound is counted
from the resident set after the last hand-back, which a past peak would otherwise hold high."""
STATM = "/proc/self/statm"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def keep_bytes(largest_unit_bytes: int) -> int:
    """What the heap may keep of freed memory for a model whose largest unit's full buffer in
    the compute dtype is ``largest_unit_bytes``."""
    return max(KEEP_MIN, min(KEEP_UNITS * largest_unit_bytes, KEEP_LIMIT))


def resident_bytes() -> int:
    """This process's resident set now."""
    with open(STATM, "rb") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


class HeapBound:
    """Hands the heap's free pages back whenever the resident set has grown by more than
    ``keep`` bytes since the last hand-back (``check``), every ``POLL_S`` on its own thread
    once ``start`` ed."""

    def __init__(self, keep: int):
        self.keep = keep
        self.trims = 0
        self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        self._floor = resident_bytes()
        self._trimmed_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="heap-bound", daemon=True)

    def check(self) -> bool:
        """Trim if the resident set is more than ``keep`` above what it was after the last trim,
        or that was ``REFRESH_S`` ago; whether it trimmed."""
        due = time.monotonic() - self._trimmed_at >= REFRESH_S
        if not due and resident_bytes() <= self._floor + self.keep:
            return False
        self._trim(0)
        self._floor, self._trimmed_at = resident_bytes(), time.monotonic()
        self.trims += 1
        return True

    def start(self) -> HeapBound:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self.check()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


_process_bound: HeapBound | None = None


def bound_process_heap() -> HeapBound:
    """The process's bound, started with the smallest keep (``tune_heap`` starts it as it lets
    the heap keep what it frees, so no step of the process goes unbounded)."""
    global _process_bound
    if _process_bound is None:
        _process_bound = HeapBound(keep_bytes(0)).start()
        os.register_at_fork(after_in_child=_bound_child)
    return _process_bound


def _bound_child() -> None:
    """A forked child (a data loader's worker) has the parent's heap setting but not its thread."""
    global _process_bound
    assert _process_bound is not None  # registered as the bound started
    _process_bound = HeapBound(_process_bound.keep).start()


def keep_for(largest_unit_bytes: int) -> None:
    """Let the process's heap keep what a model whose largest unit's full buffer in the compute
    dtype is ``largest_unit_bytes`` makes and frees again (never less than it keeps already);
    nothing where the heap is not bounded: there glibc maps large buffers on their own and
    returns them as they are freed."""
    if _process_bound is not None:
        _process_bound.keep = max(_process_bound.keep, keep_bytes(largest_unit_bytes))
