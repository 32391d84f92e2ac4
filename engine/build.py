"""The engine's parts built from the config: the model's units and layout, the optimizer
tier, the parameters on theirs, the gradient shards and the memory tiers' checkpoint store. The one place a tier's name in
the config becomes a class: past here the engine sees only the tier protocols
(``OptimizerState``, ``ParamTier``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from torch import nn

from engine.config import Config, shares_master, spills_gradients
from engine.runtime import heap_bound
from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm
from engine.runtime.device import Device
from engine.runtime.host_worker import HostWorker, uses_host_worker
from engine.runtime.staging import StagingRing
from engine.state.dtypes import compute_dtype
from engine.state.forms import StateForm
from engine.state.partition import (
    ROOT_UNIT,
    ModelLayout,
    build_layout,
    find_units,
    flatten_into,
    materialize_,
    max_chunk_numel,
    param_views,
    unit_parameters,
)
from engine.tiers.checkpoint import FrozenShards, MemoryCheckpoints
from engine.tiers.frozen import read_frozen_async
from engine.tiers.grad_spill import GradSpill, scratch_disk_bytes
from engine.tiers.optimizer import MemoryOptimizerState, OptimizerState
from engine.tiers.optimizer_store import StoreOptimizerState
from engine.tiers.parameters import PARAM_STORE, MemoryParamTier, ParamTier, StoreParamTier
from engine.tiers.sizing import (
    MAX_IN_FLIGHT,
    gradient_dtype,
    master_upload_bytes,
    optimizer_buffer_bytes,
    param_window_bytes,
    pinned_bytes,
    pinned_limit_bytes,
    prefetch_bytes,
    spill_buffer_bytes,
    spill_dtype,
)
from engine.tiers.store_checks import check_buffer_memory
from engine.tiers.store_io import StoreIO
from engine.zero.buffers import materialize_buffers_
from engine.zero.decay import no_decay_names
from engine.zero.grads import GradientShards, bucket_bytes
from engine.zero.params import Params, ShardedParams
from engine.zero.recompute import checkpoint_forward, outermost
from engine.zero.replicated_params import ReplicatedParams
from engine.zero.step import StepControl

logger = logging.getLogger(__name__)


def model_units(
    model: nn.Module, config: Config, world_size: int
) -> tuple[list[tuple[str, nn.Module]], dict[str, list[tuple[str, nn.Parameter]]], ModelLayout]:
    """The model's units (recomputing their activations if asked), the parameters each owns
    (trainable and frozen units alike), and the layout of their flat buffers and shards. An
    ``optim.no_decay`` pattern that fits no parameter is refused here, before any file is
    touched (the step's arithmetic takes the exempt parameters from the model again)."""
    no_decay_names(model, config.optim.no_decay)
    units = find_units(model, config.zero.unit_classes)
    if config.zero.activation_checkpointing:
        for _, module in outermost(units, ROOT_UNIT):
            checkpoint_forward(module)
    return units, *units_layout(model, units, config, world_size)


def units_layout(
    model: nn.Module, units: list[tuple[str, nn.Module]], config: Config, world_size: int
) -> tuple[dict[str, list[tuple[str, nn.Parameter]]], ModelLayout]:
    """The parameters each of the model's ``units`` owns, trainable and frozen units alike, and
    their layout: what the engine and ``estimate`` both lay out."""
    owned, frozen = unit_parameters(model, units), unit_parameters(model, units, trainable=False)
    align = StateForm.of(config.optim).chunk_align
    layout = build_layout(owned, world_size, max_chunk_numel(config.offload.chunk_mb), frozen, align)
    if not layout.units:
        raise ValueError(
            "no parameter of the model requires grad, so there is nothing to train: set requires_grad=True on "
            "the parameters to train before building the engine"
        )
    return {u.name: (owned | frozen)[u.name] for u in layout.all_units}, layout


def place_model(model: nn.Module, device: torch.device, on_meta: bool) -> None:
    """Put the model on the compute device; one built on the meta device gets its buffers now,
    computed by its own initialisation, and its parameters unit by unit as they are built."""
    if on_meta:
        materialize_buffers_(model, device)
    else:
        model.to(device)


def check_start(
    config: Config,
    model: nn.Module,
    resume: bool,
    checkpoint: str | None,
    init_unit: Callable | None,
    overwrite: bool = False,
) -> bool:
    """Refuse a start the engine cannot make; whether the model is on the meta device."""
    if resume and overwrite:
        raise ValueError("overwrite starts afresh and a resume continues the store: ask for one of them")
    tier = config.offload.optimizer
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


class CheckpointStore:
    """Opens the store at ``offload.nvme_path`` that a memory tier keeps its checkpoints in, on
    first use, after taking its writer lock (``lock(create)``, created by the first ``save``);
    ``frozen`` gives the frozen units' values it stores once (the parameters', set once built)."""

    def __init__(
        self,
        config: Config,
        layout: ModelLayout,
        rank: int,
        io: StoreIO,
        lock: Callable[[bool], None],
        overwrite: bool = False,
    ) -> None:
        self._path, self._layout, self._rank, self._io, self._lock = (
            Path(config.offload.store_path),
            layout,
            rank,
            io,
            lock,
        )
        self._overwrite = overwrite  # a new run's first checkpoint replaces the store there
        self.frozen: FrozenShards = lambda: iter(())
        self._form = StateForm.of(config.optim)
        self._opened: MemoryCheckpoints | None = None

    def __call__(self, create: bool) -> MemoryCheckpoints:
        if self._opened is None:
            self._lock(create)
            self._opened = MemoryCheckpoints(
                self._path,
                self._layout,
                self._rank,
                self._io,
                create=create,
                frozen=self.frozen,
                form=self._form,
                overwrite=create and self._overwrite,
            )
        return self._opened


def optimizer_device(config: Config, device: Device) -> torch.device:
    """Where the optimizer state is held and AdamW runs: on the device for the ``device`` tier,
    else on the host (the ``nvme`` tier stages its state there)."""
    return device.device if config.offload.optimizer == "device" else torch.device("cpu")


def optimizer_state(
    config: Config,
    layout: ModelLayout,
    rank: int,
    io: StoreIO,
    checkpoints: CheckpointStore,
    *,
    device: torch.device,
    budget: DeviceBudget,
    resume: bool,
    checkpoint: str | None,
    overwrite: bool = False,
) -> OptimizerState:
    """The optimizer tier the configuration asks for: empty, or restored on resume; a new one
    replaces whatever store is at ``offload.nvme_path`` only with ``overwrite`` (``check_new``).
    The ``device`` tier's state is charged to the device ``budget``."""
    offload, form = config.offload, StateForm.of(config.optim)
    if offload.optimizer != "nvme":
        on_device, frozen_on_disk = offload.optimizer == "device", config.zero.stage == 3 and offload.param == "nvme"
        state = MemoryOptimizerState(device, checkpoints, store_frozen=frozen_on_disk, form=form, on_device=on_device)
        if resume:
            assert checkpoint is not None  # the engine refuses resuming a memory tier without one
            state.restore(checkpoint)
        if on_device:
            budget.charge(state.nbytes(), 'the optimizer state (offload.optimizer = "device")')
        return state
    buffer_bytes = optimizer_buffer_bytes(offload, layout.units, form)
    if offload.buffer_mb == "auto":
        check_buffer_memory(layout, buffer_bytes, psutil.virtual_memory().available, form)
    return StoreOptimizerState(
        Path(offload.store_path),
        layout,
        rank,
        io,
        buffer_bytes=buffer_bytes,
        resume=resume,
        checkpoint=checkpoint,
        mode=config.store.mode,
        scratch_bytes=scratch_disk_bytes(config, layout.units),
        form=form,
        overwrite=overwrite,
    )


def bound_host_memory(config: Config, layout: ModelLayout, device: Device, dtype: torch.dtype) -> None:
    """Before any tier allocates: let the heap keep what the model's units make and free again
    (``engine.runtime.heap_bound``), and give the device its pinned pool
    (``engine.runtime.pinned``), sized by ``offload.pinned_mb``, refused if below what the plan
    copies through, with the nvme tiers' staging reserved in it (none where the device is the host)."""
    heap_bound.keep_for(layout.largest_unit_numel * dtype.itemsize)
    need = pinned_bytes(config, layout, dtype)
    pool = device.bound_pinned(pinned_limit_bytes(config.offload, need))
    if pool is None:
        return
    pool.check_fits(need)
    if "parameter staging" in need:
        pool.reserve(need["parameter staging"], "the parameter staging")


def parameters(
    config: Config,
    layout: ModelLayout,
    comm: Comm,
    device: Device,
    dtype: torch.dtype,
    budget: DeviceBudget,
    io: StoreIO,
    optimizer_state: OptimizerState,
) -> Params:
    """The compute-dtype parameters, sharded on their tier at stage 3 (the nvme tier reads the
    frozen units' values from ``optimizer_state``'s store, and bf16 masters from it where they
    are the parameters, ``shares_master``)."""
    zero, offload = config.zero, config.offload
    uploads = master_uploads(config, layout, device, dtype)
    if zero.stage < 3:
        return ReplicatedParams(layout, comm, budget, device, uploads)
    tier: ParamTier
    if offload.param == "nvme":
        buffer_bytes = param_window_bytes(zero, layout, dtype)
        path = Path(offload.store_path) / PARAM_STORE
        tier = StoreParamTier(
            path,
            layout,
            comm.rank,
            dtype,
            io,
            buffer_bytes=buffer_bytes,
            read_frozen=lambda unit, values: read_frozen_async(optimizer_state.frozen_store(), unit, comm.rank, values),
            read_master=optimizer_state.read_master_async if shares_master(config) else None,
            master_dtype=compute_dtype(config.optim.master_dtype),
            pin=device.pin_memory,
        )
    else:
        tier = MemoryParamTier(offload.param == "device", device, dtype, budget, uploads)
    return ShardedParams(
        layout,
        comm,
        tier,
        budget,
        device,
        prefetch_bytes=prefetch_bytes(zero, layout, dtype),
        persistence_threshold=zero.persistence_threshold,
        reserve_bytes=required_headroom(layout, dtype, gradient_dtype(config, comm.world_size)),
        uploads=uploads,
        defers_update=config.optim.defer_update,
    )


def master_uploads(config: Config, layout: ModelLayout, device: Device, dtype: torch.dtype) -> StagingRing | None:
    """Where host masters are rounded to the compute dtype on their way to the device (its
    size is ``engine.tiers.sizing.pinned_bytes``' "master uploads"); None where the masters are
    on the device, or the device is the host."""
    if device.pinned is None or config.offload.optimizer_on_device:
        return None
    return StagingRing(device, master_upload_bytes(layout, dtype), "the masters' uploads to the device")


def required_headroom(layout: ModelLayout, dtype: torch.dtype, grad_dtype: torch.dtype) -> int:
    """Device bytes that gathering ahead must leave free at stage 3: what a step may still
    have to allocate before anything optional is released (a unit gathered on demand, the
    root's gradient bucket, which lives through all of backward, and the buckets in flight)."""
    units = layout.units
    largest_unit = layout.largest_unit_numel * dtype.itemsize
    largest_bucket = max(bucket_bytes(u, grad_dtype) for u in units)
    root_bucket = sum(bucket_bytes(u, grad_dtype) for u in units if u.name == ROOT_UNIT)
    return largest_unit + root_bucket + MAX_IN_FLIGHT * largest_bucket


def gradients(
    config: Config,
    layout: ModelLayout,
    owned: dict[str, list[tuple[str, nn.Parameter]]],
    comm: Comm,
    device: Device,
    budget: DeviceBudget,
    params: Params,
    opt_device: torch.device,
    io: StoreIO,
) -> tuple[GradientShards, GradSpill | None]:
    """The gradient buckets and shards, on the optimizer's device, and where final shards wait
    on disk for the step (``grad_spill``), if they do."""
    shards = GradientShards(
        layout,
        owned,
        comm,
        device,
        opt_device,
        reduce_per_micro_batch=config.zero.stage >= 2,
        budget=budget,
        shards_on_device=config.offload.optimizer == "device",
        after_reduce=params.release_after_backward,
        dtype=gradient_dtype(config, comm.world_size),
    )
    return shards, grad_spill(config, layout, comm.rank, io)


def grad_spill(config: Config, layout: ModelLayout, rank: int, io: StoreIO) -> GradSpill | None:
    """This rank's spill of final gradient shards to the nvme store's scratch folder, where the
    update waits for every gradient (``offload.grad_spill``), else None. Built after the
    optimizer tier, whose writer has swept the last run's scratch folder by then."""
    if not spills_gradients(config):
        return None
    dtype = spill_dtype(config.offload)
    buffer = spill_buffer_bytes(config.offload, layout.units, dtype)
    return GradSpill(config.offload.store_path, layout, rank, io, buffer_bytes=buffer, dtype=dtype)


def step_control(
    config: Config,
    layout: ModelLayout,
    comm: Comm,
    grads: GradientShards,
    params: Params,
    model: nn.Module,
    optimizer_state: OptimizerState,
    device: Device,
    opt_device: torch.device,
    spill: GradSpill | None,
) -> StepControl:
    """Each step's control path, with the host optimizer worker where AdamW runs beside the
    training thread (``uses_host_worker``)."""
    worker = HostWorker(device.device) if uses_host_worker(config, not device.copies_are_synchronous) else None
    return StepControl(config, layout, comm, grads, params, model, optimizer_state, opt_device, spill, worker)


def build_units(
    layout: ModelLayout,
    owned: dict[str, list[tuple[str, nn.Parameter]]],
    optimizer_state: OptimizerState,
    params: Params,
    *,
    device: torch.device,
    dtype: torch.dtype,
    master_dtype: torch.dtype,
    rank: int,
    init_unit: Callable[[dict[str, torch.Tensor]], None] | None,
    materialize: bool,
    resume: bool,
) -> None:
    """Unit by unit: give a meta model's parameters their slots of the unit's fp32 flat (but see
    below) as memory (and ``init_unit`` values, written there with no copy after), or copy a
    real model's into it; ``add`` the master shard to the optimizer tier (a frozen unit's
    compute-dtype shard; a resume reads them from the store instead) and the compute-dtype flat
    to the parameters, whose views the module's parameters become. At most one unit's fp32
    values exist at a time, so a model larger than memory builds.

    The parameters are their masters cast to the compute dtype, from the first step on as after
    every update: a bf16 master's rounding is theirs too, whichever dtype computes. Where the
    two dtypes are one, that is one cast of the fp32 values, made once.
    An ``init_unit`` whose ``copies_values`` is true (a checkpoint's import: its values are
    copied in, not computed, so they round once whatever dtype they land in) fills the flat in
    the compute dtype directly then: a checkpoint imports with no fp32 round trip, and in the
    buffer the optimizer tier writes its master from, where it can ``lend`` one (no copy)."""
    units = layout.all_units
    built, started, every = 0, time.perf_counter(), max(1, len(units) // 10)
    copies = master_dtype == dtype and getattr(init_unit, "copies_values", False)
    for index, unit in enumerate(units, 1):
        lent = optimizer_state.lend(unit, dtype) if copies and not resume else None
        kind = dtype if copies else torch.float32
        full = torch.empty(unit.padded_numel, dtype=kind, device=device) if lent is None else lent
        full[unit.numel :].zero_()  # the padding; the parameters fill the rest, end to end
        if materialize:  # the parameters' memory is their slots in ``full``: no copy into it
            materialize_(owned[unit.name], param_views(full, unit))
        if init_unit is not None:
            init_unit(dict(owned[unit.name]))
        if not materialize:
            flatten_into(full, unit, {name: p.detach() for name, p in owned[unit.name]})
        master = full.to(master_dtype if unit.trainable else dtype)  # a frozen unit's: its values
        flat = master.to(dtype) if lent is None else torch.empty(unit.padded_numel, dtype=dtype, device=device)
        views = param_views(flat, unit)
        for name, param in owned[unit.name]:
            param.data = views[name]
        if lent is not None:  # before ``add`` lets the tier reuse its buffer
            params.add(unit, flat, values=lent)
        if not resume:
            optimizer_state.add(unit, master[unit.shard_slice(rank)])
        if lent is None:  # after ``add`` has copied the master, if it is ``flat``: the parameters may free it
            params.add(unit, flat)
        del full, master, flat, views
        built += unit.numel
        if index % every == 0 and rank == 0:  # a giant model takes minutes to build
            elapsed = time.perf_counter() - started
            logger.info("built %d of %d units, %.0fM params, in %.0f s", index, len(units), built / 1e6, elapsed)
    params.flush()  # the initial shards are stored before anything reads them


def log_start(config: Config, layout: ModelLayout, comm: Comm) -> None:
    """One line of what was built, for the run's log."""
    logger.info(
        "engine: stage %d, %d units, %.1fM trained params, %.1fM frozen, compute %s, optimizer on %s, "
        "parameters on %s, rank %d of %d",
        config.zero.stage,
        len(layout.all_units),
        layout.numel / 1e6,
        layout.frozen_numel / 1e6,
        config.precision.compute_dtype,
        config.offload.optimizer,
        config.offload.param,
        comm.rank,
        comm.world_size,
    )
