"""The control path of each optimizer step, from its last backward to its commit: the one
place that decides in what order the step's parts run. The engine says when (its phases);
the arithmetic is ``engine.zero.step_math``'s, the unit-by-unit schedule over the optimizer
tier ``engine.zero.update``'s.

At the step's last backward ``begin`` opens the step's ``Update`` (its optimizer state starts
being read ahead) and says what to do with each unit's gradient shard as it becomes final:
update the unit at once, inside backward (``optim.overlap``, nothing needing every gradient
first); spill it to disk (``engine.tiers.grad_spill``), after taking what the step needs of it
(its unscaling and overflow flag with loss scaling, its pieces' norms); or leave it in memory.
At ``step()`` ``apply`` checks the global norm (or, after updates inside backward, each
unit's), clips, and updates the units still pending, spilled gradients read back beside their
state and clipped as they come; ``complete`` makes the step the one a run resumes from. With
``optim.defer_update`` ``complete`` leaves the units to the next forward, each updated as it is
gathered, and the step commits once the last one is (``finish_deferred`` ends it sooner).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager

import torch
from torch import nn

from engine.config import Config, overlaps_backward
from engine.runtime.comm import Comm
from engine.runtime.host_worker import HostWorker
from engine.state.forms import ShardState
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.grad_spill import GradSpill
from engine.tiers.optimizer import OptimizerState
from engine.zero.grads import GradientShards, PendingShard
from engine.zero.optim import clip_coefficient, unit_norm
from engine.zero.params import Params
from engine.zero.precision import LossScaler
from engine.zero.spilling import Spilling
from engine.zero.step_math import GradNorms, UnitAdamW
from engine.zero.update import Update, first_use_order, update_order


class UnitWork:
    """What updating one unit takes (``engine.zero.update.UnitUpdate``): its gradient shard taken
    on the training thread, AdamW at the step's learning rate on any thread, and the new master
    handed to the parameters on the training thread."""

    def __init__(self, adamw: UnitAdamW, grads: GradientShards, params: Params, overlap: bool):
        self._adamw, self._grads, self._params, self._overlap = adamw, grads, params, overlap
        self._lr = 0.0
        self._clip_scale: torch.Tensor | None = None
        self.unit_norms: dict[str, torch.Tensor] = {}
        """This step's gradient norm of each unit updated inside backward, taken before its update
        and left on the optimizer's device, for the step to read all at once."""

    def begin(self, lr: float) -> None:
        """A step starts, at learning rate ``lr``, nothing clipped yet."""
        self._lr, self._clip_scale, self.unit_norms = lr, None, {}

    def clip(self, scale: torch.Tensor) -> None:
        """Scale each gradient by ``scale`` (clipping's coefficient) in the update's own pass, as
        it is widened there: a gradient kept in the compute dtype could not hold the product,
        and a separate pass over every gradient would read them all once more."""
        self._clip_scale = scale

    def take_grad(self, unit: UnitLayout) -> PendingShard:
        """The unit's gradient shard in memory, with the copy that may still be filling it
        (on the training thread: the copies' bookkeeping is its own)."""
        return self._grads.take(unit.name)

    def compute(self, unit: UnitLayout, state: ShardState, grad: torch.Tensor) -> None:
        """AdamW on one unit's shard; on the host optimizer worker or the training thread,
        touching nothing but the unit's own tensors; the gradient is clipped here.

        Inside backward (overlap) nothing has seen every gradient, so the unit's own gradient
        norm is taken first, and a unit whose norm is not finite is left as it was (the step
        then stops on every rank, see ``StepControl.apply``; raising here, in an autograd hook,
        would leave the other ranks waiting in their collectives). The kernel is told so on
        the device: the host reading each unit's norm would wait for the device once per unit."""
        skip = None
        if self._overlap:
            norm = self.unit_norms[unit.name] = unit_norm(grad)
            skip = norm.isfinite().logical_not().float()
        self._adamw.update(unit, state, grad, self._lr, self._clip_scale, skip)

    def hand_on(self, unit: UnitLayout, state: ShardState, spilled: bool) -> None:
        """On the training thread, after ``compute``: hand the new master to the parameters (its
        copy to the device and any gather, in the same order on every rank; a unit left
        unchanged is still handed on, since every rank must take part in the same gathers),
        and free a gradient shard held in memory."""
        self._params.write_back(unit, state.master)
        if not spilled:
            self._grads.release_shard(unit.name)


class StepControl:
    """Each optimizer step's control path; one for the run, held by the engine."""

    def __init__(
        self,
        config: Config,
        layout: ModelLayout,
        comm: Comm,
        grads: GradientShards,
        params: Params,
        model: nn.Module,
        optimizer_state: OptimizerState,
        opt_device: torch.device,
        spill: GradSpill | None = None,
        worker: HostWorker | None = None,
    ):
        self._config, self._layout, self._grads, self._state = config, layout, grads, optimizer_state
        self.spill = spill
        """Where each unit's final gradient shard waits for the step, when not in memory."""
        self.worker = worker
        """The host optimizer worker that AdamW runs on, if any (``engine.runtime.host_worker``)."""
        self._adamw = UnitAdamW(config.optim, layout, comm.rank, model, opt_device)
        self._grad_dtype = spill.dtype if spill is not None else grads.dtype
        """The dtype gradients reach the update in."""
        self._compiling: threading.Thread | None = None
        self._compile_started = False
        self._norms = GradNorms(layout, comm, model)
        self.overlap = overlaps_backward(config)
        """Whether each unit is updated as its gradient is reduced (nothing waits for all of them)."""
        self.defers = config.optim.defer_update
        """Whether a step's units are updated in the next forward, each just before it runs
        (``optim.defer_update``): ``complete`` leaves them to its gathers, ``finish_deferred`` to itself."""
        self.unit_work = UnitWork(self._adamw, grads, params, self.overlap)
        self._params = params
        self._takes_norm = not (config.optim.grad_clip == 0 and config.precision.loss_scaling != "none")
        """Whether a step waiting for every gradient takes their norm (see ``_check_norm``)."""
        self.last_grad_norm: float | None = None
        """The last step's global gradient norm before clipping (None with loss scaling and no
        clipping: nothing takes it there)."""
        self._update: Update | None = None
        """The step's update, from ``begin`` until the next one (its counters are the step's)."""
        self._spilling: Spilling | None = None
        """The step's spill of its gradients, when it spills them."""
        self._waited = 0.0
        """Seconds this step was blocked on spilling gradients and on its commit."""
        self._wait_taken = 0.0
        """Of ``wait_s``, what ``take_wait_s`` has handed out."""
        self._compute_taken = 0.0
        """Of the open update's ``compute_s``, what ``take_compute_s`` has handed out."""
        self._compute_carried = 0.0
        """The last update's ``compute_s`` not handed out when the next one opened."""
        self._deferred_record: dict | None = None
        """The record of the step whose update is deferred to the next forward, until it is done."""

    def update_order(self) -> list[UnitLayout]:
        """The units in the order the next step updates them. Updated inside backward, in the
        order their gradients complete (``engine.zero.update.update_order``). Where every
        gradient must be final first (clipping, loss scaling) and the parameters can be sent
        ahead of the next forward, in the order it uses them, so that the first units' new
        parameters go up to the device while the rest are updated (``Params.ahead_order``).
        A deferred update goes in the order the next forward uses the units, whatever their tier."""
        ahead: list[str] | None = None
        if self.defers:
            assert self._params.order is not None  # stage 3
            ahead = self._params.order.iteration()
        elif not self.overlap:
            ahead = self._params.ahead_order()
        first_use = first_use_order(ahead, self._layout) if ahead is not None else None
        return first_use if first_use is not None else update_order(self._grads.order.recorded, self._layout)

    def compile_ahead(self) -> None:
        """At a training forward: start building the update's kernel behind it, once
        (``UnitAdamW.compile_ahead``); an engine that only evaluates compiles nothing."""
        if not self._compile_started:
            self._compile_started = True
            self._compiling = self._adamw.compile_ahead(self._grad_dtype)

    def begin(self, scaler: LossScaler, lr: float) -> Callable[[str], None] | None:
        """The step's last backward starts, its update to be made at learning rate ``lr``: the
        optimizer state starts being read ahead, and what to call with each unit's name as its
        gradient shard becomes final (``GradientShards.on_ready``) is returned: its update
        inside backward, its spill (unscaled by ``scaler`` first), or nothing (the shards wait
        in memory)."""
        if self._update is not None:  # a deferred update's AdamW seconds count in the step that ran them
            self._compute_carried += self._update.compute_s - self._compute_taken
        self._update = Update(self.update_order(), self._state, self.unit_work, self.worker)
        self._compute_taken = 0.0
        self.unit_work.begin(lr)
        self._spilling, self._waited, self._wait_taken = None, 0.0, 0.0
        if self.overlap:
            return self._update.ready
        if self.spill is None:
            return None
        norms = self._norms if self._takes_norm else None
        self._spilling = Spilling(self.spill, self._grads, self._layout, norms, scaler, self.worker)
        return self._spilling

    @property
    def found_inf(self) -> torch.Tensor | None:
        """Whether a spilled gradient held inf/nan (loss scaling), for
        ``LossScaler.unscale_and_check``: taken once every shard is spilled."""
        if self._spilling is None:
            return None
        self._spilling.finish()
        return self._spilling.found_inf

    def _opened(self) -> Update:
        assert self._update is not None, "the step's last backward opens its update"
        return self._update

    def apply(self) -> str | None:
        """Update every unit still pending (their final gradient shards unscaled by now): after
        the norm check and clipping, or, where the units were updated inside backward, followed
        by the check of their norms. Returns what is not finite (the step diverged: before any
        update where the check comes first), or None."""
        update = self._opened()
        if self.overlap:
            update.apply_remaining()
            self.last_grad_norm, diverged = self._norms.of_unit_norms(self.unit_work.unit_norms)
            return diverged
        diverged = self._check_norm()
        if diverged is None and not self.defers:
            update.apply_remaining()
        return diverged

    def complete(self, record: dict, guard: Callable[[], AbstractContextManager]) -> None:
        """After ``apply``: store the new parameters and commit the step with ``record``; or,
        deferring the update, leave each unit to the next forward's gather of it
        (``ShardedParams.update_in_forward``), which updates it and those due before it inside
        ``guard`` (what marks the step lost if that raises), and commit once the last is."""
        if not self.defers:
            self._end_update(record)
            return
        self._deferred_record = record

        def until(unit_name: str) -> None:
            with guard():
                if self._opened().until(unit_name):
                    self.finish_deferred()

        self._params.update_in_forward(self._opened().unhanded, until)

    @property
    def deferred_units(self) -> AbstractSet[str]:
        """The units a deferred update has not reached: their gradient shards, if held in
        memory, wait for it (nothing with the update done)."""
        return self._opened().unhanded if self.deferred else frozenset()

    @property
    def deferred(self) -> bool:
        """Whether the last step's update is deferred and not done: its commit is still to come."""
        return self._deferred_record is not None

    def finish_deferred(self) -> None:
        """Update the units a deferred update has not reached, and commit its step (nothing if none is open)."""
        record, self._deferred_record = self._deferred_record, None
        if record is None:
            return
        self._params.end_update_in_forward()
        self._opened().apply_remaining()
        self._end_update(record)

    def _end_update(self, record: dict) -> None:
        """Every unit is updated and handed on: store the new parameters and make the step the
        one a run resumes from, with ``record`` (``OptimizerState.commit``)."""
        self._params.flush()
        record["optimizer_steps"] = self.optimizer_steps()  # counted by the update itself
        start = time.perf_counter()
        self._state.commit(record, defer=self._config.store.defer_commit)
        self._waited += time.perf_counter() - start

    def _check_norm(self) -> str | None:
        """Before any unit is updated: the global gradient norm; what is not finite (the step
        diverged), or None once the gradients are clipped (``optim.grad_clip``), or will be as
        they come back from disk, whose reads start then. Loss scaling without clipping needs
        neither: its overflow check has passed."""
        clip = self._config.optim.grad_clip
        if self._takes_norm:
            if self._spilling is not None:
                self._spilling.finish()
                norm = self._norms.of_piece_norms(self._spilling.piece_norms)
            else:
                norm = self._norms.in_memory(self._grads.ready)
            self.last_grad_norm = float(norm)
            if not math.isfinite(self.last_grad_norm):
                return f"the gradient norm is {self.last_grad_norm}"
            if clip > 0:
                self.unit_work.clip(clip_coefficient(clip, norm))
        if self.spill is not None:
            update = self._opened()
            update.read_grads(self.spill.read(update.order))
        return None

    def abandon(self) -> None:
        """Give the step's update up (skipped, or diverged): let the worker finish what it holds,
        drop the reads, hand nothing more on."""
        self._opened().abandon()

    @property
    def wait_s(self) -> float:
        """Seconds the last step's training thread was blocked on the optimizer: its tier's reads
        not ready, writes backed up, the worker's update not done, spilling, its commit."""
        spilled = self._spilling.waited_s if self._spilling is not None else 0.0
        return self._waited + spilled + (self._update.wait_s if self._update is not None else 0.0)

    def take_wait_s(self) -> float:
        """Of ``wait_s``, the seconds not handed out by an earlier call (a phase's share)."""
        total = self.wait_s
        taken, self._wait_taken = total - self._wait_taken, total
        return taken

    def take_compute_s(self) -> float:
        """Seconds in AdamW itself (on the worker, or the training thread) since the last call."""
        total = self._update.compute_s if self._update is not None else 0.0
        taken = total - self._compute_taken + self._compute_carried
        self._compute_taken, self._compute_carried = total, 0.0
        return taken

    def take_spill_io_bytes(self) -> tuple[int, int]:
        """Bytes the spilled gradients read back and wrote since the last call."""
        return self.spill.take_io_bytes() if self.spill is not None else (0, 0)

    def optimizer_steps(self) -> int:
        """AdamW steps taken (the bias correction's count), for the step's record."""
        return self._adamw.steps_taken()

    def restore(self, optimizer_steps: int) -> None:
        self._adamw.restore(optimizer_steps)

    def close(self) -> None:
        """Stop the host worker and remove the spilled gradients, if any (before the engine's I/O
        runner closes). A compile still running is waited for: a process must not end inside the
        compiler (its thread is a daemon, and its worker processes go at exit)."""
        if self._compiling is not None:
            self._compiling.join()
        if self.worker is not None:
            self.worker.close()
        if self.spill is not None:
            self.spill.close()
