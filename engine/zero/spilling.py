"""One step's final gradient shards spilled to disk as backward makes them.

Each shard is unscaled (loss scaling), has its pieces' norms taken (what clipping needs of it)
and is written behind backward. All of that needs the shard's bytes on the host, so it waits
for the shard's copy from the device: on the host optimizer worker where there is one, so
that the thread launching backward's kernels never waits for a copy (on CUDA that wait would
drain the compute queued before the copy, once per unit). The shards are freed on the
training thread, which owns their bookkeeping, once their spill has run. Past
``SPILL_HELD - MAX_IN_FLIGHT`` spills running, it waits for the oldest: a disk behind
backward then holds backward back, rather than the model's gradient piling up in memory.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future

import torch

from engine.runtime.host_worker import HostWorker
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.grad_spill import GradSpill
from engine.tiers.sizing import MAX_IN_FLIGHT, SPILL_HELD
from engine.zero.grads import GradientShards, PendingShard
from engine.zero.precision import LossScaler
from engine.zero.step_math import GradNorms


class Spilling:
    """Called with each unit's name as its shard becomes final (``GradientShards.on_ready``)."""

    def __init__(
        self,
        spill: GradSpill,
        grads: GradientShards,
        layout: ModelLayout,
        norms: GradNorms | None,
        scaler: LossScaler,
        worker: HostWorker | None,
    ) -> None:
        """``norms``: where the pieces' norms are taken, if the step needs them."""
        self._spill, self._grads, self._layout, self._norms = spill, grads, layout, norms
        self._scaler, self._worker = scaler, worker
        self.found_inf = torch.zeros(1) if scaler.enabled else None
        """Whether a spilled gradient held inf/nan, once ``finish`` has returned."""
        self.piece_norms: dict[str, torch.Tensor] = {}
        """The norms of the spilled gradients' pieces, by parameter or unit, once ``finish`` has returned."""
        self.waited_s = 0.0
        """Seconds the training thread was blocked on the spills: waiting for room in the spill's
        buffers where it spills inline, for the oldest of the worker's spills once as many are
        running as ``SPILL_HELD`` leaves room for, or for the rest at ``finish``. (What the
        worker waits meanwhile is not counted: the training thread goes on.)"""
        self._running: collections.deque[tuple[str, Future]] = collections.deque()
        spill.begin()

    def __call__(self, unit_name: str) -> None:
        pending, unit = self._grads.take(unit_name), self._layout.unit(unit_name)
        if self._worker is None:
            self.waited_s += self._run(unit, pending)
            self._grads.release_shard(unit_name)
            return
        self._running.append((unit_name, self._worker.submit(self._run, unit, pending)))
        start = time.perf_counter()
        while self._running and (self._running[0][1].done() or len(self._running) > SPILL_HELD - MAX_IN_FLIGHT):
            self._free_oldest()
        self.waited_s += time.perf_counter() - start

    def finish(self) -> None:
        """Wait until every shard handed over is spilled (raising a spill's error), and free them."""
        start = time.perf_counter()
        while self._running:
            self._free_oldest()
        self.waited_s += time.perf_counter() - start

    def _free_oldest(self) -> None:
        unit_name, spilled = self._running.popleft()
        spilled.result()
        self._grads.release_shard(unit_name)

    def _run(self, unit: UnitLayout, pending: PendingShard) -> float:
        """Spill one shard once its copy has landed; the seconds it waited for room to."""
        grad = pending.wait()
        if self.found_inf is not None:
            self._scaler.unscale_([grad], self.found_inf)
        if self._norms is not None:
            self.piece_norms.update(self._norms.piece_norms(unit, grad))
        return self._spill.write(unit, grad)
