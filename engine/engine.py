"""``Engine``: the user's object. Wraps any ``nn.Module`` for a plain PyTorch loop::

    eng = Engine(model, config)
    for x, y in batches:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()

The model computes with compute-dtype parameters that are views into one flat buffer per
unit on the device (at stage 3 gathered only while the unit runs, see ``engine.zero.params``).
The fp32 masters and AdamW moments are sharded across ranks on the optimizer tier; each
step reduces the gradients to shards, updates the shards there and hands the new
compute-dtype shards back to the parameters.

Each public call runs only in the phases of the step cycle it belongs to (``engine.zero.phase``)
and moves the engine on to the next; a call out of order raises ``PhaseError``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from engine.config import Config
from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm
from engine.runtime.device import Device
from engine.runtime.sizes import MIB
from engine.tiers import rng
from engine.tiers.checkpoint import MemoryCheckpoints, PendingCheckpoint
from engine.tiers.optimizer import MemoryOptimizerState, OptimizerState, ShardState
from engine.tiers.optimizer_store import StoreOptimizerState
from engine.tiers.parameters import PARAM_STORE, MemoryParamTier, ParamTier, StoreParamTier
from engine.zero.buffers import materialize_buffers_
from engine.zero.divergence import DivergedError, diverged_message, nonfinite_units
from engine.zero.grads import MAX_IN_FLIGHT, GradientShards, bucket_bytes
from engine.zero.optim import ShardAdamW, clip_grads_, grad_norm, lr_factor
from engine.zero.params import ReplicatedParams, ShardedParams
from engine.zero.partition import (
    ROOT_UNIT,
    ModelLayout,
    UnitLayout,
    build_layout,
    find_units,
    flatten_into,
    materialize_,
    param_views,
    unit_needs,
    unit_parameters,
)
from engine.zero.phase import BETWEEN_UPDATES, StepPhase, expect
from engine.zero.precision import LossScaler, compute_dtype
from engine.zero.recompute import checkpoint_forward
from engine.zero.stats import StepStats
from engine.zero.update import Update, overlaps_backward
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
    ):
        config.validate()
        resume = resume or checkpoint is not None  # a checkpoint is only ever resumed from
        self.config = config
        self.device = Device.detect()
        self.comm = Comm.from_env(self.device.backend, self.device.device)
        self.dtype = compute_dtype(config.precision.compute_dtype)
        self.total_steps = total_steps or config.train.steps
        self.module = model
        self.budget = DeviceBudget(int(config.zero.device_memory_limit_mb * MIB))
        units, owned = self._units(model)
        tier = config.offload.optimizer
        opt_device = self.device.device if tier == "device" else torch.device("cpu")
        on_meta = self._check_start(model, resume, checkpoint, init_unit)
        self._checkpoints: MemoryCheckpoints | None = None
        """Where a memory tier's checkpoints are written, opened by the first that needs it."""
        self._saving: PendingCheckpoint | None = None
        """A memory tier's checkpoint still being written, finished by the next step."""
        if not on_meta:
            model.to(self.device.device)
        else:  # its buffers are computed now, its parameters unit by unit below
            materialize_buffers_(model, self.device.device)
        self._store_lock: StoreLock | None = None
        """The writer lock of the store at ``offload.nvme_path``, taken before its first write (rank 0's)."""
        self._store_locked = False  # on every rank: taking the lock is collective
        if tier == "nvme" or (config.zero.stage == 3 and config.offload.param == "nvme") or checkpoint is not None:
            self._lock_store(create=not resume)
        self.optimizer_state = self._optimizer_state(opt_device, resume, checkpoint)
        if tier == "device":
            self.budget.charge(self.optimizer_state.nbytes(), 'the optimizer state (offload.optimizer = "device")')
        self.params = self._params()
        self._build_units(owned, init_unit if on_meta and not resume else None, materialize=on_meta, resume=resume)
        self.grads = self._gradients(owned, opt_device)
        self.params.hook(dict(units), unit_needs(model, units, owned))
        self.params.check_fits({u.name: bucket_bytes(u) for u in self.layout.units}, MAX_IN_FLIGHT)
        self.adam = ShardAdamW(config.optim)
        self._step_counters = {u.name: self.adam.new_step_counter(opt_device) for u in self.layout.units}
        self.scaler = LossScaler(config.precision)
        self._start_counting()
        if resume:
            assert self.optimizer_state.resumed_from is not None  # a resumed tier holds its record
            self._restore(self.optimizer_state.resumed_from)
        else:
            self.optimizer_state.seal()
        self.params.io_bytes()  # what building wrote is not the first step's traffic
        self._log_start()

    def _gradients(self, owned: dict[str, list[tuple[str, nn.Parameter]]], opt_device: torch.device) -> GradientShards:
        """The gradient buckets and shards, on the optimizer's device."""
        on_device = self.config.offload.optimizer == "device"
        return GradientShards(
            self.layout,
            owned,
            self.comm,
            self.device,
            opt_device,
            reduce_per_micro_batch=self.config.zero.stage >= 2,
            budget=self.budget,
            shards_on_device=on_device,
            pin_memory=self.device.pin_memory and opt_device.type == "cpu",
            after_reduce=self.params.release_after_backward,
        )

    def _units(self, model: nn.Module) -> tuple[list[tuple[str, nn.Module]], dict[str, list[tuple[str, nn.Parameter]]]]:
        """The model's units (recomputing their activations if asked), the parameters each owns,
        and the layout of their flat buffers and shards (``self.layout``)."""
        config = self.config
        units = find_units(model, config.zero.unit_classes)
        if config.zero.activation_checkpointing:
            for name, module in units:
                if name != ROOT_UNIT:
                    checkpoint_forward(module)
        owned = unit_parameters(model, units)
        max_chunk = config.offload.chunk_mb * MIB // 4
        self.layout: ModelLayout = build_layout(owned, self.comm.world_size, max_chunk)
        self._param_order = [name for name, param in model.named_parameters() if param.requires_grad]
        """The model's own parameter order, which torch's gradient norm follows."""
        return units, {u.name: owned[u.name] for u in self.layout.units}

    def _check_start(self, model: nn.Module, resume: bool, checkpoint: str | None, init_unit: Callable | None) -> bool:
        """Refuse a start the engine cannot make; whether the model is on the meta device."""
        tier = self.config.offload.optimizer
        if resume and tier != "nvme" and checkpoint is None:
            raise ValueError(
                f"resuming needs the state on disk: offload.optimizer = {tier!r} keeps it in memory, so it "
                f"resumes only from a checkpoint saved in offload.nvme_path (checkpoint=tag); or train with "
                f'offload.optimizer = "nvme" to resume from its store\'s last step'
            )
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and init_unit is None and not resume:
            raise ValueError(
                "the model's parameters are on the meta device: pass init_unit=, a function that "
                "initialises named parameters in place, so the engine can build the model unit by unit"
            )
        return on_meta

    def _start_counting(self) -> None:
        """The counters and per-step records of a run that has taken no step yet."""
        self.global_step = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        """The last step's global gradient norm before clipping (None with loss scaling and no
        clipping: nothing takes it there)."""
        self.last_lr: float | None = None
        """The learning rate of the last step's update (None before the first)."""
        self._unit_norms: dict[str, float] = {}
        """This step's gradient norm of each unit updated inside backward, taken before its update."""
        self._diverged: str | None = None
        """Why this engine stopped, once a step diverged: it takes no further step."""
        self._phase = StepPhase.IDLE
        self.last_step_stats = StepStats()
        """What the last optimizer step cost (see ``engine.zero.stats``)."""
        self.client_state: dict[str, Any] = {}
        """Saved with every committed step and restored on resume (e.g. the data position)."""
        self._micro_batches = 0
        self._update: Update | None = None
        self._step_started: float | None = None
        self._overlap = overlaps_backward(self.config)
        """Whether each unit is updated as its gradient is reduced (nothing waits for all of them)."""

    def _log_start(self) -> None:
        config = self.config
        logger.info(
            "engine: stage %d, %d units, %.1fM params, compute %s, optimizer on %s, parameters on %s, rank %d of %d",
            config.zero.stage,
            len(self.layout.units),
            self.layout.numel / 1e6,
            config.precision.compute_dtype,
            config.offload.optimizer,
            config.offload.param,
            self.comm.rank,
            self.comm.world_size,
        )

    def _build_units(
        self,
        owned: dict[str, list[tuple[str, nn.Parameter]]],
        init_unit: Callable[[dict[str, torch.Tensor]], None] | None,
        *,
        materialize: bool,
        resume: bool,
    ) -> None:
        """Unit by unit: give a meta model's parameters memory (and ``init_unit`` values), flatten
        them, hand the fp32 shard to the optimizer tier (a resume reads it from the store instead)
        and the compute-dtype flat to the parameters, whose views the module's parameters become.
        At most one unit's fp32 values exist at a time, so a model larger than memory builds."""
        units = self.layout.units
        built, started, every = 0, time.perf_counter(), max(1, len(units) // 10)
        for index, unit in enumerate(units, 1):
            if materialize:
                materialize_(owned[unit.name], self.device.device)
            if init_unit is not None:
                init_unit(dict(owned[unit.name]))
            full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=self.device.device)
            flatten_into(full, unit, {name: p.detach() for name, p in owned[unit.name]})
            if not resume:
                self.optimizer_state.add_unit(unit, full[unit.shard_slice(self.comm.rank)])
            flat = full.to(self.dtype) if self.dtype != torch.float32 else full
            del full
            views = param_views(flat, unit)
            for name, param in owned[unit.name]:
                param.data = views[name]
            self.params.add(unit, flat)
            del flat, views
            built += unit.numel
            if index % every == 0 and self.comm.rank == 0:  # a giant model takes minutes to build
                logger.info(
                    "built %d of %d units, %.0fM params, in %.0f s",
                    index,
                    len(units),
                    built / 1e6,
                    time.perf_counter() - started,
                )
        self.params.finish_update()  # the initial shards are stored before anything fetches them

    def _params(self) -> ReplicatedParams | ShardedParams:
        """The compute-dtype parameters, sharded on their tier at stage 3."""
        zero, offload = self.config.zero, self.config.offload
        if zero.stage < 3:
            return ReplicatedParams(self.layout, self.comm, self.budget, self.device)
        tier: ParamTier
        if offload.param == "nvme":
            tier = StoreParamTier(
                Path(offload.nvme_path) / PARAM_STORE,
                self.layout,
                self.comm.rank,
                self.dtype,
                buffer_bytes=int(zero.prefetch_mb * MIB) // max(self.comm.world_size, 1),
                io_threads=offload.io_threads,
                checksum=offload.checksum,
                direct_io=offload.direct_io,
                barrier=self.comm.barrier,
            )
        else:
            tier = MemoryParamTier(offload.param == "device", self.device, self.dtype, self.budget)
        return ShardedParams(
            self.layout,
            self.comm,
            tier,
            self.budget,
            self.device,
            prefetch_bytes=int(zero.prefetch_mb * MIB),
            persistence_threshold=zero.persistence_threshold,
            reserve_bytes=self._required_headroom(),
        )

    def _required_headroom(self) -> int:
        """Device bytes that gathering ahead must leave free at stage 3: what a step may still
        have to allocate before anything optional is released (a unit gathered on demand, the
        root's gradient bucket, which lives through all of backward, and the buckets in flight)."""
        units = self.layout.units
        largest_unit = max(u.padded_numel for u in units) * self.dtype.itemsize
        largest_bucket = max(bucket_bytes(u) for u in units)
        root_bucket = sum(bucket_bytes(u) for u in units if u.name == ROOT_UNIT)
        return largest_unit + root_bucket + MAX_IN_FLIGHT * largest_bucket

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
            self.params.update(unit, master)
        self.params.finish_update()
        self.global_step = record["step"]
        self.skipped_steps = record.get("skipped_steps", 0)
        for counter in self._step_counters.values():
            counter.fill_(record.get("optimizer_steps", 0))
        if "loss_scale" in record:
            self.scaler.load_state_dict(record["loss_scale"])
        self.client_state = record.get("client_state", {})
        states = record.get("rng", [])
        if len(states) == self.comm.world_size:
            rng.restore(states[self.comm.rank])
        else:  # per-rank streams cannot be mapped onto another number of ranks
            logger.warning(
                "random states saved by %d rank(s) are not restored on %d", len(states), self.comm.world_size
            )
        logger.info("resumed at step %d from %s", self.global_step, self.config.offload.nvme_path)

    def _commit_record(self, step: int) -> dict[str, Any]:
        """What a committed step (or a checkpoint) at ``step`` must remember besides the tensors."""
        return {
            "step": step,
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": int(next(iter(self._step_counters.values())).item()),
            "loss_scale": self.scaler.state_dict(),
            "client_state": copy.deepcopy(self.client_state),  # a deferred commit writes it later
            "rng": self.comm.all_gather_object(rng.capture()),
            "world_size": self.comm.world_size,
        }

    def _optimizer_state(self, device: torch.device, resume: bool, checkpoint: str | None) -> OptimizerState:
        """The (empty) optimizer tier the configuration asks for."""
        offload = self.config.offload
        if offload.optimizer != "nvme":
            state = MemoryOptimizerState(device, pin_memory=device.type == "cpu" and self.device.pin_memory)
            if resume:
                assert checkpoint is not None  # __init__ refuses resuming a memory tier without one
                state.restore(*self._memory_checkpoints(create=False).read(checkpoint))
            return state
        return StoreOptimizerState(
            Path(offload.nvme_path),
            self.layout,
            self.comm.rank,
            buffer_bytes=offload.buffer_mb * MIB,
            io_threads=offload.io_threads,
            checksum=offload.checksum,
            direct_io=offload.direct_io,
            barrier=self.comm.barrier,
            resume=resume,
            checkpoint=checkpoint,
            mode=self.config.store.mode,
        )

    def _lock_store(self, create: bool) -> None:
        """Take the writer lock of the store at ``offload.nvme_path`` (rank 0 holds it for the
        run), once, before anything writes there, making its folder if ``create``; every rank
        hears if it is refused. A run that fails before writing leaves the folder as it found
        it (see ``StoreLock``)."""
        if not self._store_locked:
            path = self.config.offload.nvme_path
            self._store_lock = self.comm.on_leader(lambda: StoreLock.acquire(path, create=create))
            self._store_locked = True

    def _memory_checkpoints(self, create: bool) -> MemoryCheckpoints:
        """The store at ``offload.nvme_path`` a memory tier keeps its checkpoints in (created
        by the first ``save`` if ``create``)."""
        if self._checkpoints is None:
            self._lock_store(create)
            offload = self.config.offload
            self._checkpoints = MemoryCheckpoints(
                Path(offload.nvme_path),
                self.layout,
                self.comm.rank,
                io_threads=offload.io_threads,
                checksum=offload.checksum,
                direct_io=offload.direct_io,
                barrier=self.comm.barrier,
                create=create,
            )
        return self._checkpoints

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
        """The phase with no step in progress: COMMIT_PENDING while the last step's commit is
        deferred (its tier knows), else IDLE."""
        return StepPhase.COMMIT_PENDING if self.optimizer_state.commit_pending else StepPhase.IDLE

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, with tensor arguments moved to the compute device: a step's
        micro-batch, or an evaluation whose loss never goes backward (between steps or between
        micro-batches; not while a step's update is open). A forward that raises leaves the
        phase as it was: it changed nothing of the step."""
        self._expect("__call__ (the forward)", *BETWEEN_UPDATES)
        if self._step_started is None:
            self._step_started = time.perf_counter()
            self.budget.start_step()
        self.params.begin_iteration()
        move = lambda v: v.to(self.device.device, non_blocking=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
        output = self.module(*(move(a) for a in args), **{k: move(v) for k, v in kwargs.items()})
        self._phase = StepPhase.FORWARD
        return output

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (scaled for fp16, divided over accumulation).

        On the last micro-batch of a step the last step's deferred commit lands first (its
        writes went on behind this step's forward: ``store.defer_commit``), since this step
        reads the state it wrote; then the optimizer state starts streaming in, and without
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
        with self._within_step():
            self.grads.start_backward(last)  # first: it makes the last step's order the record
            if last:
                self.optimizer_state.settle()
                lr = self.config.optim.lr * lr_factor(self.global_step, self.config.optim, self.total_steps)
                self.last_lr = lr
                self._update = Update(self._update_order(), self.optimizer_state, lambda u, s: self._apply(u, s, lr))
                self._unit_norms = {}
                self.grads.on_ready = self._update.ready if self._overlap else None
            scaled = self.scaler.scale_loss(loss)
            (scaled / accum if accum > 1 else scaled).backward()
            self.grads.end_backward()
            self.grads.on_ready = None
            self._micro_batches += 1
        self._phase = StepPhase.UPDATING if last else StepPhase.ACCUMULATING

    def _update_order(self) -> list[UnitLayout]:
        """The units in the order their gradients completed last step. Before one is recorded,
        the order backward usually takes: the last unit first, the root (embeddings, head) last.
        A wrong guess costs memory, not correctness: shards wait for the units due before them."""
        recorded = self.grads.order.recorded
        if sorted(recorded) == sorted(u.name for u in self.layout.units):
            return [self.layout.unit(name) for name in recorded]
        units = self.layout.units
        return [u for u in reversed(units) if u.name != ROOT_UNIT] + [u for u in units if u.name == ROOT_UNIT]

    @property
    def is_accumulation_boundary(self) -> bool:
        """Whether the step's last micro-batch went backward, so that ``step()`` updates."""
        return self._phase is StepPhase.UPDATING

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
            update = self._take_update()
            grads = self.grads.finalize()
            overflow = self.scaler.unscale_and_check(grads, self.comm)
            self.scaler.update(overflow)
            if overflow:
                update.abandon()
                self.skipped_steps += 1
                logger.warning(
                    "step %d skipped: inf/nan gradients; loss scale now %g", self.global_step, self.scaler.scale
                )
            else:
                if self._overlap:
                    update.finish()
                    self._check_unit_norms(update)
                else:
                    self._check_norm(update, grads)
                    update.finish()
                self.params.finish_update()
                start = time.perf_counter()
                self.optimizer_state.finish(
                    self._commit_record(self.global_step + 1), defer=self.config.store.defer_commit
                )
                update.wait_s += time.perf_counter() - start
            self.global_step += 1
            self._drop_grads()
            self._finish_saving()
            self._record_stats(update)
        self._phase = self._between_steps()
        return not overflow

    def _take_update(self) -> Update:
        """The update the step's last ``backward`` opened, which only UPDATING holds."""
        update, self._update = self._update, None
        assert update is not None, "entering UPDATING opens the step's update"
        return update

    def _check_norm(self, update: Update, grads: list[torch.Tensor]) -> None:
        """Before any unit is updated: the global gradient norm, which stops the step if it is
        not finite and clips the gradients (``optim.grad_clip``). Loss scaling without clipping
        needs neither: its overflow check has passed."""
        clip = self.config.optim.grad_clip
        if clip == 0 and self.scaler.enabled:
            return
        norm = grad_norm(self._norm_pieces(grads), self.comm)
        self.last_grad_norm = float(norm)
        if not math.isfinite(self.last_grad_norm):
            self._diverge(update, f"the gradient norm is {self.last_grad_norm}")
        if clip > 0:
            clip_grads_(grads, clip, norm)

    def _check_unit_norms(self, update: Update) -> None:
        """After updates inside backward, each taken only if its unit's gradient norm was
        finite: stop the step on every rank if any rank left a unit out. One all-reduce of the
        squared norms agrees on it (nan and inf survive the sum) and gives the global norm."""
        squares = sum(norm * norm for norm in self._unit_norms.values())
        self.last_grad_norm = math.sqrt(self.comm.all_reduce_value(squares, op="sum"))
        if not math.isfinite(self.last_grad_norm):
            left_out = [(name, norm) for name, norm in self._unit_norms.items() if not math.isfinite(norm)]
            self._diverge(update, nonfinite_units(self.comm.all_gather_object(left_out)))

    def abandon_step(self, what: str) -> NoReturn:
        """Stop the step whose backward has run, instead of ``step()``, because ``what`` is not
        finite (e.g. the loss, which the engine never sees): as a diverged step, never committed,
        with ``DivergedError``. Every rank calls it at the same point."""
        self._expect("abandon_step(what)", StepPhase.UPDATING)
        with self._within_step():
            self._diverge(self._take_update(), what)

    def _diverge(self, update: Update, what: str) -> NoReturn:
        """Give the step up on this rank (each rank comes here at the same point): drop its
        reads, let the parameter gathers every rank issued complete, never commit its writes,
        and take no further step: the model and the optimizer state may be partly updated."""
        update.abandon()
        self.params.finish_update()
        where = self.optimizer_state.discard_step()
        self._diverged = diverged_message(self.global_step + 1, what, where, self.config)
        self._phase = StepPhase.DIVERGED
        raise DivergedError(self._diverged)

    def _norm_pieces(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the global gradient norm is taken over: on one rank each parameter's gradient
        (views of the unit shards, which are whole there) in the model's parameter order, as
        ``torch.nn.utils.clip_grad_norm_`` takes it, so that the norm is torch's bit for bit; on
        several ranks a parameter may span shards, so each rank's shards."""
        if self.comm.world_size > 1:
            return grads
        views = {}
        for unit in self.layout.units:
            views.update(param_views(self.grads.ready(unit.name), unit))
        return [views[name] for name in self._param_order]

    def _apply(self, unit: UnitLayout, state: ShardState, lr: float) -> None:
        """AdamW on one unit's shard, then hand the new master to the parameters.

        Inside backward (overlap) nothing has seen every gradient, so the unit's own gradient
        norm is taken first, and a unit whose norm is not finite is left as it was (``step``
        then stops the step on every rank; raising here, in an autograd hook, would leave the
        other ranks waiting in their collectives). Its unchanged master is still handed on:
        every rank must take part in the same parameter gathers."""
        grad = self.grads.ready(unit.name)
        finite = True
        if self._overlap:
            norm = self._unit_norms[unit.name] = float(torch.linalg.vector_norm(grad))
            finite = math.isfinite(norm)
        if finite:
            if self._saving is not None:
                self._saving.wait_unit(unit.name)
            self.adam.update(state.master, grad, state.exp_avg, state.exp_avg_sq, self._step_counters[unit.name], lr)
        self.params.update(unit, state.master)
        self.grads.release_shard(unit.name)

    def _record_stats(self, update: Update) -> None:
        now = time.perf_counter()
        store = self.optimizer_state
        reads, writes = store.take_io_bytes()
        param_reads, param_writes = self.params.io_bytes()
        hits, misses = self.params.prefetch_counts()
        self.last_step_stats = StepStats(
            seconds=now - (self._step_started or now),
            param_wait_s=self.params.take_wait_s(),
            optimizer_wait_s=update.wait_s,
            optimizer_s=update.compute_s,
            bytes_read=reads + param_reads,
            bytes_written=writes + param_writes,
            prefetch_hits=hits,
            prefetch_misses=misses,
            device_high_water=self.budget.high_water,
            bytes_copied=self.device.take_copied_bytes(),
        )
        self._step_started = None

    def gathered(self):
        """A context in which every parameter holds its full values, also at stage 3 (to read,
        evaluate or save the model outside ``eng(...)``/``eng.backward``). Not while a step's
        update is open: the parameters are half updated then; after a step that diverged or
        failed they may be, and are shown as they are."""
        self._expect("gathered()", *BETWEEN_UPDATES, StepPhase.DIVERGED, StepPhase.FAILED)
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
        self.grads.zero()
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
        keep = self.config.checkpoint.keep
        if isinstance(self.optimizer_state, StoreOptimizerState):
            self._expect("save(tag)", *BETWEEN_UPDATES, StepPhase.FAILED)
            self._settle()
            self.optimizer_state.save(tag, keep=keep)
            return
        self._expect("save(tag)", *BETWEEN_UPDATES)
        self._finish_saving()
        states = self.optimizer_state.stream(self.layout.units)
        self._saving = self._memory_checkpoints(create=True).save(
            tag, self._commit_record(self.global_step), states, keep=keep
        )

    def flush(self) -> None:
        """Commit the last step now if its commit was deferred (``store.defer_commit``), so that
        the store on disk holds it (e.g. before copying the store); otherwise it lands at the
        next step's last backward, its writes having gone on behind that step's forward. Every
        rank calls it at the same point: it synchronises them."""
        self._expect("flush()", *BETWEEN_UPDATES, StepPhase.UPDATING, StepPhase.DIVERGED, StepPhase.FAILED)
        self._settle()

    def _settle(self) -> None:
        """Commit the last step now if its commit was deferred. A commit that fails loses that
        step: its state is in the parameters but not in the store."""
        with self._within_step():
            self.optimizer_state.settle()
        if self._phase is StepPhase.COMMIT_PENDING:
            self._phase = StepPhase.IDLE

    def _finish_saving(self) -> None:
        """Make a memory tier's checkpoint in progress durable and keep it."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.finish()
            logger.info("kept checkpoint %s", saving.tag)

    def memory_report(self) -> dict[str, int]:
        """Bytes the engine holds on each tier for model and optimizer state."""
        tiers = {"device": self.budget.used, "cpu": self.params.host_bytes(), "nvme": 0}
        optimizer = self.config.offload.optimizer
        if optimizer != "device":
            tiers[optimizer] += self.optimizer_state.nbytes()
            tiers["cpu"] += self.grads.nbytes()
        return tiers

    def close(self) -> None:
        """Finish a checkpoint in progress and commit a deferred step (a diverged step is never
        one: see ``_diverge``); release hooks and the process group this engine created, also
        when that commit fails (its error is raised). In any phase; a second ``close`` (a
        ``finally`` after an explicit one) does nothing, as a file's."""
        if self._phase is StepPhase.CLOSED:
            return
        try:
            self._finish_saving()
            self.optimizer_state.close()
        finally:
            self._phase = StepPhase.CLOSED
            self.grads.close()
            self.params.close()
            if self._checkpoints is not None:
                self._checkpoints.close()
            if self._store_lock is not None:
                self._store_lock.release()
            self.comm.close()
