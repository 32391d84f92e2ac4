"""One optimizer step over every unit, applied as each unit's gradient becomes final.

The step's optimizer state is read in the order the units are updated, and the read-ahead
starts before backward so its first reads overlap backward's compute. Updated inside
backward, they go in the order their gradient shards completed in the last step
(``GradientShards.order``); when every gradient must be final first, at stage 3 where the
parameter tier hands back the shards it writes, in the order the next forward uses them
(``StepControl.update_order``), so that the first units' new parameters go up to the device
beside the update of the rest.
Without clipping or loss scaling nothing needs every gradient first, so each unit is updated
as soon as its shard is final and the ones before it in the order are done: the update runs
inside backward, hidden behind the backward of the units still to come. Otherwise the units
wait for ``apply_remaining``, after clipping; with the optimizer on nvme their gradient
shards wait on disk meanwhile, and are read back beside the state (``read_grads``,
``engine.tiers.grad_spill``). Every unit sees the same arithmetic either way, so the result
is the same.

With a host optimizer worker (``engine.runtime.host_worker``) each unit's AdamW runs there
while the training thread goes on: the worker waits for the gradient shard's copy event
before reading it. Everything else stays on the training thread, in a schedule that depends
only on the calls every rank makes (never on which thread finished first): the optimizer
state's reads and writes, and handing the new master on (its copy to the device and its
gathers). An update started at one ``ready`` is handed on at the next ``ready`` (or at
``apply_remaining``), so the parameters' collectives keep one order on every rank. After
clipping, ``apply_remaining`` keeps ``IN_FLIGHT`` units started: the next unit's state is
taken and its AdamW queued on the worker before the one before it is handed on, so the
worker's update of one unit runs beside the hand-on of the unit before it and the reads of
the unit after it, in the same order of hand-ons as one at a time.

A deferred update (``optim.defer_update``) is not applied after clipping: the next forward's
gather of each unit calls ``until``, which updates the units due up to it and hands it on, the
next one's AdamW started on the worker beside its forward. The state's reads and writes then
run behind the forward's compute.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from typing import Protocol

import torch

from engine.runtime.host_worker import HostWorker
from engine.state.forms import ShardState
from engine.state.partition import ROOT_UNIT, ModelLayout, UnitLayout
from engine.tiers.optimizer import OptimizerState
from engine.zero.grads import PendingShard

IN_FLIGHT = 2
"""Units started but not yet handed on at most, after clipping: one updated on the worker while
the one before it is handed on. The worker updates one unit at a time, so more would only hold
more optimizer state out of the tier's read-ahead window (whose pool then has room for the
next read only once a write lands) for no more overlap."""


def update_order(recorded: Sequence[str], layout: ModelLayout) -> list[UnitLayout]:
    """The units in the order their gradients completed last step (``recorded``). Before one is
    recorded, the order backward usually takes: the last unit first, the root (embeddings,
    head) last. A wrong guess costs memory, not correctness: shards wait for the units due
    before them."""
    if sorted(recorded) == sorted(u.name for u in layout.units):
        return [layout.unit(name) for name in recorded]
    units = layout.units
    return [u for u in reversed(units) if u.name != ROOT_UNIT] + [u for u in units if u.name == ROOT_UNIT]


def first_use_order(used: Sequence[str], layout: ModelLayout) -> list[UnitLayout] | None:
    """The trained units in the order ``used`` (an iteration's gathers) first uses them: the
    order the next forward needs their new parameters in. None unless it uses every one."""
    trained = {u.name for u in layout.units}
    names = [name for name in dict.fromkeys(used) if name in trained]
    return [layout.unit(name) for name in names] if len(names) == len(trained) else None


class UnitUpdate(Protocol):
    """What updating one unit takes (``engine.zero.step.UnitWork``): its gradient shard taken on
    the training thread, AdamW on any thread, and the new master handed on on the training thread."""

    def take_grad(self, unit: UnitLayout) -> PendingShard: ...

    def compute(self, unit: UnitLayout, state: ShardState, grad: torch.Tensor) -> None: ...

    def hand_on(self, unit: UnitLayout, state: ShardState, spilled: bool) -> None: ...


class Update:
    """The units of one step, updated in a fixed order as they become ready."""

    def __init__(
        self,
        order: Sequence[UnitLayout],
        optimizer_state: OptimizerState,
        unit_update: UnitUpdate,
        worker: HostWorker | None = None,
    ):
        self.order = list(order)
        self._pending = collections.deque(order)
        self._ready: set[str] = set()
        self._state = optimizer_state
        self._unit = unit_update
        self._worker = worker
        self._running: collections.deque[tuple[UnitLayout, ShardState, bool, Future]] = collections.deque()
        """Units whose AdamW the worker was handed, in order, not yet handed on."""
        self._unhanded = {unit.name for unit in order}
        """Units not handed on yet."""
        self._grads: Iterator[tuple[UnitLayout, torch.Tensor]] | None = None
        """Spilled gradient shards read back in ``order`` (``read_grads``), else None: the
        gradient shards are in memory."""
        self.wait_s = 0.0
        """Seconds the training thread was blocked on the optimizer: its tier's reads not ready,
        writes backed up, or the worker's update not done."""
        self.compute_s = 0.0
        """Seconds in the update itself (on the worker, or the training thread)."""
        start = time.perf_counter()
        self._reads = optimizer_state.read(order)  # its first reads start now
        self.wait_s += time.perf_counter() - start

    def ready(self, unit_name: str) -> None:
        """The unit's gradient shard is final: hand on the updates started before, then update
        it and any after it that were waiting."""
        self._ready.add(unit_name)
        self._hand_on_running()
        while self._pending and self._pending[0].name in self._ready:
            self._start_next()

    def read_grads(self, grads: Iterator[tuple[UnitLayout, torch.Tensor]]) -> None:
        """Take each unit's gradient shard from ``grads`` (spilled ones read back in ``order``)
        beside its optimizer state, rather than from memory."""
        self._grads = grads

    @property
    def unhanded(self) -> AbstractSet[str]:
        """The units not handed on yet (a live view: it shrinks as they are)."""
        return self._unhanded

    def until(self, unit_name: str) -> bool:
        """A forward is about to use the unit (``optim.defer_update``): update the units due
        before it and the unit itself, and hand them on, leaving the next one started (its AdamW
        runs on the worker beside the unit's forward); True once no unit is left to update."""
        while unit_name in self._unhanded:
            if self._pending:
                self._start_next()
            self._hand_on_running(keep=IN_FLIGHT - 1 if self._pending else 0)
        return not self._pending and not self._running

    def apply_remaining(self) -> None:
        """Every gradient is final: update the units still pending. A worker's error is raised
        here (or at the ``ready`` after it), as the worker raised it."""
        while self._pending:
            self._start_next()
            self._hand_on_running(keep=IN_FLIGHT - 1)
        self._hand_on_running()
        self._close(self._grads)

    def abandon(self) -> None:
        """Skip the step (overflowed gradients): let the worker finish what it holds, drop the
        reads, hand nothing on."""
        self._pending.clear()
        running, self._running = self._running, collections.deque()
        for *_, future in running:
            future.result()
        self._close(self._reads)
        self._close(self._grads)

    @staticmethod
    def _close(reads: Iterator | None) -> None:
        """End a read-ahead early, giving back the buffers of the reads still out."""
        close = getattr(reads, "close", None)
        if close is not None:
            close()

    def _start_next(self) -> None:
        """Read the next unit's state and gradient and start its AdamW: on the worker, or here
        and handed on at once."""
        unit = self._pending.popleft()
        start = time.perf_counter()
        arrived, state = next(self._reads)
        assert arrived is unit, f"the optimizer state read {arrived.name!r} where {unit.name!r} was due"
        spilled = self._grads is not None
        if self._grads is not None:
            for *_, future in self._running:  # the next read frees the shard before (timed with the rest here)
                future.result()
            arrived, grad = next(self._grads)
            assert arrived is unit, f"the spilled gradient read {arrived.name!r} where {unit.name!r} was due"
            pending = PendingShard(grad)
        else:
            pending = self._unit.take_grad(unit)
        self.wait_s += time.perf_counter() - start
        if self._worker is None:
            self._compute(unit, state, pending)
            self._hand_on(unit, state, spilled)
        else:
            future = self._worker.submit(self._compute, unit, state, pending)
            self._running.append((unit, state, spilled, future))

    def _compute(self, unit: UnitLayout, state: ShardState, pending: PendingShard) -> None:
        """AdamW on the unit, once its gradient's copy has landed (on the worker's thread, if any)."""
        grad = pending.wait()
        start = time.perf_counter()
        self._unit.compute(unit, state, grad)
        self.compute_s += time.perf_counter() - start

    def _hand_on_running(self, keep: int = 0) -> None:
        """Wait for the worker's updates handed over so far, in order, and hand each on, leaving
        the last ``keep`` to go on."""
        while len(self._running) > keep:
            unit, state, spilled, future = self._running.popleft()
            self._await(future)
            self._hand_on(unit, state, spilled)

    def _await(self, *futures: Future) -> None:
        """Wait for the worker's updates ``futures``, raising the worker's exception, if it
        raised, with its own message."""
        start = time.perf_counter()
        for future in futures:
            future.result()
        self.wait_s += time.perf_counter() - start

    def _hand_on(self, unit: UnitLayout, state: ShardState, spilled: bool) -> None:
        self._unhanded.discard(unit.name)
        self._unit.hand_on(unit, state, spilled)
        start = time.perf_counter()
        self._state.write_back(unit, state)
        self.wait_s += time.perf_counter() - start
