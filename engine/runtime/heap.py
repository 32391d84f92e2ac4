"""The process's heap for large buffers: freed ones go back to the system, fresh ones come
in huge pages.

glibc serves an allocation below its mmap threshold from its heap, and raises that
threshold (up to 32 MiB) each time a larger mapped block is freed. A training step frees
and makes again buffers of a unit's size (gathered parameters, gradient buckets and shards,
activations), and building a model frees every unit's fp32 values: once the threshold has
risen past those sizes they all come from the heap, whose holes are reused but seldom
returned, and the resident set grows far past what is live (measured: a 1B-parameter model
on nvme peaked at 4.4 GiB with the default, 1.9 GiB with the threshold pinned at 1 MiB, at
the same step time). Pinning it maps every buffer of 1 MiB or more on its own, so freeing
it returns its memory.

Each such buffer is then fresh memory at every step, and its first touch costs a page fault
per page: with 4 KiB pages (the kernel's default where transparent huge pages are
``madvise``, as here) writing 256 MiB of new memory took 91 ms, against 14 ms in 2 MiB pages
and 9 ms for memory already mapped. torch backs its large CPU tensors with huge pages when
``THP_MEM_ALLOC_ENABLE`` is set before its first allocation; at 1B parameters on nvme the
faults had been a fifth of the process's CPU time.

Both settings are the process's, so the console command makes them, not the library; a
program embedding the engine may call ``tune_heap`` itself, before it allocates tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 20
"""Allocations of this many bytes or more are mapped on their own (and unmapped when freed)."""
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for huge pages under its CPU tensors of 2 MiB or more (read once, at its
first allocation)."""


def tune_heap(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes and ask torch for huge pages (unless
    the environment already says otherwise); False where the C library is not glibc."""
    os.environ.setdefault(TORCH_HUGE_PAGES, "1")
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt here: freed buffers may stay resident")
        return False
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1
