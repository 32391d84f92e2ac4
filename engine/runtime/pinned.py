"""One bounded pool of the host memory the device copies from and into asynchronously.

An accelerator copies asynchronously only from page-locked (pinned) host memory, and pinned
memory is taken from the operating system's, beyond what any limit on the process sees:
pinning tensor by tensor, as the run asks for them, is how offload runs end in pinned-memory
OOMs. So the engine pins once: one slab of ``offload.pinned_mb`` (``auto``: what the plan's
copies go through, ``engine.tiers.sizing.pinned_bytes``), allocated at first use, from which
every host tensor a copy reads or fills is cut (``empty``) and to which it returns
(``free``); the host pools that stage store I/O for the device reserve their budgets in it
(``reserve``) and pin their own blocks within them. Whatever does not fit is refused with the
key and the size that fits. On a CPU build nothing can be pinned: the simulated device uses
the same pool over plain memory, so its bound and accounting are tested there.

The slab, and the staging pools' blocks, are pinned at their exact size (rounded up to the
page) by registering mapped memory with CUDA (``offload.host_memory``), never through torch's
pinned allocator, which rounds each allocation up to a power of two (a 104 GiB slab would pin
128 GiB) and caches what is freed: so ``offload.pinned_mb`` bounds what is pinned.
"""

from __future__ import annotations

import collections

import torch

from engine.runtime.sizes import MIB
from offload import host_bytes, pinning_device

ALIGN = 64
"""Bytes each tensor cut from the slab is aligned to (a cache line; any dtype's size divides it)."""

KEY = "offload.pinned_mb"


class PinnedMemoryError(MemoryError):
    """The pinned pool's bound (``offload.pinned_mb``) is too small for what the run needs."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``: what a tensor of them takes from the slab."""
    return -(-nbytes // ALIGN) * ALIGN


class PinnedPool:
    """A slab of ``limit_bytes`` of host memory (pinned if ``pin``), cut into tensors and reserved
    budgets; freed tensors are reused by the next of the same size (a step's gradient shards)."""

    def __init__(self, limit_bytes: int, *, pin: bool) -> None:
        self.limit_bytes = limit_bytes
        self._pin_on = pinning_device() if pin else None
        """The CUDA device the slab is registered under (the rank's), None unpinned."""
        self._slab: torch.Tensor | None = None
        self._top = 0
        """Bytes of the slab cut so far (the end of the last tensor cut)."""
        self._reserved = 0
        """Bytes of the bound reserved for pools that pin their own buffers (not in the slab)."""
        self._free: dict[int, list[int]] = collections.defaultdict(list)
        """Offsets of freed pieces by size, reused before the slab is cut further."""
        self._held: dict[int, tuple[int, int]] = {}
        """Each tensor handed out, by data pointer: its offset and size."""
        self.used_bytes = 0
        """Bytes handed out or reserved now."""
        self.peak_bytes = 0

    def empty(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """An uninitialised 1-D host tensor for ``what``, from the slab."""
        size = aligned(numel * dtype.itemsize)
        reused = self._free[size]
        if reused:
            offset = reused.pop()
        else:
            self._charge(size, what)
            offset, self._top = self._top, self._top + size
        self._count(size)
        tensor = self._slab_bytes()[offset : offset + numel * dtype.itemsize].view(dtype)
        self._held[tensor.data_ptr()] = (offset, size)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Give ``tensor`` (cut by ``empty``) back for reuse; it must not be used after."""
        offset, size = self._held.pop(tensor.data_ptr())
        self._free[size].append(offset)
        self.used_bytes -= size

    def reserve(self, nbytes: int, what: str) -> None:
        """Take ``nbytes`` of the bound for a pool that pins its own buffers within that budget
        (``offload.BufferPool``), for the run."""
        self._charge(nbytes, what)
        self._reserved += nbytes
        self._count(nbytes)

    def _charge(self, nbytes: int, what: str) -> None:
        """Refuse ``nbytes`` more beyond the bound, or once the slab is cut to its size."""
        taken = self._reserved + self._top
        if taken + nbytes > (self.limit_bytes if self._slab is None else self._reserved + self._slab.numel()):
            raise PinnedMemoryError(
                f"{what} needs {nbytes / MIB:.2f} MiB of pinned host memory beyond the {taken / MIB:.2f} MiB "
                f"taken, over {KEY} = {self.limit_bytes / MIB:.4g}: set {KEY} to at least "
                f'{-(-(taken + nbytes) // MIB)} (or "auto")'
            )

    def _count(self, nbytes: int) -> None:
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _slab_bytes(self) -> torch.Tensor:
        """The slab: the bound less what is reserved, allocated (pinned once, whole, at its size)
        at the first tensor cut; a reservation after it would not fit. The tensors cut from it
        keep it, and so its pinning, alive."""
        if self._slab is None:
            self._slab = host_bytes(self.limit_bytes - self._reserved, pin_on=self._pin_on)
        return self._slab

    def check_fits(self, need: dict[str, int]) -> None:
        """Refuse, before anything is allocated, a bound below what the plan's copies go through
        (``need``, by term: ``engine.tiers.sizing.pinned_bytes``)."""
        total = sum(need.values())
        if total > self.limit_bytes:
            terms = ", ".join(f"{name} {nbytes / MIB:.2f}" for name, nbytes in need.items())
            raise PinnedMemoryError(
                f"{KEY} = {self.limit_bytes / MIB:.4g} is below the {total / MIB:.2f} MiB of pinned host memory this "
                f'plan copies through ({terms} MiB): set {KEY} to at least {-(-total // MIB)} (or "auto")'
            )
