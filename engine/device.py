"""The compute device, behind one interface for CUDA (or any torch accelerator) and CPU.

The engine's algorithm is written once against this class: on an accelerator the copy
stream and events are real and host buffers are pinned; on CPU the stream and event
calls go to ``torch.cpu``'s no-op implementations and nothing is pinned (pinning
raises without an accelerator).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    """Where the model computes, which collective backend it uses, and how copies overlap."""

    device: torch.device

    @classmethod
    def detect(cls, local_rank: int | None = None) -> Device:
        """The accelerator for this rank if there is one (``LOCAL_RANK`` picks it), else the CPU."""
        accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accel is None:
            return cls(torch.device("cpu"))
        index = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device(accel.type, index)
        torch.accelerator.set_device_index(index)
        return cls(device)

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"

    @property
    def backend(self) -> str:
        """NCCL on CUDA, gloo on CPU (and as the fallback elsewhere)."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def pin_memory(self) -> bool:
        """Pin host buffers only where an accelerator copies from them asynchronously."""
        return self.is_accelerator

    @property
    def module(self):  # torch.cuda, torch.cpu, ...
        return torch.get_device_module(self.device.type)

    def new_stream(self):
        """A side stream for host<->device copies (a no-op stream on CPU)."""
        return self.module.Stream()

    @contextlib.contextmanager
    def on_stream(self, stream) -> Iterator[None]:
        with self.module.stream(stream):
            yield

    def record_event(self, stream=None):
        """An event marking the work queued so far on ``stream`` (the current one by default)."""
        event = self.module.Event()
        event.record(stream) if stream is not None else event.record()
        return event

    def synchronize(self) -> None:
        self.module.synchronize()

    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that the device can copy from asynchronously (pinned where that exists)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)

    def memory_allocated(self) -> int:
        """Bytes the caching allocator holds for tensors on the device (0 on CPU: the engine counts its own)."""
        return self.module.memory_allocated(self.device) if self.is_accelerator else 0
