"""Prefetch ahead of compute and write back behind it, in a known order.

The optimizer step (and the stage-3 parameter fetch) visits units in an order
known in advance, so their reads can be issued before they are needed and their
writes finished after compute has moved on; the ideal step then costs
``max(compute, I/O)`` rather than their sum. This module knows nothing of stores
or engines: it is given callables that fill or drain a :class:`HostBuffer`, and a
runner that executes them in the background.

Memory is bounded twice: loads issued but not yet handed to the consumer may
hold at most ``window_bytes`` (never a count of items, since units differ in
size), pending write-backs likewise; and every buffer comes from the pool, whose
budget bounds everything together. For reads and writes to overlap fully the
pool budget should cover two windows plus what the consumer holds.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from offload.buffers import BufferPool, HostBuffer

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Runner(Protocol):
    """Runs a load or save in the background; ``what`` names the task in its errors.

    A load or save may itself start I/O tasks and wait for them (a unit's chunks, each on
    its own I/O thread), so it runs where waiting holds no I/O thread: ``IORunner.coordinate``.
    """

    def coordinate(self, fn: Callable[..., Any], *args: Any, what: str) -> Future[Any]: ...


@dataclass
class PipelineStats:
    """What one run of the pipeline (since the last :meth:`Pipeline.drain`) moved and waited for.

    ``io_busy_s`` sums the seconds the load and save tasks ran, across threads.
    ``read_wait_s`` is consumer time blocked in the iterator (waiting for a
    buffer or a load); ``write_wait_s`` is time blocked on write-back (backpressure
    in :meth:`Pipeline.write_back` and waiting in :meth:`Pipeline.drain`).
    """

    bytes_read: int = 0
    bytes_written: int = 0
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0
    io_busy_s: float = 0.0

    @property
    def hidden_s(self) -> float:
        """I/O seconds the consumer did not wait for: the part overlapped with compute."""
        return max(0.0, self.io_busy_s - self.read_wait_s - self.write_wait_s)


class _Load(NamedTuple):
    item: Any
    buf: HostBuffer
    nbytes: int
    future: Future[Any]


class Pipeline(Generic[T]):
    """Streams items through host buffers: loads ahead of the consumer, saves behind it.

    One thread consumes: it iterates :meth:`read_ahead` and calls :meth:`write_back`,
    :meth:`release` and :meth:`drain`; only the loads and saves run elsewhere.
    """

    def __init__(self, pool: BufferPool, runner: Runner, window_bytes: int) -> None:
        if window_bytes <= 0:
            raise ValueError(f"window_bytes must be positive, got {window_bytes}")
        self.pool = pool
        self.runner = runner
        self.window_bytes = window_bytes
        self._cond = threading.Condition()  # guards stats, pending writes and errors
        self._stats = PipelineStats()
        self._pending_writes = 0
        self._pending_write_bytes = 0
        self._write_errors: list[BaseException] = []
        self._writes_settled = 0  # counts write-backs whose buffer went back to the pool

    def read_ahead(
        self,
        items: Sequence[T],
        *,
        nbytes: Callable[[T], int],
        load: Callable[[T, HostBuffer], None],
        describe: Callable[[T], str] = str,
    ) -> ReadAhead[T]:
        """Yield ``(item, buf)`` in order, each once ``load(item, buf)`` has finished.

        The first loads are issued at once, so a read-ahead opened early (say, before a
        backward pass) has its first items read while other work runs. Loads run on the
        runner ahead of the consumer while the bytes loaded or loading but not yet yielded
        stay within the window (one item always may). An item leaves the window as it is
        handed over, and the loads that refill the window are issued then, so they run
        while the consumer computes. The consumer owns each yielded buffer and hands it
        back with :meth:`write_back` or :meth:`release` before the pool runs dry: the
        iterator waits for pool room only when it has no load out, and that room must come
        from somewhere. A failed load raises here, at its item. ``close()`` (also on
        ``break`` or an exception in a ``with`` block) cancels or waits for the loads still
        out and returns their buffers.
        """
        prefetch = _Prefetch(self, items, nbytes, load, describe)
        prefetch.fill(block=False)
        return ReadAhead(self, prefetch)

    def write_back(
        self,
        item: T,
        buf: HostBuffer,
        save: Callable[[T, HostBuffer], None],
        *,
        describe: Callable[[T], str] = str,
    ) -> Future[Any]:
        """Run ``save(item, buf)`` in the background; ``buf`` returns to the pool when it ends.
        Returns its future, for a reader that must wait for this item's write alone.

        Blocks while pending write-backs hold more than the window (one always
        may be pending). If an earlier write-back failed, releases ``buf``,
        waits for the rest, and raises that failure instead.
        """
        with self._cond:
            failed = bool(self._write_errors)
        if failed:
            self.pool.release(buf)
            self.drain()
        size = buf.nbytes
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(
                lambda: self._pending_writes == 0 or self._pending_write_bytes + size <= self.window_bytes
            )
            self._stats.write_wait_s += time.perf_counter() - start
            self._pending_writes += 1
            self._pending_write_bytes += size
        try:
            future = self.runner.coordinate(
                functools.partial(self._run_io, write=True), save, item, buf, what=f"save {describe(item)}"
            )
        except BaseException:
            self._write_settled(buf, None)
            raise
        future.add_done_callback(lambda f: self._write_settled(buf, f))
        return future

    def release(self, buf: HostBuffer) -> None:
        """Return a consumed buffer that has nothing to write."""
        self.pool.release(buf)

    def drain(self) -> PipelineStats:
        """Wait for every pending write-back and return this run's stats, starting a new run.

        Raises the first write-back failure once all have settled; its notes
        say how many others failed.
        """
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._pending_writes == 0)
            self._stats.write_wait_s += time.perf_counter() - start
            stats, self._stats = self._stats, PipelineStats()
            errors, self._write_errors = self._write_errors, []
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first.add_note(f"{len(errors) - 1} more write-back(s) failed in the same run")
            raise first
        return stats

    def _run_io(self, fn: Callable[[T, HostBuffer], None], item: T, buf: HostBuffer, *, write: bool) -> None:
        """Run one load or save on the runner, timing it and counting the bytes it moved."""
        start = time.perf_counter()
        moved = 0
        try:
            fn(item, buf)
            moved = buf.nbytes
        finally:
            with self._cond:
                self._stats.io_busy_s += time.perf_counter() - start
                if write:
                    self._stats.bytes_written += moved
                else:
                    self._stats.bytes_read += moved

    def _write_settled(self, buf: HostBuffer, future: Future[Any] | None) -> None:
        """Return a write-back's buffer and record how it ended (``future`` is None if never submitted)."""
        error: BaseException | None = None
        if future is not None:
            if future.cancelled():
                error = CancelledError(f"a {buf.nbytes}-byte write-back was cancelled before it ran; its data is lost")
            else:
                error = future.exception()
        self.pool.release(buf)
        with self._cond:
            self._pending_writes -= 1
            self._pending_write_bytes -= buf.nbytes
            self._writes_settled += 1
            if error is not None:
                self._write_errors.append(error)
            self._cond.notify_all()

    def _wake(self, _: Future[Any]) -> None:
        """A load ended: wake a consumer waiting for it (``ReadAhead._await``)."""
        with self._cond:
            self._cond.notify_all()

    def _add_read_wait(self, seconds: float) -> None:
        with self._cond:
            self._stats.read_wait_s += seconds


class ReadAhead(Generic[T]):
    """The consumer's side of :meth:`Pipeline.read_ahead`: an iterator that must be closed
    (exhausting it closes it) so that loads still out return their buffers."""

    def __init__(self, pipeline: Pipeline[T], prefetch: _Prefetch[T]) -> None:
        self._pipeline, self._prefetch = pipeline, prefetch

    def __iter__(self) -> ReadAhead[T]:
        return self

    def __next__(self) -> tuple[T, HostBuffer]:
        prefetch, pipeline = self._prefetch, self._pipeline
        try:
            prefetch.fill(block=not prefetch.queue)
            if not prefetch.queue:
                raise StopIteration
            head = prefetch.queue[0]
            start = time.perf_counter()
            try:
                self._await(head)
            finally:
                pipeline._add_read_wait(time.perf_counter() - start)
            prefetch.pop()
            # The consumer owns head.buf from here on, so waiting for room could wait on it.
            try:
                prefetch.fill(block=False)
            except BaseException:
                pipeline.pool.release(head.buf)
                raise
        except BaseException:
            self.close()
            raise
        return head.item, head.buf

    def _await(self, head: _Load) -> None:
        """Wait for the head load, raising its failure. Meanwhile, each time a write-back gives
        its buffer back, issue the loads the pool had no room for, so that the disk has reads
        queued while it writes; else they would wait for the consumer's next item."""
        pipeline = self._pipeline
        with pipeline._cond:
            seen = pipeline._writes_settled
        while not head.future.done():
            self._prefetch.fill(block=False)
            with pipeline._cond:
                while not head.future.done() and pipeline._writes_settled == seen:
                    pipeline._cond.wait()
                seen = pipeline._writes_settled
        head.future.result()

    def close(self) -> None:
        self._prefetch.abandon()

    def __del__(self) -> None:
        # As a generator would be: a read-ahead dropped unfinished gives its buffers back.
        self.close()

    def __enter__(self) -> ReadAhead[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Prefetch(Generic[T]):
    """The loads of one read-ahead, issued in order and bounded by the pipeline's window."""

    def __init__(
        self,
        pipeline: Pipeline[T],
        items: Sequence[T],
        nbytes: Callable[[T], int],
        load: Callable[[T, HostBuffer], None],
        describe: Callable[[T], str],
    ) -> None:
        self.pipeline = pipeline
        self.queue: collections.deque[_Load] = collections.deque()
        self._upcoming = iter(items)
        self._next: tuple[T, int] | None = None  # the first item not yet issued, with its size
        self._nbytes = nbytes
        self._load = load
        self._describe = describe
        self._outstanding = 0  # bytes of issued loads not yet handed to the consumer

    def fill(self, *, block: bool) -> None:
        """Issue loads while the window has room; wait for a pool buffer only if ``block``."""
        pipeline = self.pipeline
        while True:
            if self._next is None:
                try:
                    item = next(self._upcoming)
                except StopIteration:
                    return
                self._next = (item, self._nbytes(item))
            item, size = self._next
            if self.queue and self._outstanding + size > pipeline.window_bytes:
                return
            if block and not self.queue:
                start = time.perf_counter()
                try:
                    buf = pipeline.pool.acquire(size)
                finally:
                    pipeline._add_read_wait(time.perf_counter() - start)
            else:
                try:
                    buf = pipeline.pool.acquire(size, timeout=0)
                except TimeoutError:
                    return  # the pool is full; retry once a buffer comes back
            try:
                future = pipeline.runner.coordinate(
                    functools.partial(pipeline._run_io, write=False),
                    self._load,
                    item,
                    buf,
                    what=f"load {self._describe(item)}",
                )
            except BaseException:
                pipeline.pool.release(buf)
                raise
            future.add_done_callback(pipeline._wake)
            self._next = None
            self.queue.append(_Load(item, buf, size, future))
            self._outstanding += size

    def pop(self) -> _Load:
        """Hand the head load (finished) to the consumer, which takes it out of the window."""
        head = self.queue.popleft()
        self._outstanding -= head.nbytes
        return head

    def abandon(self) -> None:
        """Cancel the loads not yet started, wait for the running ones, and free their buffers."""
        for entry in self.queue:
            entry.future.cancel()
        for entry in self.queue:
            if not entry.future.cancelled():
                try:
                    entry.future.result()
                except BaseException as exc:  # nobody wants this item any more
                    logger.debug("discarding a failed load of an abandoned item: %r", exc)
            self.pipeline.pool.release(entry.buf)
        self.queue.clear()
        self._outstanding = 0
