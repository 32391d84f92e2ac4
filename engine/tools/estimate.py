"""Memory per tier for a run of the built-in GPT, and the plan that fits this machine.

Choosing a ZeRO stage and offload tiers by trial costs a run killed by the kernel after
minutes of model building; this estimate costs a second. For every stage and tier plan it
predicts, per rank, the bytes on the device and in host memory, the size of the store on
disk, and the peak resident set (RSS) of the rank's process; ``recommend`` then picks the
least offload that fits this machine with headroom.

The prediction follows the engine's life cycle, one phase at a time, and takes the largest:

- construction: ``python -m engine train`` builds the model on the ``meta`` device, and
  ``Engine`` materialises, initialises and flattens it unit by unit, the fp32 values freed as
  each unit's compute-dtype flat, its optimizer shard and (stage 3) its parameter shard are made;
- training: what stays resident (parameters, optimizer state, staging pools), plus what a
  step holds at the start of backward (activations, units gathered ahead), at its end
  (every gradient shard, buckets in flight) or at the optimizer step.

Each term is a small named function of the layout and the config, so a change in how the
engine holds memory is a change to one function. The layout is the engine's own
(``engine.zero.partition``), computed from the model built on the ``meta`` device, so padding and
unit sizes are exact. Two terms are measured rather than derived: the baseline of a Python
process that has loaded torch and the engine (measured once, in a subprocess), and the memory
glibc's heap keeps after the engine frees it (a documented fraction; see ``HEAP_RETENTION``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from engine.config import Config, ConfigError, Tier
from engine.run.data import TOKEN_SUFFIX, ByteTokenizer, load_tokens
from engine.run.models.gpt import GPT, HEAD_DIM, GPTConfig
from engine.run.train import build_model
from engine.runtime.heap import MMAP_THRESHOLD
from engine.runtime.sizes import FP32, MIB
from engine.tiers.store_checks import unit_state_bytes
from engine.zero.grads import MAX_IN_FLIGHT
from engine.zero.partition import (
    ROOT_UNIT,
    ModelLayout,
    build_layout,
    find_units,
    unit_parameters,
)
from engine.zero.precision import compute_dtype
from engine.zero.update import overlaps_backward

GIB = 1 << 30
ADAM_KINDS = 3
"""fp32 tensors per parameter the optimizer tier holds: master, exp_avg, exp_avg_sq."""
HEADROOM = 0.2
"""Fraction of RAM, device memory and free disk a recommended plan leaves unused: the
estimate's own error (tested within 15%), the page cache the nvme tier streams through, and
whatever else the machine runs."""
HEAP_RETENTION = 0.8
"""Fraction of the unit-sized host buffers a step frees and makes again (gradient shards and
buckets, gathered units) that glibc's heap keeps resident besides the live ones. Once its
dynamic mmap threshold has risen past a unit's size such buffers come from the heap, whose
holes are reused but seldom returned. Measured on 20-40M-parameter GPTs after 2-3 steps:
0.2-0.6x on one rank, 1-2x on two; growing to 1.7x after 20 steps of the nvme tier (whose
peak this then under-predicts by 15%). Activations (many smaller tensors) add little."""
HEAP_BUFFER_LIMIT = MMAP_THRESHOLD
"""``python -m engine train`` pins glibc's mmap threshold (``engine.runtime.heap``): a buffer at least this
large is mapped on its own and returned to the system when freed; only smaller ones stay in the heap."""

TIER_ORDER: tuple[tuple[Tier, Tier], ...] = (
    ("device", "device"),
    ("cpu", "device"),
    ("cpu", "cpu"),
    ("nvme", "device"),
    ("nvme", "cpu"),
    ("nvme", "nvme"),
)
"""(optimizer, param) tiers from least to most offload: host memory before disk, and the
optimizer state (touched once a step) before the parameters (fetched every micro-batch)."""


@dataclass(frozen=True)
class Plan:
    """The stage and tiers ``--plan auto`` chooses among."""

    stage: int
    optimizer: Tier
    param: Tier = "device"

    def apply(self, config: Config) -> Config:
        """A copy of ``config`` with this plan's stage and tiers."""
        zero = dataclasses.replace(config.zero, stage=self.stage)
        offload = dataclasses.replace(config.offload, optimizer=self.optimizer, param=self.param)
        planned = dataclasses.replace(config, zero=zero, offload=offload)
        planned.validate()
        return planned

    def __str__(self) -> str:
        return f"stage {self.stage}, optimizer {self.optimizer}, param {self.param}"


def all_plans() -> list[Plan]:
    """Every valid plan, in ``TIER_ORDER`` and then by stage (parameter tiers need stage 3)."""
    return [
        Plan(stage, optimizer, param)
        for optimizer, param in TIER_ORDER
        for stage in (1, 2, 3)
        if param == "device" or stage == 3
    ]


def plan_of(config: Config) -> Plan:
    return Plan(config.zero.stage, config.offload.optimizer, config.offload.param)


@dataclass(frozen=True)
class Footprint:
    """Bytes on the compute device and in host memory at one moment."""

    device: int = 0
    host: int = 0

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.device + other.device, self.host + other.host)

    def __sub__(self, other: Footprint) -> Footprint:
        return Footprint(self.device - other.device, self.host - other.host)

    def rss(self, device_is_host: bool) -> int:
        """Resident bytes of the process (the device's are host memory on a CPU build)."""
        return self.host + (self.device if device_is_host else 0)


@dataclass(frozen=True)
class RunShape:
    """What the terms need to know of a run: the model, its layout and the config."""

    gpt: GPTConfig
    layout: ModelLayout
    config: Config

    @property
    def itemsize(self) -> int:
        """Bytes per compute-dtype element."""
        return compute_dtype(self.config.precision.compute_dtype).itemsize

    @property
    def padded(self) -> int:
        return sum(u.padded_numel for u in self.layout.units)

    @property
    def shard(self) -> int:
        return sum(u.shard_numel for u in self.layout.units)

    @property
    def largest_unit(self) -> int:
        return max(u.padded_numel for u in self.layout.units)

    @property
    def largest_shard(self) -> int:
        return max(u.shard_numel for u in self.layout.units)

    @property
    def largest_param(self) -> int:
        return max(slot.numel for u in self.layout.units for slot in u.params)


def vocab_size(config: Config) -> int:
    """The vocabulary ``python -m engine train`` would build the model with, without tokenising:
    a token file's own (its sidecar), 256 for bytes, ``data.vocab_size`` for a BPE (an upper
    bound: the trained BPE may come out smaller)."""
    if config.data.source.endswith(TOKEN_SUFFIX):
        return load_tokens(config.data.source)[1]
    return ByteTokenizer.vocab_size if config.data.tokenizer == "bytes" else config.data.vocab_size


def gpt_of(config: Config) -> GPTConfig:
    """The GPT shape ``python -m engine train`` builds for ``config``."""
    with torch.device("meta"):
        return build_model(config, vocab_size(config)).config


def gpt_shape(config: Config, params: float = 0, layers: int | None = None, hidden: int | None = None) -> GPTConfig:
    """The config's model, or the one ``params`` (about that many parameters), ``layers`` and
    ``hidden`` (d_model) describe, with the config's vocabulary and sequence length."""
    if not params and layers is None and hidden is None:
        return gpt_of(config)
    shape: dict[str, Any] = {
        "vocab_size": vocab_size(config),
        "seq_len": config.data.seq_len,
        "tie_embeddings": config.model.tie_embeddings,
    }
    fixed = {key: value for key, value in (("n_layer", layers), ("d_model", hidden)) if value is not None}
    if params:
        return GPTConfig.for_params(params, **shape, **fixed)
    if layers is None or hidden is None:
        raise ConfigError("give --layers and --hidden together, or --params N (with either of them to hold it fixed)")
    heads = next(h for h in range(max(1, hidden // HEAD_DIM), 0, -1) if hidden % h == 0)
    return GPTConfig(n_layer=layers, d_model=hidden, n_head=heads, **shape)


def run_shape(config: Config, world_size: int, gpt: GPTConfig | None = None) -> RunShape:
    """The engine's layout of ``gpt`` (default: the config's model) on ``world_size`` ranks,
    from a model built on the meta device (no memory, any size)."""
    if world_size < 1:
        raise ConfigError(f"world size = {world_size}: must be >= 1 (the number of ranks on this node)")
    gpt = gpt or gpt_of(config)
    with torch.device("meta"):
        model = GPT(gpt)
    units = find_units(model, config.zero.unit_classes)
    layout = build_layout(unit_parameters(model, units), world_size, config.offload.chunk_mb * MIB // FP32)
    return RunShape(gpt, layout, config)


# ---------------------------------------------------------------- the terms, bytes per rank


def construction_transient_bytes(run: RunShape) -> int:
    """The unit being flattened: its fp32 flat and the compute-dtype copy cast from it
    (the same buffer in fp32)."""
    cast = run.itemsize * run.largest_unit if run.itemsize != FP32 else 0
    return FP32 * run.largest_unit + cast


def replicated_param_bytes(run: RunShape) -> int:
    """Stages 1 and 2: every unit's full compute-dtype flat, on every rank."""
    return run.itemsize * run.padded


def param_shard_bytes(run: RunShape) -> int:
    """Stage 3 with parameters in memory (``device`` or ``cpu``): the rank's compute-dtype shards."""
    return run.itemsize * run.shard


def running_units_bytes(run: RunShape) -> int:
    """Stage 3: full units on the device however short the prefetch window. The root stays
    gathered from its forward to the end of backward; a block is gathered while it runs, and
    in backward the next is gathered before the last is released; units under
    ``zero.persistence_threshold`` parameters are never released."""
    zero, units = run.config.zero, run.layout.units
    root = sum(u.padded_numel for u in units if u.name == ROOT_UNIT)
    blocks = [u.padded_numel for u in units if u.name != ROOT_UNIT]
    persistent = sum(u.padded_numel for u in units if u.numel < zero.persistence_threshold and u.name != ROOT_UNIT)
    return run.itemsize * (root + sum(sorted(blocks, reverse=True)[:2]) + persistent)


def prefetch_window_bytes(run: RunShape) -> int:
    """Stage 3: the units gathered ahead of use, within ``zero.prefetch_mb``. The window looks
    ahead in the iteration only, so it is full at the start of backward and empty at its end."""
    blocks = sum(u.padded_numel for u in run.layout.units if u.name != ROOT_UNIT)
    return min(int(run.config.zero.prefetch_mb * MIB), run.itemsize * blocks)


def param_staging_bytes(run: RunShape) -> int:
    """Stage 3, ``offload.param = "nvme"``: the host pool shards are read into, the rank's share
    of the prefetch window plus two of the largest shards (one fetch not foreseen, one write)."""
    return int(run.config.zero.prefetch_mb * MIB) // run.layout.world_size + 2 * run.itemsize * run.largest_shard


def optimizer_state_bytes(run: RunShape) -> int:
    """``device`` and ``cpu`` optimizer tiers: fp32 master, exp_avg and exp_avg_sq of the rank's shards."""
    return ADAM_KINDS * FP32 * run.shard


def optimizer_staging_bytes(run: RunShape) -> int:
    """``nvme`` optimizer tier: its buffer pool, which grows up to ``offload.buffer_mb`` (or
    to all of the rank's state, if that is smaller) and keeps what it allocated."""
    return min(run.config.offload.buffer_mb * MIB, optimizer_state_bytes(run))


def grad_shard_bytes(run: RunShape) -> int:
    """The rank's fp32 gradient shards at their peak, each made when its unit's gradient is first
    reduced and freed once the optimizer has used it. With clipping, loss scaling or accumulation
    every one waits for the step; when one micro-batch's update overlaps backward
    (``engine.zero.update``), each is used as it is reduced, so only those in flight wait."""
    if overlaps_backward(run.config) and run.config.zero.grad_accum_steps == 1:
        return MAX_IN_FLIGHT * FP32 * run.largest_shard
    return FP32 * run.shard


def grad_bucket_bytes(run: RunShape) -> int:
    """fp32 gradient buckets on the device: stage 1 keeps every unit's through the accumulation
    window; stages 2 and 3 one being filled while ``MAX_IN_FLIGHT - 1`` are being reduced."""
    if run.config.zero.stage == 1:
        return FP32 * run.padded
    return MAX_IN_FLIGHT * FP32 * run.largest_unit


def param_grad_bytes(run: RunShape) -> int:
    """Autograd's compute-dtype gradient of the largest parameter, before the engine's hook
    copies it into its bucket and drops it."""
    return run.itemsize * run.largest_param


def activation_bytes(run: RunShape) -> int:
    """Peak activation memory of one micro-batch of the built-in GPT.

    Per token, a block saves for backward 16 x d_model compute-dtype values (LayerNorm inputs
    and outputs, qkv, the attention output, the MLP's 4d input and GELU output, the residual)
    plus fp32 LayerNorm statistics and the attention's log-sum-exp per head; SDPA's fused CPU
    and CUDA kernels never hold the seq x seq scores. The root saves the final LayerNorm's
    input and output and the fp32 log-softmax over the vocabulary. At the peak, the start of
    backward, the fp32 gradients of the log-softmax and the logits exist too; later, inside a
    block's backward, about 10 x d_model of gradients. With activation checkpointing a block
    saves only its input and recomputes its 16 x d_model in its backward.
    """
    gpt, data = run.gpt, run.config.data
    tokens, e, d = data.micro_batch * data.seq_len, run.itemsize, gpt.d_model
    block_saved = 16 * d * e + 4 * FP32 + gpt.n_head * FP32
    root_saved = 2 * d * e + FP32 * gpt.vocab_size
    logit_grads = max(2 * FP32, FP32 + e) * gpt.vocab_size
    block_grads = 10 * d * e
    if run.config.zero.activation_checkpointing:
        saved = gpt.n_layer * d * e + root_saved
        block_grads += block_saved  # the block recomputed for its backward
    else:
        saved = gpt.n_layer * block_saved + root_saved
    return tokens * (saved + max(logit_grads, block_grads))


def heap_retention_bytes(churn: int) -> int:
    """What glibc's heap keeps of ``churn``, the bytes allocated and freed every step."""
    return int(HEAP_RETENTION * churn)


def store_bytes(run: RunShape, plan: Plan) -> int:
    """Disk under ``offload.nvme_path`` for all ranks: the nvme tier's generations of optimizer
    state (two with ``store.mode = "generations"``, one ``"in-place"``), one copy of the
    compute-dtype parameters under ``params`` for the nvme parameter tier (derived data, not
    versioned), and the checkpoints ``[checkpoint]`` keeps (any tier writes those)."""
    state = ADAM_KINDS * FP32 * run.padded
    config = run.config
    generations = (2 if config.store.mode == "generations" else 1) if plan.optimizer == "nvme" else 0
    params = run.itemsize * run.padded if plan.param == "nvme" else 0
    ckpt = config.checkpoint
    kept = ckpt.keep if ckpt.keep else (config.train.steps // ckpt.interval if ckpt.interval else 0)
    return (generations + kept) * state + params


# ---------------------------------------------------------------- phases and the peak


def _on(tier: Tier, nbytes: int) -> Footprint:
    """``nbytes`` in the tier's memory (``nvme`` holds none: its staging is a term of its own)."""
    return {"device": Footprint(device=nbytes), "cpu": Footprint(host=nbytes)}.get(tier, Footprint())


def _total(terms: Iterable[Footprint]) -> Footprint:
    return sum(terms, Footprint())


def _grad_tier(plan: Plan) -> Tier:
    """Gradient shards live beside the optimizer state, in memory."""
    return "device" if plan.optimizer == "device" else "cpu"


def _held_state(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """What the engine builds and keeps for the whole run, by term."""
    terms = {"optimizer state": _on(plan.optimizer, optimizer_state_bytes(run))}
    if plan.optimizer == "nvme":
        terms["optimizer staging"] = Footprint(host=optimizer_staging_bytes(run))
    if plan.stage < 3:
        terms["parameters"] = Footprint(device=replicated_param_bytes(run))
    else:
        terms["parameter shards"] = _on(plan.param, param_shard_bytes(run))
    if plan.param == "nvme":
        terms["parameter staging"] = Footprint(host=param_staging_bytes(run))
    return terms


def _construction_end(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """What ``Engine`` has built when it flattens its last unit: the held state, with the nvme
    tier's pool having staged only one unit's optimizer state at a time so far."""
    built = _held_state(run, plan)
    if plan.optimizer == "nvme":
        built["optimizer staging"] = Footprint(host=max(unit_state_bytes(u) for u in run.layout.units))
    return built


def _backward_start(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """Backward's first moment: every activation saved and the loss's gradients, the units
    gathered ahead, no gradient of the engine's yet."""
    terms = {
        "activations": Footprint(device=activation_bytes(run)),
        "parameter gradient": Footprint(device=param_grad_bytes(run)),
    }
    if plan.stage == 3:
        terms["gathered units"] = Footprint(device=running_units_bytes(run) + prefetch_window_bytes(run))
    return terms


def _backward_end(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """Backward's last moment: activations freed, every gradient reduced into a shard (stages 2
    and 3, buckets still in flight) or kept in its bucket until the step (stage 1, whose step
    then turns bucket after bucket into a shard)."""
    shards = grad_shard_bytes(run) if plan.stage > 1 else FP32 * run.largest_shard
    terms = {
        "gradient shards": _on(_grad_tier(plan), shards),
        "gradient buckets": Footprint(device=grad_bucket_bytes(run)),
        "parameter gradient": Footprint(device=param_grad_bytes(run)),
    }
    if plan.stage == 3:
        terms["gathered units"] = Footprint(device=running_units_bytes(run))
    return terms


def _optimizer_step(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """The step: every gradient shard, no bucket."""
    return {"gradient shards": _on(_grad_tier(plan), grad_shard_bytes(run))}


def _heap_retention(run: RunShape, plan: Plan, device_is_host: bool) -> Footprint:
    """The host heap's share of the unit-sized buffers every step frees and makes again:
    gradient shards and buckets, and at stage 3 the gathered units. Only buffers under
    ``HEAP_BUFFER_LIMIT`` count: glibc maps larger ones on their own and unmaps them when freed."""
    units = run.layout.units
    shards = [FP32 * u.shard_numel for u in units]
    buckets = sorted((FP32 * u.padded_numel for u in units), reverse=True)[:MAX_IN_FLIGHT]
    churn = _on(_grad_tier(plan), _heap_sized(shards)) + Footprint(device=_heap_sized(buckets))
    if plan.stage == 3:
        flats = [run.itemsize * u.padded_numel for u in units]
        gathered = running_units_bytes(run) + prefetch_window_bytes(run)
        churn += Footprint(device=gathered * _heap_sized(flats) // sum(flats))
    return Footprint(host=heap_retention_bytes(churn.rss(device_is_host)))


def _heap_sized(buffers: Iterable[int]) -> int:
    """Bytes of the buffers small enough for glibc to serve from its heap."""
    return sum(b for b in buffers if b < HEAP_BUFFER_LIMIT)


@dataclass(frozen=True)
class PlanEstimate:
    """One plan's predicted memory, per rank unless named ``node``."""

    plan: Plan
    world_size: int
    device_bytes: int
    """Engine state on the device at its peak: parameters, gathered units, gradient buckets,
    state of the ``device`` tiers (what ``zero.device_memory_limit_mb`` limits)."""
    activation_bytes: int
    """Activations at their peak, on the device too but outside the engine's budget."""
    host_bytes: int
    """Host memory of the state at its peak, besides the process baseline (and the device's)."""
    peak_rss_bytes: int
    """Resident set of the rank's process at its peak: the baseline, host state, and on a CPU
    build everything on the "device" too."""
    disk_bytes: int
    """The store under ``offload.nvme_path``, all ranks."""
    peak_phase: str
    """When the peak RSS comes: construction, backward start or end, optimizer step."""
    terms: dict[str, int] = field(default_factory=dict)
    """What is held at the peak of training, by term (device and host bytes together)."""

    @property
    def node_rss_bytes(self) -> int:
        return self.world_size * self.peak_rss_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"node_rss_bytes": self.node_rss_bytes}


def estimate(run: RunShape, plan: Plan, *, baseline_bytes: int, device_is_host: bool | None = None) -> PlanEstimate:
    """Predicted memory of ``plan`` for ``run`` (the stage and tiers in ``run.config`` are replaced).

    ``baseline_bytes`` is the resident set of a process that has loaded torch and the engine
    (``measured_baseline_bytes``); ``device_is_host`` defaults to this machine's answer (True
    on a CPU build)."""
    if device_is_host is None:
        device_is_host = not torch.accelerator.is_available()
    run = dataclasses.replace(run, config=plan.apply(run.config))

    def size(footprint: Footprint) -> int:
        return footprint.rss(device_is_host)

    # The model comes on the meta device; construction materialises it unit by unit, so its
    # high point is at its end, with the last unit being flattened.
    construction = _total(_construction_end(run, plan).values())
    held = _held_state(run, plan) | {"heap retention": _heap_retention(run, plan, device_is_host)}
    moments = {
        "backward start": _backward_start(run, plan),
        "backward end": _backward_end(run, plan),
        "optimizer step": _optimizer_step(run, plan),
    }
    phases = {
        "construction": construction + Footprint(device=construction_transient_bytes(run)),
    } | {name: _total([*held.values(), *terms.values()]) for name, terms in moments.items()}
    peak = max(phases, key=lambda name: size(phases[name]))
    activations = activation_bytes(run)
    state = {name: f - Footprint(device=activations) if name == "backward start" else f for name, f in phases.items()}
    terms = held | moments.get(peak, {})
    return PlanEstimate(
        plan=plan,
        world_size=run.layout.world_size,
        device_bytes=max(f.device for f in state.values()),
        activation_bytes=activations,
        host_bytes=max(f.host for f in phases.values()),
        peak_rss_bytes=baseline_bytes + size(phases[peak]),
        disk_bytes=store_bytes(run, plan),
        peak_phase=peak,
        terms={name: f.device + f.host for name, f in terms.items() if f.device + f.host},
    )


def estimate_plans(
    run: RunShape, *, baseline_bytes: int, device_is_host: bool | None = None, plans: Iterable[Plan] | None = None
) -> list[PlanEstimate]:
    """``estimate`` of every plan (default: ``all_plans()``)."""
    return [
        estimate(run, plan, baseline_bytes=baseline_bytes, device_is_host=device_is_host)
        for plan in (all_plans() if plans is None else plans)
    ]


# ---------------------------------------------------------------- the machine and the choice


_BASELINE_PROBE = """
import psutil, torch
import engine.run.train
from engine.run.models.gpt import GPT, GPTConfig
model = GPT(GPTConfig.preset("tiny"))
x = torch.randint(0, 256, (1, 16))
model(x, x).backward()
print(psutil.Process().memory_info().rss)
"""


@functools.cache
def measured_baseline_bytes() -> int:
    """Resident bytes of a fresh process that has imported torch and the engine and run one tiny
    forward and backward (kernels, thread pools, allocator arenas): what a rank holds before
    any model. Measured in a subprocess, since this process may hold anything; once per process."""
    done = subprocess.run(
        [sys.executable, "-c", _BASELINE_PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring the baseline memory of a torch process failed:\n{done.stderr[-2000:]}")
    return int(done.stdout.split()[-1])


@dataclass(frozen=True)
class Machine:
    """What a plan must fit in on this node."""

    ram_bytes: int
    """Host memory available now (``psutil.virtual_memory().available``)."""
    disk_free_bytes: int
    """Free disk where the store would go."""
    device_bytes: int | None
    """Memory of each rank's device, or the engine's ``zero.device_memory_limit_mb``; None: no
    limit of its own (a CPU build without one, where the device is host memory)."""
    device_is_host: bool

    @classmethod
    def detect(cls, config: Config) -> Machine:
        """This node, for ``config``'s store path and device limit."""
        limit = int(config.zero.device_memory_limit_mb * MIB) or None
        on_accelerator = torch.accelerator.is_available()
        if on_accelerator and limit is None:
            accelerator = torch.accelerator.current_accelerator()
            index = torch.accelerator.current_device_index()
            limit = torch.get_device_module(accelerator).get_device_properties(index).total_memory
        return cls(
            ram_bytes=psutil.virtual_memory().available,
            disk_free_bytes=shutil.disk_usage(existing_ancestor(Path(config.offload.nvme_path))).free,
            device_bytes=limit,
            device_is_host=not on_accelerator,
        )

    def shortfalls(self, est: PlanEstimate, headroom: float = HEADROOM) -> list[str]:
        """What ``est`` lacks to leave ``headroom`` of every resource unused, each with a fix."""
        usable = 1.0 - headroom
        short = []
        if est.node_rss_bytes > usable * self.ram_bytes:
            short.append(
                f"host memory: {est.world_size} rank(s) x {_gib(est.peak_rss_bytes)} GiB peak RSS over "
                f"{_gib(usable * self.ram_bytes)} GiB usable (lower data.micro_batch, set "
                f"zero.activation_checkpointing = true, or free memory)"
            )
        if est.disk_bytes > usable * self.disk_free_bytes:
            short.append(
                f"disk: the store needs {_gib(est.disk_bytes)} GiB, {_gib(usable * self.disk_free_bytes)} GiB usable "
                f'(set store.mode = "in-place" for one generation, keep fewer checkpoint.keep, or move '
                f"offload.nvme_path to a larger disk)"
            )
        # The engine's budget leaves activations out; a real device's memory holds them too.
        device = est.device_bytes + (0 if self.device_is_host else est.activation_bytes)
        if self.device_bytes is not None and device > usable * self.device_bytes:
            short.append(
                f"device: {_gib(device)} GiB per rank, {_gib(usable * self.device_bytes)} GiB usable (raise "
                f"zero.device_memory_limit_mb, use more ranks, or lower data.micro_batch)"
            )
        return short

    def fits(self, est: PlanEstimate, headroom: float = HEADROOM) -> bool:
        """Whether ``est`` leaves ``headroom`` of every resource unused, on all ranks."""
        return not self.shortfalls(est, headroom)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def existing_ancestor(path: Path) -> Path:
    """``path`` or the nearest of its parents that exists (where a new store's bytes would go)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def stage_preference(config: Config, world_size: int) -> tuple[int, ...]:
    """Stages to try for one pair of tiers, cheapest first. Stage 2 reduces each micro-batch's
    gradients as stage 1 reduces the step's, in less memory; stage 1 saves reductions only when
    several micro-batches accumulate over several ranks; stage 3 adds a gather per unit per
    forward and backward."""
    if config.zero.grad_accum_steps > 1 and world_size > 1:
        return (1, 2, 3)
    return (2, 3)


def recommend(
    estimates: Sequence[PlanEstimate], machine: Machine, config: Config, headroom: float = HEADROOM
) -> PlanEstimate | None:
    """The least offload that fits: the first plan in ``TIER_ORDER``, by ``stage_preference``,
    whose estimate ``machine`` holds with ``headroom``; None if none does."""
    for est in by_preference(estimates, config):
        if machine.fits(est, headroom):
            return est
    return None


def by_preference(estimates: Sequence[PlanEstimate], config: Config) -> list[PlanEstimate]:
    """The estimates of the plans ``recommend`` considers, least offload first."""
    by_plan = {e.plan: e for e in estimates}
    world = estimates[0].world_size if estimates else 1
    order = [
        Plan(stage, optimizer, param) for optimizer, param in TIER_ORDER for stage in stage_preference(config, world)
    ]
    return [by_plan[plan] for plan in order if plan in by_plan]


def why_none_fits(estimates: Sequence[PlanEstimate], machine: Machine, config: Config) -> str:
    """Why ``recommend`` found nothing: what the most offloaded plan still lacks."""
    last = by_preference(estimates, config)[-1]
    return f"no plan fits with {HEADROOM:.0%} headroom; even {last.plan} lacks " + "; ".join(machine.shortfalls(last))


# ---------------------------------------------------------------- the report


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def format_table(
    run: RunShape, estimates: Sequence[PlanEstimate], machine: Machine, choice: PlanEstimate | None
) -> str:
    """Every plan's bytes per tier, and the recommendation, as ``python -m engine estimate`` prints them."""
    gpt, world = run.gpt, run.layout.world_size
    lines = [
        (
            f"model: {run.layout.numel / 1e6:.1f}M params ({gpt.n_layer} layers, d_model {gpt.d_model}, "
            f"vocab {gpt.vocab_size}, seq {gpt.seq_len}), {len(run.layout.units)} units, "
            f"{run.config.precision.compute_dtype}, micro-batch {run.config.data.micro_batch}, {world} rank(s)"
        ),
        f"machine: {_gib(machine.ram_bytes)} GiB RAM available, {_gib(machine.disk_free_bytes)} GiB free disk, "
        + (f"{_gib(machine.device_bytes)} GiB per device" if machine.device_bytes else "device memory is host memory"),
        "GiB; device, host and RSS per rank; node RAM for all ranks; disk for the store",
        "",
        (
            f"{'stage':>5}  {'optimizer':<9}  {'param':<6}  {'device':>7}  {'activ.':>7}  {'host':>7}  "
            f"{'peak RSS':>8}  {'node RAM':>8}  {'disk':>7}  fits"
        ),
    ]
    for est in estimates:
        p = est.plan
        mark = " <- recommended" if choice is not None and est.plan == choice.plan else ""
        lines.append(
            f"{p.stage:>5}  {p.optimizer:<9}  {p.param:<6}  {_gib(est.device_bytes):>7}  {_gib(est.activation_bytes):>7}  "
            f"{_gib(est.host_bytes):>7}  {_gib(est.peak_rss_bytes):>8}  {_gib(est.node_rss_bytes):>8}  "
            f"{_gib(est.disk_bytes):>7}  {'yes' if machine.fits(est) else 'no'}{mark}"
        )
    lines.append("")
    if choice is None:
        lines.append(why_none_fits(estimates, machine, run.config))
    else:
        lines.append(
            f"recommended: {choice.plan} (zero.stage = {choice.plan.stage}, offload.optimizer = "
            f'"{choice.plan.optimizer}", offload.param = "{choice.plan.param}"): the least offload that '
            f"fits with {HEADROOM:.0%} headroom"
        )
    return "\n".join(lines)


def report_json(run: RunShape, estimates: Sequence[PlanEstimate], machine: Machine, choice: PlanEstimate | None) -> str:
    """The same as ``format_table``, as JSON."""
    return json.dumps(
        {
            "model": dataclasses.asdict(run.gpt) | {"params": run.layout.numel, "units": len(run.layout.units)},
            "world_size": run.layout.world_size,
            "machine": machine.to_dict(),
            "headroom": HEADROOM,
            "plans": [e.to_dict() | {"fits": machine.fits(e)} for e in estimates],
            "recommended": dataclasses.asdict(choice.plan) if choice else None,
        },
        indent=2,
    )
