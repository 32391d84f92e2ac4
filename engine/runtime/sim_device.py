"""A simulated asynchronous device: host memory, and copies that run later.

On CPU every copy is synchronous, so a missing event wait, a host buffer reused before its
copy ran, or a destination read before it was filled cannot go wrong there, and nothing
tests the engine's streams and events. This device makes each of them go wrong, in CPU
tests. Its "device" tensors are host tensors and compute runs on the calling thread, as the
default stream would; but every copy queued through ``Device.copy`` runs later, on the copy
stream's own worker thread, in order, after a seeded random delay (or at a set bandwidth).
When a copy is queued its destination is poisoned (NaN), so a read before the event gives
NaN, and its source is kept aside: a copy whose source changed before it ran (a buffer
released and reused too early) is recorded and raised as ``CopyRaceError`` at the next wait
on any of its events. Waiting for an event (``wait_for``, ``synchronize``) blocks the host,
which is what the compute stream waiting for it means when the host is that stream.

Selected with the environment variable ``OFFLOAD_SIM_DEVICE`` (``seed=S,delay_ms=D,gbps=B``,
each optional) by ``engine.runtime.detect``: for tests and benchmarks only.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import torch

from engine.runtime.device import Device


class CopyRaceError(RuntimeError):
    """A copy's source changed between the copy being queued and it running."""


class SimEvent:
    """The completion of one simulated copy (or of everything queued before a marker)."""

    def __init__(self, device: SimDevice):
        self._device = device
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._done.wait()
        self._device.raise_race()

    def query(self) -> bool:
        return self._done.is_set()


def _alive(t: torch.Tensor) -> bool:
    """Whether the tensor's memory is still there (a released stage-3 unit resizes its storage
    to nothing; a copy landing there would write into freed memory)."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class SimDevice(Device):
    """The CPU, with copies that complete later, on one worker thread (the copy stream)."""

    def __init__(self, seed: int = 0, delay_ms: float = 1.0, gbps: float = 0.0, sync: bool = False):
        super().__init__(torch.device("cpu"))
        self._sync = sync
        self._rng = random.Random(seed)
        self._delay_s, self._bytes_per_s = delay_ms / 1000, gbps * 1e9
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        self._races: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="sim-copy-stream", daemon=True).start()

    @classmethod
    def from_spec(cls, spec: str) -> SimDevice:
        """``"seed=3,delay_ms=2,gbps=4,sync=1"`` (any subset, empty for the defaults); ``sync=1``
        makes every copy complete before ``copy`` returns: the synchronous engine to compare with."""
        fields = dict(part.split("=", 1) for part in spec.split(",") if part.strip())
        unknown = set(fields) - {"seed", "delay_ms", "gbps", "sync"}
        if unknown:
            raise ValueError(
                f"OFFLOAD_SIM_DEVICE={spec!r}: unknown field(s) {sorted(unknown)}; use seed, delay_ms, gbps, sync"
            )
        return cls(
            int(fields.get("seed", 0)),
            float(fields.get("delay_ms", 1.0)),
            float(fields.get("gbps", 0.0)),
            fields.get("sync", "0") == "1",
        )

    @property
    def copies_are_synchronous(self) -> bool:
        return False

    @property
    def backend(self) -> str:
        return "gloo"

    def _queue_copy(self, dst: torch.Tensor, src: torch.Tensor) -> SimEvent:
        """Queue the copy; the delay is drawn here, in queue order, so a seed fixes it."""
        duration = self._rng.uniform(0.0, 2 * self._delay_s)
        if self._bytes_per_s:
            duration += src.nbytes / self._bytes_per_s
        kept = src.detach().clone()
        if dst.is_floating_point():
            dst.fill_(float("nan"))
        event = SimEvent(self)
        self._copies.put((dst, src, kept, duration, event))
        if self._sync:
            event.synchronize()
        return event

    def wait_for(self, event: SimEvent) -> None:  # type: ignore[override]
        event.synchronize()

    def synchronize(self) -> None:
        """Wait for every copy queued so far."""
        marker = SimEvent(self)
        self._copies.put((None, None, None, 0.0, marker))
        marker.synchronize()

    def raise_race(self) -> None:
        with self._lock:
            races, self._races = self._races, []
        if races:
            raise CopyRaceError(f"{len(races)} copy source(s) changed before their copy ran; the first: {races[0]}")

    def _run(self) -> None:
        while True:
            dst, src, kept, duration, event = self._copies.get()
            if dst is not None:
                time.sleep(duration)
                race = self._race(dst, src, kept)
                if race:
                    with self._lock:
                        self._races.append(race)
                else:
                    dst.copy_(src)
            event._done.set()

    @staticmethod
    def _race(dst: torch.Tensor, src: torch.Tensor, kept: torch.Tensor) -> str | None:
        """What went wrong with a copy's tensors between its queueing and now, if anything."""
        if not (_alive(dst) and _alive(src)):
            return "the copy's source or destination was freed before the copy's event completed"
        if not _same_bytes(src, kept):
            return (
                f"{src.numel()} {src.dtype} elements were changed after the copy was queued: a buffer was reused, or "
                f"a tensor written, before the copy's event completed"
            )
        return None
