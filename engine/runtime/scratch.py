"""Scratch tensors reused by one thread across calls, instead of fresh memory each time.

A buffer of a unit's size made anew at every update is fresh memory each time: on the host
a large allocation is mapped on its own (``engine.runtime.heap``) and its first touch costs a
page fault per page, which for a one-pass operation costs several times the operation. A
buffer kept per thread (each host thread, the training thread and the optimizer worker,
updates one unit at a time) and per device is written over instead; its writes and the reads
that follow are the calling thread's, in order on the device's stream.
"""

from __future__ import annotations

import threading

import torch

_BUFFERS = threading.local()


def scratch(purpose: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` elements of this thread's buffer for ``purpose`` on ``device``, grown to the
    longest asked for yet: valid until the thread's next call for the same purpose and device,
    its contents whatever the last use left. Not a view of the buffer but a tensor of its own
    over the buffer's memory: a compiled kernel given a view guards on its base's length too,
    which grows with the longest asked for yet, and compiles again for every shard shorter
    than the one the buffer was grown for (the update's mask: 1.4-7.6 s on a step's path)."""
    buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = _BUFFERS.__dict__.setdefault("held", {})
    key = (purpose, dtype, device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(buffer.untyped_storage(), 0, (numel,), (1,))
