"""The process's heap for large buffers: freed ones are reused within a bound, fresh ones come
in huge pages.

A training step frees and makes again buffers of a unit's size many times over: gathered
parameters, gradient buckets and shards, and every matmul's temporaries the size of its
weights. Mapped on their own, each is fresh memory at every use, whose first touch costs a
page fault per page: with 4 KiB pages (the kernel's default where transparent huge pages are
``madvise``, as here) writing 256 MiB of new memory took 91 ms, against 14 ms in 2 MiB pages
and 9 ms for memory already mapped. torch backs its large CPU tensors with huge pages when
``THP_MEM_ALLOC_ENABLE`` is set before its first allocation.

Served from glibc's heap instead (its mmap threshold pinned at ``MMAP_THRESHOLD``, above a
7-8B model's largest projection) they reuse memory already resident. But the heap keeps what
it was given back, holes between live buffers included, and the resident set grows far past
what is live (a 2B fine-tune peaked at 2.7 GiB against 1.4); ``engine.runtime.heap_bound``
hands it back beyond a bound. So bounded, a 2B fine-tune's backward took 0.78-0.86x the time
for 0.2 GiB more (docs/benchmarks.md, heap).

Both settings are the process's, so the console command makes them, not the library; a
program embedding the engine may call ``tune_heap`` itself, before it allocates tensors, and
the engine then widens the bound to its model's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from engine.runtime.heap_bound import bound_process_heap

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 256 << 20
"""Allocations of this many bytes or more are mapped on their own (and unmapped when freed);
smaller ones come from the heap."""
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for huge pages under its CPU tensors of 2 MiB or more (read once, at its
first allocation)."""


def tune_heap(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes, bound what the heap keeps of freed
    memory (``engine.runtime.heap_bound``) and ask torch for huge pages (unless the environment
    already says otherwise); False where the C library is not glibc."""
    os.environ.setdefault(TORCH_HUGE_PAGES, "1")
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt here: freed buffers may stay resident")
        return False
    if mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        return False
    bound_process_heap()  # what the heap keeps of freed buffers is bounded from now on
    return True
