"""Host memory at its exact size, pinned (page-locked for the accelerator's copies) where asked.

torch's pinned host allocator (``torch.empty(..., pin_memory=True)``) rounds each allocation up
to a power of two and keeps the blocks freed in a cache of its own: a slab of 104 GiB pins
128 GiB, and what a pool lets go of stays pinned. So pinned memory here is private anonymous
memory mapped at the size asked (rounded up to the page) and registered with CUDA
(``cudaHostRegister``): what is pinned is what was asked, and a bound on it
(``offload.pinned_mb``) holds. The registration ends exactly when the memory goes: the mapping
object, which every tensor view of it keeps alive, unregisters it when the last view is gone,
before the memory is unmapped. Nothing is registered on a build without CUDA, where ``pin`` is
never asked for.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20
"""The size of a transparent huge page on x86-64 and arm64 (4 KiB base pages)."""
KEY = "offload.pinned_mb"
MIB = 1 << 20

logger = logging.getLogger(__name__)


class PinningError(MemoryError):
    """The host refused to page-lock memory for the accelerator."""


def pinning_device() -> int:
    """The CUDA device pinned memory is registered and unregistered under: the one current on
    the thread that makes a pool (the rank's, set by the engine before it builds), so that a
    pool used from a thread that never set a device (an I/O thread) makes no CUDA context on
    device 0 when it pins or unpins."""
    return torch.cuda.current_device()


def register(address: int, nbytes: int, device: int) -> None:
    """Page-lock ``nbytes`` at ``address`` for CUDA's copies, or raise naming what to lower."""
    with torch.cuda.device(device):
        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
    if code:
        raise PinningError(
            f"pinning {nbytes / MIB:.1f} MiB of host memory failed (cudaHostRegister error {code}): "
            f"the host cannot lock that much; lower {KEY} or the host buffers that count in it"
        )


def unregister(address: int, device: int) -> None:
    """End the registration ``register`` made at ``address``."""
    with torch.cuda.device(device):
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
    if code:
        logger.warning("unpinning host memory at %#x failed (cudaHostUnregister error %d)", address, code)


class _Mapping(mmap.mmap):
    """Anonymous memory that ends its registration with CUDA, if any, as it goes."""

    pinned: tuple[int, int] | None = None
    """Its address and the device it is registered under, once registered."""

    def __del__(self, finalizing=sys.is_finalizing) -> None:
        # At interpreter exit the process's memory and pins go with it: CUDA may be torn down.
        if self.pinned is not None and not finalizing():
            unregister(*self.pinned)


def host_bytes(nbytes: int, *, pin_on: int | None = None, huge_pages: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` at the start of page-aligned private
    anonymous memory of ``nbytes`` rounded up to the page, its pages made when first written
    (in huge pages where ``huge_pages`` and the kernel allows); pinned, registered under CUDA
    device ``pin_on``, unless that is None.

    Huge pages make an O_DIRECT transfer cheap for the CPU: the kernel pins and maps a 16 MiB
    chunk as 8 pages instead of 4096 (`python -m benchmarks.tiers`: the read and write system
    calls cost about a sixth as much), and the checksum misses the TLB less. Private, not
    shared: the kernel backs only private anonymous memory with them on request."""
    mapped = -(-max(nbytes, 1) // PAGE) * PAGE
    memory = _Mapping(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and mapped >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    if pin_on is not None:
        register(whole.data_ptr(), mapped, pin_on)
        memory.pinned = (whole.data_ptr(), pin_on)
    return whole[:nbytes]


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory (contiguous) with a storage of its own, which owns nothing:
    what is done to the alias's storage (a numpy view of it, as the store takes of what it reads
    into, leaves a storage unable to change size for good) leaves ``t``'s as it was. Valid while
    ``t``'s memory is."""
    if not t.nbytes:
        return torch.empty_like(t)
    raw = (ctypes.c_uint8 * t.nbytes).from_address(t.data_ptr())
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape)
