"""A ring of pinned host memory that stages what crosses to or from the device.

Two copies need host memory of their own for the life of the copy: a new fp32 master going
up is first rounded to the compute dtype here, on the host, so that two bytes per parameter
cross the bus, not four through an fp32 temporary on the device that no budget counts; and a
later micro-batch's gradient coming down lands here before it is added. Each piece is handed
back once its copy's event completes (``Device.after``), never by the thread that launches
kernels waiting for it; pieces complete in the order their stream ran them, so they are cut
from one ring of fixed size, cut once from the pinned pool. Taking waits only while more than
the whole ring is in flight (the bus behind the host).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from engine.runtime.device import Device, Event
from engine.runtime.pinned import aligned
from engine.runtime.sizes import MIB

MIN_RING_BYTES = 16 * MIB
"""The smallest ring: copies of many small units stay in flight without waiting for each other."""


def ring_bytes(largest_piece: int) -> int:
    """A ring's size for pieces up to ``largest_piece`` bytes: two of them, so that one fills
    while the other crosses, and at least ``MIN_RING_BYTES``."""
    return max(2 * aligned(largest_piece), MIN_RING_BYTES)


class _Piece:
    __slots__ = ("end", "freed", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.freed = start, end, False


class StagingRing:
    """Pieces of one host buffer, taken in turn and given back after their copies."""

    def __init__(self, device: Device, nbytes: int, what: str) -> None:
        self._device = device
        self._memory = device.empty_host(nbytes, torch.uint8, what)
        self._what = what
        self._live: collections.deque[_Piece] = collections.deque()
        self._pieces: dict[int, _Piece] = {}
        """The pieces taken and not yet handed back, by their tensor's address."""
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self._memory.numel()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for one copy; give it back with ``give_back_after``."""
        size = aligned(max(numel * dtype.itemsize, 1))  # an empty shard still takes an address of its own
        if size > self.nbytes:
            raise ValueError(f"{self._what}: a piece of {size} bytes exceeds the ring's {self.nbytes}")
        with self._cond:
            start = self._place(size)
            if start is None:
                self._cond.wait_for(lambda: self._place(size) is not None)
                start = self._place(size)
            assert start is not None
            piece = _Piece(start, start + size)
            self._live.append(piece)
        tensor = self._memory[piece.start : piece.start + numel * dtype.itemsize].view(dtype)
        self._pieces[tensor.data_ptr()] = piece
        return tensor

    def give_back_after(self, event: Event, tensor: torch.Tensor, then: Callable[[], None] | None = None) -> Future:
        """``tensor``'s piece returns to the ring once ``event`` (the copy using it) completes,
        after ``then`` (what uses the bytes a copy brought); a future of when."""
        piece = self._pieces.pop(tensor.data_ptr())

        def done() -> None:
            try:
                if then is not None:
                    then()
            finally:
                self._free(piece)

        return self._device.after(event, done)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Copy host ``src`` into device ``dst`` in ``dst``'s dtype, rounded here on the host;
        ``src`` may be reused when this returns."""
        staged = self.take(src.numel(), dst.dtype)
        staged.copy_(src.reshape(-1))
        copied = self._device.copy(dst, staged.view(dst.shape), to_device=True)
        self.give_back_after(copied, staged)
        return copied

    def _free(self, piece: _Piece) -> None:
        with self._cond:
            piece.freed = True
            while self._live and self._live[0].freed:
                self._live.popleft()
            self._cond.notify_all()

    def _place(self, size: int) -> int | None:
        """Where a piece of ``size`` bytes fits after the newest live piece, or None."""
        if not self._live:
            return 0
        tail, head = self._live[0].start, self._live[-1].end
        if self._live[-1].start >= tail:  # the live pieces do not wrap around the end
            if self.nbytes - head >= size:
                return head
            return 0 if tail >= size else None
        return head if tail - head >= size else None
