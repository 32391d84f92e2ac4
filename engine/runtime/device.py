"""The compute device, behind one interface for CUDA (or any torch accelerator), CPU and a
simulated asynchronous device.

The engine's algorithm is written once against this class. Every copy between host and
device goes through ``copy``, queued on the copy stream of its direction (parameters going to
the device, gradients coming back: one stream each, so that both directions of the bus are
used at once) behind the work already queued on the compute stream, and returns an event;
whoever reads the destination waits for that event first, the compute stream with
``wait_for``, and a host buffer the copy reads is handed back with ``after`` (the training
thread never waits for a copy to reuse a buffer). On an accelerator that is what lets copies overlap compute; on CPU copies
are synchronous and the events are already complete, so a missing wait is invisible there:
``engine.runtime.sim_device`` runs copies later, on worker threads, to make it visible in tests.
``engine.runtime.detect`` picks the one a rank computes on.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

from engine.runtime.completions import Completions, DoneEvent
from engine.runtime.pinned import PinnedPool


class Event(Protocol):
    """A point in a stream's queue of work."""

    def synchronize(self) -> None:
        """Block the host until the work queued before the point is done."""
        ...

    def query(self) -> bool:
        """Whether it is done."""
        ...


class Device:
    """Where the model computes, which collective backend it uses, and how copies overlap."""

    def __init__(self, device: torch.device):
        self.device = device
        self._copy_streams: dict[bool, torch.Stream] = {}
        """By direction (True: to the device), made at the first copy each way."""
        self._copied = 0
        self._completions = Completions(self.bind_thread)
        self.pinned: PinnedPool | None = None
        """The bounded pool of host tensors that copies read or fill (``bound_pinned``); None
        where the device is the host."""

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"

    @property
    def copies_are_synchronous(self) -> bool:
        """Whether a copy is done when ``copy`` returns (CPU): nothing gains from waiting to use it."""
        return not self.is_accelerator

    @property
    def computes_on_host_memory(self) -> bool:
        """Whether the device's tensors are host memory (CPU): a disk read can land where the
        compute reads it, with no copy up."""
        return not self.is_accelerator

    @property
    def backend(self) -> str:
        """NCCL on CUDA, gloo on CPU (and as the fallback elsewhere)."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def pin_memory(self) -> bool:
        """Pin host buffers only where CUDA copies from them asynchronously: pinning registers
        memory with CUDA at its exact size (``offload.host_memory``); another accelerator's
        copies read plain memory."""
        return self.device.type == "cuda"

    @property
    def module(self):  # torch.cuda, torch.cpu, ...
        return torch.get_device_module(self.device.type)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_device: bool | None = None) -> Event:
        """``dst.copy_(src)``, queued on the copy stream of its direction (``to_device``: towards
        the compute, as parameters go; else back, as gradients go; by default from where
        ``src`` is) after the work already queued on the compute stream (which may be
        producing ``src``). Until the returned event completes neither tensor may be touched:
        the compute stream waits for it (``wait_for``) before reading ``dst``, and a host
        buffer is handed back with ``after``."""
        self._copied += src.nbytes
        return self._queue_copy(dst, src, src.device.type == "cpu" if to_device is None else to_device)

    def _queue_copy(self, dst: torch.Tensor, src: torch.Tensor, to_device: bool) -> Event:
        if not self.is_accelerator:
            dst.copy_(src)
            return DoneEvent()
        stream = self._copy_streams.get(to_device)
        if stream is None:
            stream = self._copy_streams[to_device] = self.module.Stream()
        stream.wait_stream(self.module.current_stream())
        with self.module.stream(stream):
            dst.copy_(src, non_blocking=True)
        event = self.module.Event()
        event.record(stream)
        return event

    def after(self, event: Event, release: Callable[[], None]) -> Future:
        """Run ``release`` (give back a buffer a copy reads, or use what it filled) once
        ``event`` has completed, without holding this thread (``engine.runtime.completions``);
        a future of when it has run."""
        return self._completions.after(event, release)

    def bind_thread(self) -> None:
        """Make this thread's device calls go to this device (a new thread's go to device 0)."""
        if self.is_accelerator and self.device.index is not None:
            self.module.set_device(self.device)

    def close(self) -> None:
        """Run the releases still waiting for their copies, and stop their thread."""
        self._completions.close()

    def take_copied_bytes(self) -> int:
        """Bytes copied by ``copy`` since the last call."""
        copied, self._copied = self._copied, 0
        return copied

    def wait_for(self, event: Event) -> None:
        """The compute stream waits for ``event`` (the host does not)."""
        if self.is_accelerator:
            self.module.current_stream().wait_event(event)

    def synchronize(self) -> None:
        self.module.synchronize()

    def bound_pinned(self, limit_bytes: int) -> PinnedPool | None:
        """Give the device its one pool of ``limit_bytes`` for host tensors that copies read or
        fill, where it is apart from the host (pinned on CUDA; plain memory on the
        simulated device, bounded and counted the same); None where copies are synchronous."""
        if self.copies_are_synchronous:
            return None
        self.pinned = PinnedPool(limit_bytes, pin=self.pin_memory)
        return self.pinned

    def empty_host(self, numel: int, dtype: torch.dtype, what: str = "a host buffer") -> torch.Tensor:
        """A host tensor for ``what`` that the device can copy from and into asynchronously: from
        the pinned pool, where there is one."""
        if self.pinned is None:
            return torch.empty(numel, dtype=dtype)
        return self.pinned.empty(numel, dtype, what)

    def free_host(self, tensor: torch.Tensor) -> None:
        """Give a tensor from ``empty_host`` back (after the copies using it are done)."""
        if self.pinned is not None:
            self.pinned.free(tensor)

    def memory_allocated(self) -> int:
        """Bytes the caching allocator holds for tensors on the device (0 on CPU: the engine counts its own)."""
        return self.module.memory_allocated(self.device) if self.is_accelerator else 0


SIM_ENV = "OFFLOAD_SIM_DEVICE"
"""Set (to ``seed=S,delay_ms=D,gbps=B,sync=1``, each optional) to run on the simulated asynchronous
device (see ``engine.runtime.sim_device``)."""
