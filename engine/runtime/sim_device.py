"""A simulated asynchronous device: host memory, and copies that run later.

On CPU every copy is synchronous, so a missing event wait, a host buffer reused before its
copy ran, or a destination read before it was filled cannot go wrong there, and nothing
tests the engine's streams and events. This device makes each of them go wrong, in CPU
tests. Its "device" tensors are host tensors and compute runs on the calling thread, as the
default stream would; but every copy queued through ``Device.copy`` runs later, on the worker
thread of its direction's copy stream, in order, after a seeded random delay (or at a set
bandwidth each way, as a bus that moves both ways at once). A stream's copies take the bus back
to back, each from when it is queued or the one before it ends, as a copy engine runs them: a
stream's thread that wakes late (held off by the interpreter lock while the training thread
runs Python) lands that copy late, but delays no copy after it.
When a copy is queued its destination is poisoned (NaN), so a read before the event gives
NaN, and its source is kept aside: a copy whose source changed before it ran (a buffer
released and reused too early) is recorded and raised as ``CopyRaceError`` at the next wait
on any of its events. The queue holds only weak references to the copy's storages, as a GPU
holds none: a tensor dropped before its copy ran (on CUDA, memory the caching allocator may
hand to the next tensor while the copy still reads it) is a race too.

It also counts what a GPU would make costly (``take_counts``): each host synchronization by
the code that asked for it (the thread that created the device, which launches the
kernels: a wait on the host optimizer worker or the completion thread does not hold it),
each stream wait apart from them, and the bytes of every copy by direction and dtypes. A
stream wait (``wait_for``) blocks the host here, because the host thread is the compute
stream; it is counted as a stream wait, which on CUDA costs the host nothing.

Selected with the environment variable ``OFFLOAD_SIM_DEVICE`` (``seed=S,delay_ms=D,gbps=B``,
each optional) by ``engine.runtime.detect``: for tests and benchmarks only.
"""

from __future__ import annotations

import collections
import queue
import random
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.runtime.device import Device


class CopyRaceError(RuntimeError):
    """A copy's source changed between the copy being queued and it running."""


DIRECTIONS = {True: "to device", False: "to host"}
"""How counts name a copy's direction, by whether it goes to the device."""


@dataclass
class SimCounts:
    """What the simulated device saw since the last ``take_counts``."""

    host_syncs: collections.Counter[str] = field(default_factory=collections.Counter)
    """Waits that held the launching thread, by the function that asked (``module:qualname``)."""
    stream_waits: collections.Counter[str] = field(default_factory=collections.Counter)
    """``wait_for`` calls, by the function that asked: free for the host on a GPU."""
    copied: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    """Bytes moved, by (direction, source dtype, destination dtype); the direction is
    ``to device`` or ``to host``."""
    busy: list[tuple[str, float, float]] = field(default_factory=list)
    """When each copy stream was moving bytes: (direction, start, end) of every copy on the bus,
    in ``time.perf_counter`` seconds, for a timeline of where the streams idle."""

    def bytes_to_device(self) -> int:
        return sum(n for (direction, *_), n in self.copied.items() if direction == "to device")


_OWN_FILES = {str(Path(__file__)), str(Path(__file__).with_name("device.py"))}


def _caller() -> str:
    """The function outside the device's own code that asked for a wait."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename in _OWN_FILES:
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "?")
    return f"{module}:{frame.f_code.co_qualname}"


class SimEvent:
    """The completion of one simulated copy (or of everything queued before a marker)."""

    def __init__(self, device: SimDevice):
        self._device = device
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._device.count_host_sync()
        self._done.wait()
        self._device.raise_race()

    def query(self) -> bool:
        return self._done.is_set()


@dataclass
class _Held:
    """A copy's tensor by weak reference to its storage, and where in it the tensor lies."""

    storage: weakref.ref
    dtype: torch.dtype
    offset: int
    size: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> _Held:
        return cls(weakref.ref(t.untyped_storage()), t.dtype, int(t.storage_offset()), t.size(), t.stride())

    def tensor(self) -> torch.Tensor | str:
        """The tensor again, or what became of its memory: dropped, or freed (a released stage-3
        unit resizes its storage to nothing; a copy landing there would write into freed memory)."""
        storage = self.storage()
        if storage is None:
            return "the copy's source or destination was dropped before the copy ran (its memory could be reused)"
        extent = self.offset + sum((n - 1) * st for n, st in zip(self.size, self.stride, strict=True)) + 1
        if storage.nbytes() < extent * self.dtype.itemsize:  # ``set_`` would grow it back
            return "the copy's source or destination was freed before the copy's event completed"
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclass
class _Copy:
    """A queued copy, as its stream's thread takes it."""

    dst: _Held
    src: _Held
    kept: torch.Tensor | None
    """The source as it was when queued, to find it changed (None: an earlier copy fills it)."""
    duration: float
    event: SimEvent
    spans: tuple[tuple[int, int], tuple[int, int]]
    """The byte spans the copy reads and writes."""
    poison_late: bool
    """The destination is poisoned when the copy runs: an earlier copy on the stream reads it."""
    queued_by: str
    queued_at: float = field(default_factory=time.perf_counter)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses a contiguous tensor's bytes lie between."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class SimDevice(Device):
    """The CPU, with copies that complete later, on a worker thread per direction (the copy streams)."""

    def __init__(self, seed: int = 0, delay_ms: float = 1.0, gbps: float = 0.0, sync: bool = False):
        super().__init__(torch.device("cpu"))
        self._sync = sync
        self._rng = random.Random(seed)
        self._delay_s, self._bytes_per_s = delay_ms / 1000, gbps * 1e9
        self._races: list[str] = []
        self._lock = threading.Lock()
        self._counts = SimCounts()
        self._launcher = threading.get_ident()
        self._closed = False
        self._copies: dict[bool, queue.SimpleQueue[_Copy | SimEvent | None]] = {}
        """Each copy stream's queue, by direction (True: to the device): copies, and markers that
        every copy before them has landed."""
        self._pending: dict[bool, list[tuple[tuple[int, int], tuple[int, int]]]] = {}
        """The byte spans each copy queued on a stream and not yet run reads and writes."""
        self._threads: list[threading.Thread] = []
        for to_device in (True, False):
            self._copies[to_device], self._pending[to_device] = queue.SimpleQueue(), []
            name = f"sim-copy-stream-{'up' if to_device else 'down'}"
            self._threads.append(threading.Thread(target=self._run, args=(to_device,), name=name, daemon=True))
            self._threads[-1].start()

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
    def computes_on_host_memory(self) -> bool:
        return False  # it stands in for an accelerator, whose memory a disk read does not reach

    @property
    def backend(self) -> str:
        return "gloo"

    def _queue_copy(self, dst: torch.Tensor, src: torch.Tensor, to_device: bool) -> SimEvent:
        """Queue the copy; the delay is drawn here, in queue order, so a seed fixes it."""
        if self._closed:
            raise RuntimeError("a copy on a closed simulated device: its engine was closed")
        duration = self._rng.uniform(0.0, 2 * self._delay_s)
        if self._bytes_per_s:
            duration += src.nbytes / self._bytes_per_s
        with self._lock:
            key = (DIRECTIONS[to_device], str(src.dtype), str(dst.dtype))
            self._counts.copied[key] += src.nbytes
        source, target = _span(src), _span(dst)
        pending = self._pending[to_device]
        with self._lock:
            # A copy stream runs its copies in order: a destination that an earlier copy on the
            # stream still reads is poisoned only when this copy runs, and a source that one
            # still fills is not compared with what it holds now. (The other stream's copies
            # are not ordered with these: an overlap with them is a race, as on a GPU.)
            poison_now = dst.is_floating_point() and not any(_overlap(target, s) for s, _ in pending)
            filled_first = any(_overlap(source, t) for _, t in pending)
            pending.append((source, target))
        kept = None if filled_first else src.detach().clone()
        if poison_now:
            dst.fill_(float("nan"))
        event = SimEvent(self)
        copy = _Copy(_Held.of(dst), _Held.of(src), kept, duration, event, (source, target), not poison_now, _caller())
        self._copies[to_device].put(copy)
        if self._sync:  # the synchronous engine: not a wait the engine asked for
            event._done.wait()
        return event

    def close(self) -> None:
        """Run the releases still waiting, let the copies queued land, and stop the copy
        streams' threads: a copy queued after this is refused."""
        super().close()
        if self._closed:
            return
        self._closed = True
        for copies in self._copies.values():
            copies.put(None)
        for thread in self._threads:
            thread.join()

    def wait_for(self, event: SimEvent) -> None:  # type: ignore[override]
        """The compute stream (here the host thread) waits for ``event``: counted as a stream wait."""
        with self._lock:
            self._counts.stream_waits[_caller()] += 1
        event._done.wait()
        self.raise_race()

    def synchronize(self) -> None:
        """Wait for every copy queued so far, on both streams (all have landed once closed)."""
        self.count_host_sync()
        if self._closed:
            self.raise_race()
            return
        for copies in self._copies.values():
            marker = SimEvent(self)
            copies.put(marker)
            marker._done.wait()
        self.raise_race()

    def count_host_sync(self) -> None:
        """Count a wait that holds the host, if it holds the launching thread."""
        if threading.get_ident() == self._launcher:
            with self._lock:
                self._counts.host_syncs[_caller()] += 1

    def take_counts(self) -> SimCounts:
        """What was counted since the last call."""
        with self._lock:
            counts, self._counts = self._counts, SimCounts()
        return counts

    def raise_race(self) -> None:
        with self._lock:
            races, self._races = self._races, []
        if races:
            raise CopyRaceError(f"{len(races)} copy source(s) changed before their copy ran; the first: {races[0]}")

    def _run(self, to_device: bool) -> None:
        free_at = 0.0  # when the bus ends the stream's last copy
        while True:
            item = self._copies[to_device].get()
            if item is None:
                return
            if isinstance(item, SimEvent):
                item._done.set()
                continue
            if item.poison_late and isinstance(poisoned := item.dst.tensor(), torch.Tensor):
                poisoned.fill_(float("nan"))
                del poisoned
            start = max(item.queued_at, free_at)
            free_at = start + item.duration
            time.sleep(max(0.0, free_at - time.perf_counter()))
            dst, src = item.dst.tensor(), item.src.tensor()
            race = self._race(dst, src, item.kept)
            if race:
                with self._lock:
                    self._races.append(f"{race} (a copy queued by {item.queued_by})")
            else:
                assert isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)  # ``_race`` found both
                dst.copy_(src)
            del dst, src
            with self._lock:  # only now is the copy's destination written
                self._pending[to_device].remove(item.spans)
                self._counts.busy.append((DIRECTIONS[to_device], start, free_at))
            item.event._done.set()

    @staticmethod
    def _race(dst: torch.Tensor | str, src: torch.Tensor | str, kept: torch.Tensor | None) -> str | None:
        """What went wrong with a copy's tensors between its queueing and now, if anything."""
        for held in (dst, src):
            if isinstance(held, str):
                return held
        assert isinstance(src, torch.Tensor)
        if kept is not None and not _same_bytes(src, kept):
            return (
                f"{src.numel()} {src.dtype} elements were changed after the copy was queued: a buffer was reused, or "
                f"a tensor written, before the copy's event completed"
            )
        return None
