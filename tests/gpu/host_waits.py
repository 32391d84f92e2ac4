"""Counting the host's waits on a CUDA device, by the calls that make them.

A training step on CUDA keeps the GPU busy only while the host runs ahead of it: every call
that blocks the host until queued device work is done (an event's or a stream's
``synchronize``, a device-wide ``synchronize``, reading a device tensor's value on the host)
drains the queue and leaves the GPU idle while the host issues the next work. ``HostWaits``
replaces each such call with one that counts and calls through, and tells where it was made:
on the step's own path, whose waits stall the step (the training thread, which made the
counter, and autograd's thread while it runs backward, where the engine's hooks reduce and
copy the gradients: on CUDA backward runs on a thread of its own), or on the engine's helper
threads (the host optimizer worker, the store's I/O), which wait for their own copies without
holding the step up.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

PATCHED: dict[str, tuple[Any, str, bool]] = {
    "Event.synchronize": (torch.cuda.Event, "synchronize", False),
    "Stream.synchronize": (torch.cuda.Stream, "synchronize", False),
    "torch.cuda.synchronize": (torch.cuda, "synchronize", False),
    "torch.accelerator.synchronize": (torch.accelerator, "synchronize", False),
    "Tensor.item": (torch.Tensor, "item", True),
    "Tensor.tolist": (torch.Tensor, "tolist", True),
    "Tensor.cpu": (torch.Tensor, "cpu", True),
    "float(Tensor)": (torch.Tensor, "__float__", True),
    "int(Tensor)": (torch.Tensor, "__int__", True),
    "bool(Tensor)": (torch.Tensor, "__bool__", True),
}
"""What blocks the host, by name: (owner, attribute, whether it waits only on a CUDA tensor).
A tensor's value read on the host waits only where the tensor is on the device: a CPU
tensor's ``item`` is not counted. (``torch.Event`` and ``torch.Stream``, the device-generic
types, cannot be patched: ``test_the_counter_sees_every_kind_of_host_wait`` checks that the
engine's copies return ``torch.cuda.Event``.)"""


class HostWaits:
    """Counts of the host's waits by kind, on the step's path (``training``) and on the helper threads."""

    def __init__(self) -> None:
        self.training: collections.Counter[str] = collections.Counter()
        self.helpers: collections.Counter[str] = collections.Counter()
        self._training_thread = threading.get_ident()
        self._lock = threading.Lock()

    def _counted(self, kind: str, call: Callable[..., Any], tensor_only: bool) -> Callable[..., Any]:
        @functools.wraps(call)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not tensor_only or args[0].is_cuda:
                in_backward = torch._C._current_graph_task_id() != -1
                on_step = in_backward or threading.get_ident() == self._training_thread
                with self._lock:
                    (self.training if on_step else self.helpers)[kind] += 1
            return call(*args, **kwargs)

        return counted

    @contextmanager
    def counting(self) -> Iterator[HostWaits]:
        """Count every host wait made inside, on any thread."""
        with pytest.MonkeyPatch.context() as patch:
            for kind, (owner, name, tensor_only) in PATCHED.items():
                patch.setattr(owner, name, self._counted(kind, getattr(owner, name), tensor_only))
            yield self

    def describe(self) -> str:
        """Both counts, for an assertion message."""
        return f"on the step's path {dict(self.training)}, on helper threads {dict(self.helpers)}"
