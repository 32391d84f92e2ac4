"""``Engine``: the user's object. Wraps any ``nn.Module`` for a plain PyTorch loop::

    eng = Engine(model, config)
    for x, y in batches:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()

The model computes with compute-dtype parameters that are views into one flat buffer per unit on the
device (at stage 3 gathered only while the unit runs, see ``engine.zero.params``). The fp32 masters
and AdamW moments are sharded across ranks on the optimizer tier; each step reduces the gradients to
shards, updates the shards there and hands the new compute-dtype shards back to the parameters.

Each public call runs only in the phases of the step cycle it belongs to (``engine.zero.phase``)
and moves the engine on to the next; a call out of order raises ``PhaseError``. Its parts are
built from the config by ``engine.build``; the order of a step's parts is ``engine.zero.step``'s.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from engine import build
from engine.config import Config
from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm
from engine.runtime.detect import detect_device
from engine.runtime.native_dtype import settle_compute_dtype
from engine.runtime.sizes import MIB
from engine.state.dtypes import compute_dtype
from engine.state.partition import unit_needs
from engine.tiers import hosts, rng
from engine.tiers.checkpoint import PendingCheckpoint
from engine.tiers.grad_spill import GradSpill
from engine.tiers.sizing import MAX_IN_FLIGHT
from engine.tiers.store_io import StoreIO, settle_for_ranks
from engine.zero.divergence import DivergedError, diverged_message
from engine.zero.grads import bucket_bytes
from engine.zero.optim import lr_factor, schedule_change
from engine.zero.order import TracedOrder, adopt_orders, adopt_predicted, saved_orders
from engine.zero.phase import BETWEEN_UPDATES, StepPhase, expect
from engine.zero.precision import LossScaler
from engine.zero.stats import PhaseClock, StepClock, StepStats, measure_step
from engine.zero.step import StepControl
from offload import StoreLock

logger = logging.getLogger(__name__)


class Engine:
    """ZeRO stage 1, 2 or 3 training of ``model`` with its optimizer state on the configured tier."""

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        *,
        total_steps: int | None = None,
        resume: bool = False,
        checkpoint: str | None = None,
        init_unit: Callable[[dict[str, torch.Tensor]], None] | None = None,
        overwrite: bool = False,
    ):
        """``overwrite``: a new run replaces the store at ``offload.nvme_path`` whatever it holds
        (without it, only a store that never held a trained step is replaced; any other is refused)."""
        config.validate()
        resume = resume or checkpoint is not None  # a checkpoint is only ever resumed from
        self.device = detect_device()
        self.comm = Comm.from_env(self.device.backend, self.device.device)
        self.config = settle_compute_dtype(settle_for_ranks(config, resume, self.comm), self.comm)
        self.io = StoreIO.from_config(self.config.offload, self.comm, node_local=config.offload.node_local)
        config = self.config  # every tier's I/O runner above, closed last
        self.dtype = compute_dtype(config.precision.compute_dtype)
        self.total_steps = total_steps or config.train.steps
        self.module = model
        self.budget = DeviceBudget(int(config.zero.device_memory_limit_mb * MIB))
        units, owned, self.layout = build.model_units(model, config, self.comm.world_size)
        opt_device = build.optimizer_device(config, self.device)
        on_meta = build.check_start(config, model, resume, checkpoint, init_unit, overwrite)
        build.place_model(model, self.device.device, on_meta)
        self._store_lock: StoreLock | None = None  # the store's writer lock, its leader's, taken before a write
        self._store_locked = False  # on every rank: taking the lock is collective
        step = hosts.agree_on_resume(config, self.comm, self.io, checkpoint) if resume else None
        if config.offload.uses_store or checkpoint is not None:
            self._lock_store(create=not resume)
        hosts.roll_back(config.offload.store_path, step, self.comm, self.io)  # to the step all hosts hold
        build.bound_host_memory(config, self.layout, self.device, self.dtype)  # before any tier allocates
        self._build_tiers(opt_device, resume, checkpoint, overwrite)
        build.build_units(
            self.layout,
            owned,
            self.optimizer_state,
            self.params,
            device=self.device.device,
            dtype=self.dtype,
            master_dtype=compute_dtype(config.optim.master_dtype),
            rank=self.comm.rank,
            init_unit=init_unit if on_meta and not resume else None,
            materialize=on_meta,
            resume=resume,
        )
        self.grads, spill = build.gradients(
            config, self.layout, owned, self.comm, self.device, self.budget, self.params, opt_device, self.io
        )
        self.params.hook(dict(units), needs := unit_needs(model, units, owned))
        buckets = {u.name: bucket_bytes(u, self.grads.dtype) * u.trainable for u in self.layout.all_units}
        self.params.check_fits(buckets, MAX_IN_FLIGHT)
        self.step_control = self._build_step_control(model, opt_device, spill)
        """Each optimizer step's control path: its update, spilled gradients, norms and clipping, its commit."""
        self.scaler = LossScaler(config.precision)
        self._begin(resume, [n for n, _ in units], needs)
        build.log_start(config, self.layout, self.comm)

    def _build_tiers(self, opt_device: torch.device, resume: bool, checkpoint: str | None, overwrite: bool) -> None:
        """The optimizer tier (restored on resume) and the parameters on theirs, as configured."""
        config = self.config
        checkpoints = build.CheckpointStore(config, self.layout, self.comm.rank, self.io, self._lock_store, overwrite)
        self.optimizer_state = build.optimizer_state(
            config,
            self.layout,
            self.comm.rank,
            self.io,
            checkpoints,
            device=opt_device,
            budget=self.budget,
            resume=resume,
            checkpoint=checkpoint,
            overwrite=overwrite,
        )
        self.params = build.parameters(
            config, self.layout, self.comm, self.device, self.dtype, self.budget, self.io, self.optimizer_state
        )
        checkpoints.frozen = self.params.frozen_shards  # a checkpoint stores the frozen values they hold

    def _build_step_control(self, model: nn.Module, opt_device: torch.device, spill: GradSpill | None) -> StepControl:
        parts = (self.layout, self.comm, self.grads, self.params, model, self.optimizer_state, self.device)
        return build.step_control(self.config, *parts, opt_device, spill)

    def _begin(self, resume: bool, units: list[str], needs: dict[str, list[str]]) -> None:
        """Counting starts: the saved step restored on resume, else step 0 committed (the added
        units: a store is a checkpoint from here on) and the units' order predicted from
        ``units`` and their ``needs``. What building wrote is not the first step's traffic."""
        self._start_counting()
        if resume:
            assert self.optimizer_state.resumed_from is not None  # a resumed tier holds its record
            self._restore(self.optimizer_state.resumed_from)
        else:
            self.optimizer_state.commit({"step": 0})
        adopt_predicted(self._orders(), units, needs, self.layout, self.config.zero.activation_checkpointing)
        self.params.take_io_bytes()
        self.io.costs.take()

    def _start_counting(self) -> None:
        """The counters and per-step records of a run that has taken no step yet."""
        self.global_step = 0
        self.skipped_steps = 0
        self.last_lr: float | None = None
        """The learning rate of the last step's update (None before the first)."""
        self._diverged: str | None = None
        """Why this engine stopped, once a step diverged: it takes no further step."""
        self._phase = StepPhase.IDLE
        self.last_step_stats = StepStats()
        """What the last optimizer step cost (see ``engine.zero.stats``)."""
        self.client_state: dict[str, Any] = {}
        """Saved with every committed step and restored on resume (e.g. the data position)."""
        self._micro_batches = 0
        self._saving: PendingCheckpoint | None = None
        """A checkpoint still being written in the background, committed by the next step."""
        self._step_started: StepClock | None = None
        self._phases = PhaseClock(self.params, self.step_control)

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None with loss scaling and no
        clipping: nothing takes it there)."""
        return self.step_control.last_grad_norm

    @classmethod
    def resume(
        cls, model: nn.Module, config: Config, *, total_steps: int | None = None, checkpoint: str | None = None
    ) -> Engine:
        """Continue from the last step committed in ``config.offload.nvme_path`` (nvme tier), or
        from its checkpoint ``checkpoint`` (any tier, whichever tier saved it; see ``save``): parameters, optimizer state, step count, loss
        scale, random states and ``client_state``. The first step writes the store's next live
        generation, so a checkpoint is never modified and can be resumed from again."""
        return cls(model, config, total_steps=total_steps, resume=True, checkpoint=checkpoint)

    def _restore(self, record: dict[str, Any]) -> None:
        """Parameters from the committed masters, and the counters the record holds."""
        for unit, master in self.optimizer_state.read_masters():
            self.params.write_back(unit, master)
        self.params.flush()
        self.global_step = record["step"]
        self.skipped_steps = record.get("skipped_steps", 0)
        self.step_control.restore(record.get("optimizer_steps", 0))
        if "loss_scale" in record:
            self.scaler.load_state_dict(record["loss_scale"])
        self.client_state = record.get("client_state", {})
        change = schedule_change(self.config.optim, self.global_step, record.get("total_steps"), self.total_steps)
        if change and self.comm.rank == 0:
            logger.warning("%s", change)
        adopt_orders(record.get("unit_order", {}), {u.name for u in self.layout.units}, **self._orders())
        rng.restore_rank(record.get("rng", []), self.comm.rank, self.comm.world_size)
        logger.info("resumed at step %d from %s", self.global_step, self.config.offload.store_path)

    def _commit_record(self, step: int) -> dict[str, Any]:
        """What a committed step (or a checkpoint) at ``step`` must remember besides the tensors."""
        return {
            "step": step,
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": self.step_control.optimizer_steps(),
            "loss_scale": self.scaler.state_dict(),
            "client_state": copy.deepcopy(self.client_state),  # a deferred commit writes it later
            "rng": self.comm.all_gather_object(rng.capture()),
            "world_size": self.comm.world_size,
            "total_steps": self.total_steps,  # what the schedule decays over: a resume that changes it is told
            "unit_order": saved_orders(**self._orders()),
        }

    def _orders(self) -> dict[str, TracedOrder]:
        """The traced orders a committed step keeps: the gradients', at stage 3 the gathers' too."""
        orders = {"grads": self.grads.order, "params": self.params.order}
        return {name: order for name, order in orders.items() if order is not None}

    def _lock_store(self, create: bool) -> None:
        """Take the writer lock of the store at ``offload.nvme_path`` once, before anything writes
        there (its leader holds it for the run: rank 0, or each host's first rank for node-local
        stores), making its folder if ``create``; every rank hears if it is refused. A run that
        fails before writing leaves the folder as it found it (see ``StoreLock``)."""
        if not self._store_locked:
            path = self.config.offload.store_path
            self._store_lock = self.comm.on_leader(lambda: StoreLock.acquire(path, create=create), self.io.leader)
            self._store_locked = True

    @property
    def phase(self) -> StepPhase:
        """Where the engine is in its step cycle (see ``engine.zero.phase``)."""
        return self._phase

    def _expect(self, call: str, *allowed: StepPhase) -> None:
        """Refuse ``call`` unless the engine is in one of the ``allowed`` phases. After a
        diverged step the model and optimizer state may be partly updated: nothing may step or
        checkpoint from them, which ``DivergedError`` says with the step's own message."""
        if self._phase is StepPhase.DIVERGED and StepPhase.DIVERGED not in allowed:
            raise DivergedError(f"this engine stopped at a diverged step and takes no further step: {self._diverged}")
        expect(self._phase, call, *allowed)

    @contextlib.contextmanager
    def _within_step(self) -> Iterator[None]:
        """Work on the step in flight. If it raises part-way, the step is lost (its gradients
        partly reduced, its update partly applied, its commit not made) and the engine FAILED,
        unless it diverged (``_diverge`` has made it DIVERGED)."""
        try:
            yield
        except BaseException:
            if self._phase is not StepPhase.DIVERGED:
                self._phase = StepPhase.FAILED
            raise

    def _between_steps(self) -> StepPhase:
        """The phase with no step in progress: COMMIT_PENDING while the last step's commit is deferred, else IDLE."""
        pending = self.optimizer_state.commit_pending or self.step_control.deferred
        return StepPhase.COMMIT_PENDING if pending else StepPhase.IDLE

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, with tensor arguments moved to the compute device: a step's
        micro-batch, or an evaluation whose loss never goes backward (between steps or between
        micro-batches; not while a step's update is open). A forward that raises leaves the
        phase as it was: it changed nothing of the step."""
        self._expect("__call__ (the forward)", *BETWEEN_UPDATES)
        if self._step_started is None:
            self._step_started = StepClock.now()
            self.budget.start_step()
        if torch.is_grad_enabled():
            self.step_control.compile_ahead()
        self.params.begin_iteration()
        move = lambda v: v.to(self.device.device, non_blocking=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
        with self._phases.timing("forward"):
            output = self.module(*(move(a) for a in args), **{k: move(v) for k, v in kwargs.items()})
        self._phase = StepPhase.FORWARD
        return output

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (scaled for fp16, divided over accumulation).

        On the last micro-batch of a step the last step's deferred commit lands first (its
        writes went on behind this step's forward: ``store.defer_commit``), since this step
        reads the state it wrote; then the optimizer state starts being read ahead, and without
        clipping or loss scaling each unit is updated as soon as its gradient is reduced
        (``engine.zero.update``). Each forward's loss goes backward once."""
        self._expect("backward(loss)", StepPhase.FORWARD)
        if not loss.requires_grad:
            raise ValueError(
                "Engine.backward(loss): the loss has no autograd graph (an evaluation forward, e.g. under "
                "torch.no_grad()?); pass the loss of a forward run with gradients enabled"
            )
        accum = self.config.zero.grad_accum_steps
        last = self._micro_batches + 1 >= accum
        with self._within_step(), self._phases.timing("backward"):
            self._finish_update()
            self.grads.start_backward(last)  # first: it makes the last step's order the record
            if last:
                self.optimizer_state.flush()
                lr = self.config.optim.lr * lr_factor(self.global_step, self.config.optim, self.total_steps)
                self.last_lr = lr
                self.grads.on_ready = self.step_control.begin(self.scaler, lr)
            scaled = self.scaler.scale_loss(loss)
            (scaled / accum if accum > 1 else scaled).backward()
            self.grads.end_backward()
            self.grads.on_ready = None
            self._micro_batches += 1
        self._phase = StepPhase.UPDATING if last else StepPhase.ACCUMULATING

    def step(self) -> bool:
        """Apply the optimizer once every ``grad_accum_steps`` micro-batches; True if it updated.

        A step whose gradients overflowed (fp16) is skipped on every rank and leaves the
        masters untouched; the learning-rate schedule still advances, as with torch's GradScaler.
        A step whose gradients are otherwise not finite diverged: it raises ``DivergedError`` on
        every rank and is never committed.

        It is called after a micro-batch's ``backward``: after every one (it returns False until
        the last), or only after the last.
        """
        self._expect("step()", StepPhase.ACCUMULATING, StepPhase.UPDATING)
        if self._phase is StepPhase.ACCUMULATING:
            return False
        with self._within_step():
            with self._phases.timing("update"):
                overflow = self._update()
            self._record_stats()
        self._phase = self._between_steps()
        return not overflow

    def _update(self) -> bool:
        """The step's update and commit, or its skip; True if its gradients overflowed."""
        grads = self.grads.final_shards()
        overflow = self.scaler.unscale_and_check(grads, self.comm, self.step_control.found_inf)
        self.scaler.update(overflow)
        if overflow:
            self.step_control.abandon()
            self.skipped_steps += 1
            logger.warning("step %d skipped: inf/nan gradients; loss scale now %g", self.global_step, self.scaler.scale)
        else:
            self._update_and_commit()
        self.global_step += 1
        self._drop_grads()
        self._commit_checkpoint()
        return overflow

    def _update_and_commit(self) -> None:
        """Update every unit (``StepControl.apply``: a step that diverged stops here), store the
        new parameters and commit the step on the optimizer tier; with ``optim.defer_update``
        the units are left to the next forward, each updated just before it runs."""
        if (diverged := self.step_control.apply()) is not None:
            self._diverge(diverged)
        record = self._commit_record(self.global_step + 1)  # the random states and client state of now
        self.step_control.complete(record, self._within_step)

    def _finish_update(self) -> None:
        """Update what a deferred update has not reached (before a backward, ``save``, ``flush``,
        ``gathered`` or ``close``) and commit its step; nothing after a step failed or diverged."""
        if self._phase not in (StepPhase.FAILED, StepPhase.DIVERGED):
            with self._within_step():
                self.step_control.finish_deferred()

    def abandon_step(self, what: str) -> NoReturn:
        """Stop the step whose backward has run, instead of ``step()``, because ``what`` is not
        finite (e.g. the loss, which the engine never sees): as a diverged step, never committed,
        with ``DivergedError``. Every rank calls it at the same point."""
        self._expect("abandon_step(what)", StepPhase.UPDATING)
        with self._within_step():
            self._diverge(what)

    def _diverge(self, what: str) -> NoReturn:
        """Give the step up on this rank (each rank comes here at the same point): drop its
        reads, let the parameter gathers every rank issued complete, never commit its writes,
        and take no further step: the model and the optimizer state may be partly updated."""
        self.step_control.abandon()
        self.params.flush()
        where = self.optimizer_state.discard_step()
        self._diverged = diverged_message(self.global_step + 1, what, where, self.config)
        self._phase = StepPhase.DIVERGED
        raise DivergedError(self._diverged)

    def _record_stats(self) -> None:
        started, self._step_started = self._step_started or StepClock.now(), None
        self.last_step_stats = measure_step(
            started,
            self.step_control,
            self.optimizer_state,
            self.params,
            self.budget,
            self.device,
            self.io.costs,
            self._phases,
        )

    def gathered(self):
        """A context in which every parameter holds its full values, also at stage 3 (to read,
        evaluate or save the model outside ``eng(...)``/``eng.backward``). Not while a step's
        update is open: the parameters are half updated then; after a step that diverged or
        failed they may be, and are shown as they are."""
        self._expect("gathered()", *BETWEEN_UPDATES, StepPhase.DIVERGED, StepPhase.FAILED)
        self._finish_update()
        return self.params.gathered()

    def zero_grad(self) -> None:
        """Discard the gradients accumulated since the last step (a forward's loss may still go
        backward after it, as the first micro-batch of a step). Not once the step's update is
        open: ``step()`` ends it."""
        self._expect("zero_grad()", *BETWEEN_UPDATES)
        self._drop_grads()
        if self._phase is StepPhase.ACCUMULATING:
            self._phase = self._between_steps()

    def _drop_grads(self) -> None:
        self.grads.zero(keep=self.step_control.deferred_units)
        self._micro_batches = 0

    def save(self, tag: str) -> None:
        """Keep the last step as checkpoint ``tag`` (``checkpoints/<tag>`` in the store at
        ``offload.nvme_path``), to resume from with ``Engine.resume(..., checkpoint=tag)`` on any
        tier. On the nvme tier the step's generation is still the live state, so it is kept by a
        rename, not a copy, when the next step supersedes it; the request is committed, so a
        crash or a resume loses nothing. The memory tiers start writing their state there now,
        in the background: it is kept once the next step (or ``close``) finishes, and that step
        updates each unit only after its state is written. Once a checkpoint is kept, the oldest
        beyond ``checkpoint.keep`` are deleted.

        Not while a step's update is open (between the last micro-batch's ``backward`` and
        ``step()``): the state is half updated then. On the nvme tier also after a failed
        step: the store keeps its last commit, which the step never changed (or, rewriting it in
        place, marked dirty, which the store refuses to keep)."""
        durable = self.optimizer_state.durable  # its last commit outlives a failed step
        self._expect("save(tag)", *BETWEEN_UPDATES, *((StepPhase.FAILED,) if durable else ()))
        self._flush()
        self._commit_checkpoint()
        record = lambda: self._commit_record(self.global_step)  # noqa: E731
        self._saving = self.optimizer_state.save(tag, record, keep=self.config.checkpoint.keep)

    def flush(self) -> None:
        """Commit the last step now if its commit was deferred (``store.defer_commit``), so that
        the store on disk holds it (e.g. before copying the store); otherwise it lands at the
        next step's last backward, its writes having gone on behind that step's forward. Every
        rank calls it at the same point: it synchronises them."""
        self._expect("flush()", *BETWEEN_UPDATES, StepPhase.UPDATING, StepPhase.DIVERGED, StepPhase.FAILED)
        self._flush()

    def _flush(self) -> None:
        """Commit a deferred step now; one that fails is lost (in the parameters, not the store)."""
        self._finish_update()
        with self._within_step():
            self.optimizer_state.flush()
        if self._phase is StepPhase.COMMIT_PENDING:
            self._phase = StepPhase.IDLE

    def _commit_checkpoint(self) -> None:
        """Make a checkpoint still being written durable and keep it (every rank: it synchronises)."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.commit()
            logger.info("kept checkpoint %s", saving.tag)

    def memory_report(self) -> dict[str, int]:
        """Bytes the engine holds on each tier for model and optimizer state."""
        tiers = {"device": self.budget.used, "cpu": self.params.host_bytes() + self.grads.host_bytes(), "nvme": 0}
        for where, nbytes in self.optimizer_state.held_bytes().items():
            tiers[where] += nbytes
        return tiers

    def close(self) -> None:
        """Finish a checkpoint in progress and commit a deferred step (a diverged step is never
        one: see ``_diverge``); release hooks and the process group this engine created, also
        when that commit fails (its error is raised). In any phase; a second ``close`` (a
        ``finally`` after an explicit one) does nothing, as a file's."""
        if self._phase is StepPhase.CLOSED:
            return
        try:
            self._commit_checkpoint()
            self._finish_update()
            self.optimizer_state.close()
        finally:
            self._phase = StepPhase.CLOSED
            self.step_control.close()  # stops the host worker, removes the spilled gradients
            self.grads.close()
            self.params.close()
            self.io.close()  # after every tier: the writes still in flight land before the lock goes
            self.device.close()  # the buffers still out with copies come back
            if self._store_lock is not None:
                self._store_lock.release()
            self.comm.close()
