"""The host optimizer worker: one host thread that runs AdamW on the host shards while the
training thread goes on with backward (and, on an accelerator, keeps the device busy).

One thread, so the units are updated one at a time in the order they are handed over, as on
the training thread. A job's exception is kept with its future and raised where the training
thread takes the result (``Future.result``), with its own type and message; nothing the
worker runs issues a collective, so every rank's collectives stay in the training thread's
order. ``close`` lets the job running finish, drops those not started and joins the thread.

Beside an accelerator the worker shares the rank's cores and its device with the training
thread, which launches the device's kernels:

- Its thread sets the rank's device before anything else. Its first CUDA call (an event's
  ``synchronize``, a tensor's free) would otherwise bind device 0, and on a multi-GPU node
  every rank but 0 would make a CUDA context there (about 0.5 GB of device 0 each).
- AdamW on every core would take the core the training thread launches kernels from. torch's
  intra-op thread count is one setting of the process, which each thread takes up when it
  first computes, so while a worker runs the process's count is capped at the rank's share of
  the cores (``torch.get_num_threads()`` where the worker is made: what the launcher gave the
  rank) less one, set on the worker's thread too, and put back at ``close``. The training
  thread computes little on the host there, so its own count losing one costs nothing.

On the CPU (or the simulated device, on the CPU) the device is the host: nothing is bound and
the count is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.config import Config, spills_gradients

WORKER_THREAD = "host-optimizer"

logger = logging.getLogger(__name__)


def uses_host_worker(config: Config, device_apart: bool) -> bool:
    """Whether AdamW runs on the host worker: ``offload.host_worker``, where ``auto`` means with
    the optimizer on the host (``cpu`` or ``nvme``) and either a ``device_apart`` from it, whose
    copies run asynchronously (an accelerator, or the simulated one), or gradients spilled to
    disk. On a CPU-only machine the device is the host and the worker shares its cores with
    backward: with the update inline it showed no gain (GPT "small", stages 2 and 3), but a
    spilled gradient's norms, checks and write take the training thread's time through backward,
    and moved to the worker a 2B-parameter Llama fine-tune's steady step went from 36.6-40.2 s
    to 33.1-37.0 s (alternating runs on one store)."""
    if config.offload.host_worker != "auto":
        return bool(config.offload.host_worker)
    return (device_apart or spills_gradients(config)) and not config.offload.optimizer_on_device


class HostWorker:
    """A single host thread for the optimizer's per-unit updates, on ``device``'s rank."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._threads_before: int | None = None
        """The process's intra-op thread count before the worker capped it, if it did."""
        accelerator = device is not None and device.type != "cpu"
        if accelerator:
            self._threads_before = _cap_threads()
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=WORKER_THREAD,
            initializer=_start_thread,
            initargs=(device if accelerator else None, torch.get_num_threads()),
        )

    def submit(self, job: Callable[..., Any], *args: Any) -> Future:
        """Run ``job(*args)`` on the worker after the jobs handed over before it."""
        return self._pool.submit(job, *args)

    def close(self) -> None:
        """Finish the job running, drop those not started, join the thread, and give the process
        back its intra-op thread count."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None


def _cap_threads() -> int:
    """Cap the process's intra-op threads at the rank's share less one (at least one), for the
    thread that launches kernels; return the count before."""
    share = torch.get_num_threads()
    capped = max(share - 1, 1)
    if capped < share:
        torch.set_num_threads(capped)
        logger.info(
            "host optimizer worker: torch intra-op threads %d -> %d, leaving a core to the thread that launches "
            "the device's kernels",
            share,
            capped,
        )
    return share


def _start_thread(device: torch.device | None, threads: int) -> None:
    """The worker thread's first act, beside an accelerator (``device``): bind the rank's device
    before any CUDA call binds device 0, and take the capped intra-op thread count."""
    if device is not None:
        torch.get_device_module(device.type).set_device(device)
        torch.set_num_threads(threads)
