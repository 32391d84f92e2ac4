"""The host optimizer worker: one host thread that runs AdamW on the host shards while the
training thread goes on with backward (and, on an accelerator, keeps the device busy).

One thread, so the units are updated one at a time in the order they are handed over, as on
the training thread. A job's exception is kept with its future and raised where the training
thread takes the result (``Future.result``), with its own type and message; nothing the
worker runs issues a collective, so every rank's collectives stay in the training thread's
order. ``close`` lets the job running finish, drops those not started and joins the thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.config import Config

WORKER_THREAD = "host-optimizer"


def uses_host_worker(config: Config, device_apart: bool) -> bool:
    """Whether AdamW runs on the host worker: ``offload.host_worker``, where ``auto`` means with
    the optimizer on the host (``cpu`` or ``nvme``) and a ``device_apart`` from it, whose copies
    run asynchronously (an accelerator, or the simulated one). On a CPU-only machine the device is the host: the worker's update takes the cores
    backward computes on, so ``auto`` leaves it off there (see README for the measurement)."""
    if config.offload.host_worker != "auto":
        return bool(config.offload.host_worker)
    return device_apart and not config.offload.optimizer_on_device


class HostWorker:
    """A single host thread for the optimizer's per-unit updates."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WORKER_THREAD)

    def submit(self, job: Callable[..., Any], *args: Any) -> Future:
        """Run ``job(*args)`` on the worker after the jobs handed over before it."""
        return self._pool.submit(job, *args)

    def close(self) -> None:
        """Finish the job running, drop those not started, and join the thread."""
        self._pool.shutdown(wait=True, cancel_futures=True)
