"""The estimate as ``python -m engine estimate`` prints it: a table of every plan, or JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from engine.tools.estimate.machine import HEADROOM, Machine, gib, why_none_fits
from engine.tools.estimate.memory import PlanEstimate
from engine.tools.estimate.shape import RunShape
from engine.tools.estimate.terms import optimizer_state_bytes


def format_table(
    run: RunShape, estimates: Sequence[PlanEstimate], machine: Machine, choice: PlanEstimate | None
) -> str:
    """Every plan's bytes per tier, and the recommendation, as ``python -m engine estimate`` prints them."""
    shape, world = run.model, run.layout.world_size
    frozen = f" trained and {run.layout.frozen_numel / 1e6:.1f}M frozen" if run.layout.frozen else ""
    lines = [
        (
            f"model: {shape.name}, {run.layout.numel / 1e6:.1f}M params{frozen} ({shape.n_layer} layers, d_model "
            f"{shape.d_model}, vocab {shape.vocab_size}, seq {shape.seq_len}), {len(run.layout.units)} units, "
            f"{run.config.precision.compute_dtype}, micro-batch {run.config.data.micro_batch}, {world} rank(s)"
        ),
        f"machine: {gib(machine.ram_bytes)} GiB RAM available, {gib(machine.disk_free_bytes)} GiB free disk, "
        + (f"{gib(machine.device_bytes)} GiB per device" if machine.device_bytes else "device memory is host memory"),
        run.io,
        state_line(run),
        "GiB; device, host (pinned: of it, the copies' pool, offload.pinned_mb) and RSS per rank; node RAM for all "
        "ranks; disk for the store; I/O read plus written per step and rank (state and parameters on nvme, spilled "
        "gradients)",
        "",
        (
            f"{'stage':>5}  {'optimizer':<9}  {'param':<6}  {'device':>7}  {'activ.':>7}  {'host':>7}  "
            f"{'pinned':>7}  {'peak RSS':>8}  {'node RAM':>8}  {'disk':>7}  {'I/O':>7}  fits"
        ),
    ]
    for est in estimates:
        p = est.plan
        mark = " <- recommended" if choice is not None and est.plan == choice.plan else ""
        lines.append(
            f"{p.stage:>5}  {p.optimizer:<9}  {p.param:<6}  {gib(est.device_bytes):>7}  {gib(est.activation_bytes):>7}  "
            f"{gib(est.host_bytes):>7}  {gib(est.pinned_bytes):>7}  {gib(est.peak_rss_bytes):>8}  "
            f"{gib(est.node_rss_bytes):>8}  "
            f"{gib(est.disk_bytes):>7}  {gib(est.step_io_bytes):>7}  {'yes' if machine.fits(est) else 'no'}{mark}"
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


def state_line(run: RunShape) -> str:
    """The optimizer state's form, its bytes per parameter, and what the ``nvme`` tier moves each step."""
    moved, form = optimizer_state_bytes(run), run.form
    return (
        f"optimizer state: optim.state_dtype = {form.name!r}, master_dtype = {form.master!r}, "
        f"{form.bytes_per_param:g} B/param (master and two moments); on the nvme tier each step reads "
        f"{gib(moved)} GiB and writes {gib(moved)} GiB per rank"
    )


def report_json(run: RunShape, estimates: Sequence[PlanEstimate], machine: Machine, choice: PlanEstimate | None) -> str:
    """The same as ``format_table``, as JSON."""
    return json.dumps(
        {
            "model": dataclasses.asdict(run.model)
            | {
                "params": run.layout.numel,
                "frozen_params": run.layout.frozen_numel,
                "units": len(run.layout.units),
                "frozen_units": len(run.layout.frozen),
            },
            "world_size": run.layout.world_size,
            "machine": machine.to_dict(),
            "io": run.io,
            "optimizer_state": {
                "state_dtype": run.form.name,
                "master_dtype": run.form.master,
                "bytes_per_param": run.form.bytes_per_param,
                "nvme_bytes_per_step": {"read": optimizer_state_bytes(run), "written": optimizer_state_bytes(run)},
            },
            "headroom": HEADROOM,
            "plans": [e.to_dict() | {"fits": machine.fits(e), "bytes_per_param": per_param(run, e)} for e in estimates],
            "recommended": dataclasses.asdict(choice.plan) if choice else None,
        },
        indent=2,
    )


def per_param(run: RunShape, est: PlanEstimate) -> dict[str, float]:
    """A plan's disk (all ranks) and step I/O (all ranks' reads plus writes) per trained parameter."""
    params = run.layout.numel
    return {"stored": est.disk_bytes / params, "moved": est.step_io_bytes * run.layout.world_size / params}
