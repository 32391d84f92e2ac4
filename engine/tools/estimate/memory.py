"""The memory model: the engine's life cycle phase by phase (construction, the start and the
end of backward, the optimizer step, and the next forward's start where it runs a deferred
update), what each holds on the device and in host memory, and the peak that decides whether
a plan fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import Tier, spills_gradients
from engine.config_parse import ConfigError
from engine.tiers.sizing import optimizer_buffer_bytes
from engine.tiers.sizing import pinned_bytes as pinned_need
from engine.tiers.store_checks import check_buffer
from engine.tools.estimate.shape import Plan, RunShape, all_plans
from engine.tools.estimate.terms import (
    activation_bytes,
    construction_staging_bytes,
    construction_transient_bytes,
    grad_bucket_bytes,
    grad_dtype,
    grad_shard_bytes,
    heap_retention_bytes,
    norm_scratch_bytes,
    optimizer_staging_bytes,
    optimizer_state_bytes,
    param_grad_bytes,
    param_shard_bytes,
    param_staging_bytes,
    prefetch_window_bytes,
    replicated_param_bytes,
    running_units_bytes,
    spill_staging_bytes,
    step_io_bytes,
    store_bytes,
)
from engine.zero.grads import grad_shard_bytes as unit_grad_shard_bytes

PINNED_RINGS = ("master uploads", "gradient additions")
"""The terms of ``engine.tiers.sizing.pinned_bytes`` that no other term of the estimate holds:
the rings a device apart from the host copies through (the rest are gradient shards and
parameter shards or staging, counted where they are held)."""


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


def _on(tier: Tier, nbytes: int) -> Footprint:
    """``nbytes`` in the tier's memory (``nvme`` holds none: its staging is a term of its own)."""
    return {"device": Footprint(device=nbytes), "cpu": Footprint(host=nbytes)}.get(tier, Footprint())


def _total(terms: Iterable[Footprint]) -> Footprint:
    return sum(terms, Footprint())


def _grad_tier(plan: Plan) -> Tier:
    """Gradient shards live beside the optimizer state, in memory."""
    return "device" if plan.tiers.optimizer_on_device else "cpu"


def _held_state(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """What the engine builds and keeps for the whole run, by term."""
    terms = {"optimizer state": _on(plan.optimizer, optimizer_state_bytes(run))}
    if plan.tiers.optimizer_in_store:
        terms["optimizer staging"] = Footprint(host=optimizer_staging_bytes(run))
    if plan.stage < 3:
        terms["parameters"] = Footprint(device=replicated_param_bytes(run))
    else:
        terms["parameter shards"] = _on(plan.param, param_shard_bytes(run))
    if plan.tiers.params_in_store:
        terms["parameter staging"] = Footprint(host=param_staging_bytes(run))
    if spills_gradients(run.config):
        terms["gradient spill staging"] = Footprint(host=spill_staging_bytes(run))
    if norm_scratch_bytes(run):
        where = "cpu" if spills_gradients(run.config) else _grad_tier(plan)
        terms["gradient norm scratch"] = _on(where, norm_scratch_bytes(run))
    return terms


def _construction_end(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """What ``Engine`` has built when it flattens its last unit: the held state, with the nvme
    tier's pool having staged only the initial masters written behind the build so far."""
    built = _held_state(run, plan)
    built.pop("gradient spill staging", None)  # nothing spilled yet
    built.pop("gradient norm scratch", None)  # no norm taken yet
    if plan.tiers.optimizer_in_store:
        built["optimizer staging"] = Footprint(host=construction_staging_bytes(run))
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
    dtype = grad_dtype(run)
    largest = max(unit_grad_shard_bytes(u, dtype) for u in run.layout.units)
    shards = grad_shard_bytes(run) if plan.stage > 1 else largest
    terms = {
        "gradient shards": _on(_grad_tier(plan), shards),
        "gradient buckets": Footprint(device=grad_bucket_bytes(run)),
        "parameter gradient": Footprint(device=param_grad_bytes(run)),
    }
    if plan.stage == 3:
        terms["gathered units"] = Footprint(device=running_units_bytes(run))
    return terms


def _optimizer_step(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """The step: every gradient shard, no bucket; or, spilled, none (they come back through the
    spill's staging, a held term)."""
    if spills_gradients(run.config):
        return {}
    return {"gradient shards": _on(_grad_tier(plan), grad_shard_bytes(run))}


def _deferred_forward_start(run: RunShape, plan: Plan) -> dict[str, Footprint]:
    """The next forward's first moment where its gathers update the units (``optim.defer_update``)
    from gradient shards held in memory: every shard still waiting, and the units gathered
    ahead; each shard goes as its unit is updated, while the forward's activations grow."""
    if plan.stage != 3 or not run.config.optim.defer_update or spills_gradients(run.config):
        return {}
    return {
        "gradient shards": _on(_grad_tier(plan), grad_shard_bytes(run)),
        "gathered units": Footprint(device=running_units_bytes(run) + prefetch_window_bytes(run)),
    }


def refusal(run: RunShape, plan: Plan) -> str:
    """The engine's own refusal of ``plan`` for ``run`` whatever the machine, or "": the
    config's (say, bf16 masters shared at stage 3 with another compute dtype), or the tier's."""
    try:
        plan.apply(run.config)
    except ConfigError as err:
        return str(err)
    if plan.tiers.optimizer_in_store:
        try:
            check_buffer(run.layout, optimizer_buffer_bytes(run.config.offload, run.layout.units, run.form), run.form)
        except ValueError as err:
            return str(err)
    return ""


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
    pinned_bytes: int
    """Of ``host_bytes``, what the pinned pool holds where the device is apart from the host
    (``offload.pinned_mb = "auto"``; ``engine.tiers.sizing.pinned_bytes``); 0 on a CPU build."""
    step_io_bytes: int
    """Bytes one rank reads plus writes per step: the nvme tiers' state and parameter shards,
    and the spilled gradient shards (``terms.step_io_bytes``)."""
    peak_phase: str
    """When the peak RSS comes: construction, backward start or end, optimizer step."""
    phase_rss_bytes: dict[str, int] = field(default_factory=dict)
    """Each phase's resident bytes over the baseline: what a process that only builds the
    engine (an import, say) should hold is its ``construction``."""
    terms: dict[str, int] = field(default_factory=dict)
    """What is held at the peak of training, by term (device and host bytes together)."""
    refused: str = ""
    """Why the engine would refuse this plan with this config whatever the machine (e.g. an
    ``offload.buffer_mb`` too small for a unit); empty if it would not."""

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
    run = dataclasses.replace(run, config=plan.laid_over(run.config))

    def size(footprint: Footprint) -> int:
        return footprint.rss(device_is_host)

    # The model comes on the meta device; construction materialises it unit by unit, so its
    # high point is at its end, with the last unit being flattened.
    pinned = {} if device_is_host else pinned_need(run.config, run.layout, run.dtype)
    every_phase = {"heap retention": Footprint(host=heap_retention_bytes(run))}
    if pinned:  # the pool's rings, held from the first copy, where a device is apart
        every_phase["copy rings"] = Footprint(host=sum(pinned.get(ring, 0) for ring in PINNED_RINGS))
    construction = _total([*_construction_end(run, plan).values(), *every_phase.values()])
    held = _held_state(run, plan) | every_phase
    moments = {
        "backward start": _backward_start(run, plan),
        "backward end": _backward_end(run, plan),
        "optimizer step": _optimizer_step(run, plan),
    }
    if deferred := _deferred_forward_start(run, plan):
        moments["forward start, update deferred"] = deferred
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
        pinned_bytes=sum(pinned.values()),
        step_io_bytes=step_io_bytes(run, plan),
        peak_phase=peak,
        phase_rss_bytes={name: size(footprint) for name, footprint in phases.items()},
        terms={name: f.device + f.host for name, f in terms.items() if f.device + f.host},
        refused=refusal(run, plan),
    )


def estimate_plans(
    run: RunShape, *, baseline_bytes: int, device_is_host: bool | None = None, plans: Iterable[Plan] | None = None
) -> list[PlanEstimate]:
    """``estimate`` of every plan (default: ``all_plans()``)."""
    return [
        estimate(run, plan, baseline_bytes=baseline_bytes, device_is_host=device_is_host)
        for plan in (all_plans() if plans is None else plans)
    ]
