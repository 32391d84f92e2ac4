"""The asynchronous I/O runner: a few threads, a bounded number of tasks in flight.

Disk I/O in Python releases the GIL inside the system call, so a handful of
threads doing positional reads and writes keep the disk busy while the
training loop computes. The runner bounds how many tasks may be pending at
once, so a producer that outruns the disk is slowed down (backpressure)
instead of queueing an unbounded amount of work and memory.

It runs two kinds of task, on two sets of threads, so that none can wait for a
thread that is itself waiting:

- a *leaf* task (`submit`: one chunk, one fsync) runs on an I/O thread and
  never waits on another task; it may not submit one either;
- a *compound* task (`coordinate`: a unit's shards, chunk after chunk) runs on
  a coordinating thread of its own. It submits leaf tasks and waits for them, so
  a unit's chunks are read and written on every I/O thread at once. A waiting
  coordinator holds no I/O thread, and leaf tasks always finish, so it always
  gets its slots and results.

Work that follows a leaf task and needs little of the disk (verifying the checksum of
the bytes a read brought, appending a written chunk's) runs on a third set, the checking
threads (`then`): the I/O thread goes back to I/O at once, so the disk is not left idle
while a chunk is checksummed.

`IORunner.gather` combines futures with done-callbacks instead of a waiting
thread, so callers can wait on many tasks at once.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


class OffloadIOError(OSError):
    """An I/O task failed.

    The message names the task (what was moved, which range, which file), the
    original error is chained as `__cause__`, and `errno` is kept so that
    callers can still tell ENOSPC from EIO.
    """


def _wrap_os_error(err: OSError, what: str) -> OffloadIOError:
    """Name the failed task while keeping errno recognisable, and the file unless `what` names it."""
    if err.errno is None:
        return OffloadIOError(f"{what}: {err}")
    reason = err.strerror or str(err)
    if err.filename is None or str(err.filename) in what:
        return OffloadIOError(err.errno, f"{what}: {reason}")
    return OffloadIOError(err.errno, f"{what}: {reason}", err.filename)


def _run_task(fn: Callable[..., Any], args: tuple[Any, ...], what: str) -> Any:
    """Run one task; OS errors become `OffloadIOError`, other errors get a note naming the task.

    Non-OS errors keep their type (a checksum mismatch must stay a
    `ValueError` subclass the caller can catch) and only gain a note.
    """
    try:
        return fn(*args)
    except OffloadIOError:
        raise
    except OSError as err:
        raise _wrap_os_error(err, what) from err
    except Exception as err:
        err.add_note(f"in I/O task: {what}")
        raise


def _pass_on(follow: Future, done: Future) -> None:
    """Complete ``follow`` as ``done`` completed."""
    error = CancelledError("an I/O task was cancelled") if done.cancelled() else done.exception()
    if error is not None:
        follow.set_exception(error)
    else:
        follow.set_result(done.result())


class _Gather:
    """Completion state of one `IORunner.gather` call, driven by done-callbacks."""

    __slots__ = ("_combined", "_first_error", "_futures", "_lock", "_remaining")

    def __init__(self, futures: list[Future], combined: Future) -> None:
        self._futures = futures
        self._combined = combined
        self._lock = threading.Lock()
        self._remaining = len(futures)
        self._first_error: BaseException | None = None

    def on_done(self, future: Future) -> None:
        error = CancelledError("an I/O task was cancelled") if future.cancelled() else future.exception()
        with self._lock:
            if error is not None and self._first_error is None:
                self._first_error = error
            self._remaining -= 1
            if self._remaining:
                return
        if self._first_error is not None:
            self._combined.set_exception(self._first_error)
        else:
            self._combined.set_result([f.result() for f in self._futures])


class IORunner:
    """A pool of I/O threads with a bounded number of pending leaf tasks, and coordinating
    threads for compound tasks (see the module's note).

    `submit` blocks its caller while `queue_depth` leaf tasks are pending (queued or
    running). `coordinate` never blocks: its callers bound what they issue (the
    pipeline by bytes). Results and errors come back through `concurrent.futures.Future`.
    """

    def __init__(self, threads: int = 4, queue_depth: int = 32) -> None:
        if threads < 1:
            raise ValueError(f"IORunner threads must be >= 1, got {threads}")
        if queue_depth < 1:
            raise ValueError(f"IORunner queue_depth must be >= 1, got {queue_depth}")
        self.threads = threads
        self.queue_depth = queue_depth
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._local = threading.local()
        self._closed = False
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="offload-io", initializer=self._mark, initargs=("leaf",)
        )
        # As many as I/O threads: small units, a chunk or two each, still keep every thread busy.
        self._coordinators = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="offload-unit", initializer=self._mark, initargs=("compound",)
        )
        # One per core, at most the I/O threads: a checksum runs at memory speed, many times the disk's.
        self._checks = ThreadPoolExecutor(
            max_workers=min(threads, os.cpu_count() or 1),
            thread_name_prefix="offload-check",
            initializer=self._mark,
            initargs=("leaf",),
        )

    def _mark(self, role: str) -> None:
        self._local.role = role

    def _refuse(self, role: str, what: str) -> None:
        """Refuse a task that the calling thread could wait on forever; or one after `close`."""
        if self._closed:
            raise RuntimeError(f"IORunner is closed; cannot submit: {what}")
        if getattr(self._local, "role", None) == role:
            where, instead = (
                ("an I/O thread", "run it inside a compound task (IORunner.coordinate)")
                if role == "leaf"
                else ("a coordinating thread", "do that work in the calling task itself")
            )
            raise RuntimeError(
                f"cannot start {what!r} from {where}: it could wait for a thread that waits for it; {instead}"
            )

    def submit(self, fn: Callable[..., Any], *args: Any, what: str) -> Future:
        """Run `fn(*args)`, a leaf task that waits on no other task, on an I/O thread;
        `what` names the task in any error. Blocks while `queue_depth` leaf tasks are pending.
        Refused on an I/O thread itself, where waiting for a slot could wait forever."""
        self._refuse("leaf", what)
        self._slots.acquire()
        try:
            future = self._pool.submit(_run_task, fn, args, what)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(self._release_slot)
        return future

    def coordinate(self, fn: Callable[..., Any], *args: Any, what: str) -> Future:
        """Run `fn(*args)`, a compound task that submits leaf tasks and waits for them, on a
        coordinating thread; `what` names it in any error. Refused on a coordinating thread."""
        self._refuse("compound", what)
        return self._coordinators.submit(_run_task, fn, args, what)

    def then(self, future: Future, fn: Callable[..., Any], *args: Any, what: str) -> Future:
        """A future of ``fn(future's result, *args)``, run on a checking thread once ``future``
        (a leaf task's) is done; its error, if it failed, is passed on instead. ``fn`` is a
        leaf task too; `what` names it in any error."""
        follow: Future = Future()
        follow.set_running_or_notify_cancel()

        def start(done: Future) -> None:
            error = CancelledError("an I/O task was cancelled") if done.cancelled() else done.exception()
            if error is not None:
                follow.set_exception(error)
                return
            try:
                check = self._checks.submit(_run_task, fn, (done.result(), *args), what)
            except RuntimeError as err:  # the runner was closed meanwhile
                follow.set_exception(err)
                return
            check.add_done_callback(functools.partial(_pass_on, follow))

        future.add_done_callback(start)
        return follow

    def _release_slot(self, _future: Future) -> None:
        self._slots.release()

    @staticmethod
    def gather(futures: Iterable[Future]) -> Future:
        """A future that completes when all `futures` have, with their results in order.

        If any failed, it fails with the first error seen, but only after every
        future is done: until then tasks may still be reading or writing the
        caller's buffers, which must not be reused before this completes.
        No thread waits: completion is driven by done-callbacks.
        """
        futures = list(futures)
        combined: Future = Future()
        combined.set_running_or_notify_cancel()
        if not futures:
            combined.set_result([])
            return combined
        state = _Gather(futures, combined)
        for future in futures:
            future.add_done_callback(state.on_done)
        return combined

    def close(self) -> None:
        """Finish the pending tasks and stop the threads. Idempotent."""
        if self._closed:
            return
        self._coordinators.shutdown(wait=True)  # first: they may still submit leaf tasks
        self._closed = True
        self._pool.shutdown(wait=True)  # then the leaf tasks, which may still start checks
        self._checks.shutdown(wait=True)
        log.debug("IORunner closed (%d threads)", self.threads)

    def __enter__(self) -> IORunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
