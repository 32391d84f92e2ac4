"""Work to run once a copy's event completes, without holding the thread that launches kernels.

A host buffer a copy reads (a staged master, a fetched parameter shard) may be reused only
once the copy is done. Waiting for its event on the training thread stalls it until the copy
stream, and so all the compute queued before the copy, has drained: once per unit, that
serialises the host with the device. Instead the buffer's release is handed here: run at once
if the event has completed, else on one daemon thread that waits for the events in the order
they were handed over. The thread binds its rank's device first, so that its CUDA calls do
not make a context on device 0.

An error raised by a release (or by the simulated device's race check in a wait) is kept and
raised on the training thread at the next ``after`` or at ``close``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

logger = logging.getLogger(__name__)

THREAD_NAME = "copy-completions"


class Waitable(Protocol):
    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class Completions:
    """Releases run after their events, on one thread started at the first that must wait."""

    def __init__(self, bind_device: Callable[[], None]) -> None:
        self._bind_device = bind_device
        self._queue: queue.SimpleQueue[tuple[Waitable, Callable[[], None], Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    def after(self, event: Waitable, release: Callable[[], None]) -> Future:
        """Run ``release`` once ``event`` has completed; a future of when it has run."""
        self.raise_errors()
        done: Future = Future()
        if event.query():
            release()
            done.set_result(None)
            return done
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        self._queue.put((event, release, done))
        return done

    def raise_errors(self) -> None:
        """Raise, on the calling thread, the first error a release met (and drop the rest)."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def drain(self) -> None:
        """Wait until every release handed over has run (``close`` and tests)."""
        marker: Future = Future()
        if self._thread is not None:
            self._queue.put((DoneEvent(), _nothing, marker))
            marker.result()
        self.raise_errors()

    def close(self) -> None:
        """Run what is pending, then stop the thread."""
        try:
            self.drain()
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None

    def _run(self) -> None:
        self._bind_device()
        while (item := self._queue.get()) is not None:
            event, release, done = item
            try:
                event.synchronize()
                release()
            except BaseException as err:  # raised on the training thread, which can act on it
                with self._lock:
                    self._errors.append(err)
                logger.debug("a release after a copy failed: %r", err)
            finally:
                if not done.done():
                    done.set_result(None)


def _nothing() -> None:
    return None


class DoneEvent:
    """An event of work that ran synchronously (or of none): always complete."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True
