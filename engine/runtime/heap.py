"""Give freed buffers back to the system: pin glibc's mmap threshold.

glibc serves an allocation below its mmap threshold from its heap, and raises that
threshold (up to 32 MiB) each time a larger mapped block is freed. A training step frees
and makes again buffers of a unit's size (gathered parameters, gradient buckets and shards,
activations), and building a model frees every unit's fp32 values: once the threshold has
risen past those sizes they all come from the heap, whose holes are reused but seldom
returned, and the resident set grows far past what is live (measured: a 1B-parameter model
on nvme peaked at 4.4 GiB with the default, 1.9 GiB with the threshold pinned at 1 MiB, at
the same step time). Pinning it maps every buffer of 1 MiB or more on its own, so freeing
it returns its memory. The setting is the process's, so the console command makes it, not
the library; a program embedding the engine may call ``return_freed_buffers`` itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 20
"""Allocations of this many bytes or more are mapped on their own (and unmapped when freed)."""
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


def return_freed_buffers(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes; False where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt here: freed buffers may stay resident")
        return False
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1
