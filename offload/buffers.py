"""Reusable host buffers under a byte budget.

Every host byte that moves between tiers is staged through a :class:`BufferPool`,
so peak host memory is set by one number (the budget) and can be reported.
Buffers are kept and reused rather than freed: first touch of fresh memory runs
near 0.9 GB/s here, several times slower than copying into memory already
mapped. Buffers are aligned (4 KiB by default) because ``O_DIRECT`` I/O needs
aligned memory and plain torch allocations are not page-aligned. Where a CUDA
accelerator exists the memory is pinned, at its exact size (``offload.host_memory``),
so host-device copies can run asynchronously; a CPU-only build has nothing to pin.
"""

from __future__ import annotations

import bisect
import logging
import operator
import threading
import time
from types import TracebackType

import torch

from offload.host_memory import PAGE, host_bytes, pinning_device

DIRECT_ALIGN = 4096
"""O_DIRECT wants buffer address, length and file offset aligned to the logical block size;
4096 covers every common device."""

logger = logging.getLogger(__name__)


_capacity = operator.attrgetter("capacity")


def _round_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def _allocate(nbytes: int, alignment: int, pin_on: int | None, huge_pages: bool) -> torch.Tensor:
    """Return an uninitialised uint8 tensor of ``nbytes`` whose first byte is aligned: page-aligned
    memory of that size (pinned on CUDA device ``pin_on`` unless None), one ``alignment`` more
    only where the alignment is beyond a page."""
    extra = 0 if alignment <= PAGE else alignment
    raw = host_bytes(nbytes + extra, pin_on=pin_on, huge_pages=huge_pages)
    start = -raw.data_ptr() % alignment
    return raw[start : start + nbytes]


class _Block:
    """One allocation owned by a pool; it outlives the leases that hand it out."""

    __slots__ = ("capacity", "memory")

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.capacity = memory.numel()


class HostBuffer:
    """A lease on pooled host memory, valid until it is released.

    A fresh lease object is made for every acquire, so a stale reference to an
    earlier lease of the same memory cannot release or read it by accident.
    """

    def __init__(self, pool: BufferPool, block: _Block, nbytes: int) -> None:
        self._pool = pool
        self._block: _Block | None = block
        self.nbytes = nbytes

    @property
    def released(self) -> bool:
        return self._block is None

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements over this buffer's memory (no copy)."""
        block = self._leased_block()
        itemsize = dtype.itemsize
        if offset_bytes < 0 or numel < 0:
            raise ValueError(f"view needs offset_bytes >= 0 and numel >= 0, got {offset_bytes} and {numel}")
        if offset_bytes % itemsize:
            raise ValueError(
                f"offset_bytes={offset_bytes} is not a multiple of the {itemsize}-byte size of {dtype}; "
                "align the offset to the element size"
            )
        end = offset_bytes + numel * itemsize
        if end > self.nbytes:
            raise ValueError(
                f"a view of {numel} x {dtype} at byte {offset_bytes} ends at byte {end}, "
                f"past this {self.nbytes}-byte buffer; acquire a larger buffer"
            )
        return block.memory[offset_bytes:end].view(dtype)

    def _leased_block(self) -> _Block:
        if self._block is None:
            raise RuntimeError("this HostBuffer was released to its pool; acquire a new one")
        return self._block

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._pool.release(self)


class BufferPool:
    """Hands out aligned host buffers, never holding more than ``budget_bytes``.

    Accounting is in allocation sizes (requests rounded up to ``alignment``):
    ``in_use_bytes`` is what is leased now, ``peak_bytes`` its high-water mark,
    ``allocated_bytes`` what is actually held (leased plus cached for reuse).
    A released buffer is cached and handed to the next request it can hold
    (best fit); a request that no cached buffer fits gets fresh memory, freeing
    cached buffers first when they stand between it and the budget.
    Memory is in huge pages unless ``huge_pages`` is False (base pages: what
    ``benchmarks.tiers`` measures as the path before them). Pinned memory is registered under
    the CUDA device current where the pool is made (``host_memory.pinning_device``).
    """

    def __init__(
        self, budget_bytes: int, *, pin: bool | None = None, alignment: int = DIRECT_ALIGN, huge_pages: bool = True
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
        elif pin and not cuda:
            raise ValueError("pin=True needs an accelerator (CUDA), and none is available; pass pin=None or pin=False")
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._pin_on = pinning_device() if pin else None
        self.huge_pages = huge_pages
        self.alignment = alignment
        self._cond = threading.Condition()
        self._free: list[_Block] = []  # sorted by capacity, for best fit
        self._in_use = 0
        self._allocated = 0
        self._peak = 0

    @property
    def in_use_bytes(self) -> int:
        with self._cond:
            return self._in_use

    @property
    def peak_bytes(self) -> int:
        with self._cond:
            return self._peak

    @property
    def allocated_bytes(self) -> int:
        with self._cond:
            return self._allocated

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> HostBuffer:
        """Lease a buffer of at least ``nbytes``, blocking while the budget is in use.

        Raises ``ValueError`` if the request can never fit the budget and
        ``TimeoutError`` if it did not fit within ``timeout`` seconds.
        """
        size = self._size(nbytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                cached = self._lease_cached(size, nbytes)
                if cached is not None:
                    return cached
                if self._in_use + size <= self.budget_bytes:
                    self._evict_for(size)
                    # Reserve before allocating so other threads see the bytes as taken
                    # while the (slow, pinned) allocation runs outside the lock.
                    self._allocated += size
                    self._lease(size)
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"no {size}-byte buffer became free within {timeout} s: {self._in_use} of "
                        f"{self.budget_bytes} budget bytes are in use; release buffers sooner or raise the budget"
                    )
                self._cond.wait(remaining)
        try:
            memory = _allocate(size, self.alignment, self._pin_on, self.huge_pages)
        except BaseException:
            with self._cond:
                self._allocated -= size
                self._in_use -= size
                self._cond.notify_all()
            raise
        return HostBuffer(self, _Block(memory), nbytes)

    def _size(self, nbytes: int) -> int:
        """The bytes a request for ``nbytes`` leases, refused if it can never fit the budget."""
        if nbytes < 0:
            raise ValueError(f"cannot acquire a buffer of {nbytes} bytes")
        size = _round_up(max(nbytes, 1), self.alignment)
        if size > self.budget_bytes:
            raise ValueError(
                f"a buffer of {nbytes} bytes ({size} after rounding to the {self.alignment}-byte alignment) "
                f"exceeds the host buffer budget of {self.budget_bytes} bytes; "
                f"raise the buffer budget to at least {size} bytes or split the transfer"
            )
        return size

    def acquire_spare(self, nbytes: int) -> HostBuffer | None:
        """Lease a buffer of at least ``nbytes`` that the pool holds free, or any while none is
        in use; else None, at once. A caller that can do without one takes no memory that an
        ``acquire`` made later, once buffers in use come back, would not have taken."""
        with self._cond:
            cached = self._lease_cached(self._size(nbytes), nbytes)
            if cached is not None or self._in_use:
                return cached
        return self.acquire(nbytes)

    def release(self, buf: HostBuffer) -> None:
        """Return a leased buffer to the cache and wake anyone waiting for room."""
        if buf._pool is not self:
            raise ValueError("this HostBuffer belongs to another BufferPool; release it to the pool it came from")
        with self._cond:
            block = buf._leased_block()
            buf._block = None
            self._in_use -= block.capacity
            bisect.insort(self._free, block, key=_capacity)
            self._cond.notify_all()

    def _lease_cached(self, size: int, nbytes: int) -> HostBuffer | None:
        """A cached block of at least ``size`` bytes leased for ``nbytes``, if the pool holds one (under the lock)."""
        block = self._take_cached(size)
        if block is None:
            return None
        self._lease(block.capacity)
        return HostBuffer(self, block, nbytes)

    def _take_cached(self, size: int) -> _Block | None:
        index = bisect.bisect_left(self._free, size, key=_capacity)
        if index == len(self._free):
            return None
        # A cached block is already counted in allocated bytes, so leasing it cannot pass the budget.
        return self._free.pop(index)

    def _evict_for(self, size: int) -> None:
        """Free cached blocks, smallest first, until ``size`` more bytes fit the budget."""
        while self._allocated + size > self.budget_bytes:
            block = self._free.pop(0)
            self._allocated -= block.capacity
            logger.debug("freeing a cached %d-byte host buffer to make room for %d bytes", block.capacity, size)

    def _lease(self, size: int) -> None:
        self._in_use += size
        self._peak = max(self._peak, self._in_use)
