"""One training step on each tier plan, against its compute alone and its data movement alone.

    python -m benchmarks.step [--quick] [--plans KEY ...] [--dir PATH]

The model is the one `python -m engine train` trains by default: the config defaults
(the built-in GPT "small", bf16, byte-level Shakespeare, sequences of 128, micro-batches
of 8); `--quick` takes the "tiny" preset so that the run lasts seconds. For each tier
plan (`benchmarks.plans.PLANS`) it measures:

- compute: the same stage with every tier on `device`, so nothing moves (median step), run in
  the same process taking turns with the plan's run (`benchmarks.runs.run_alternating`);
- movement: the bytes the plan's step moves through the store, moved with no compute
  (`benchmarks.traffic`, with the plan's own `[offload]` settings);
- step: the offloaded step itself (median), with the engine's own per-step statistics.

overlap = max(compute, movement) / step: 1 when the step hides the smaller of the two
entirely behind the larger, max / (compute + movement) when it overlaps nothing. Moving
bytes is not free of CPU (system calls, checksums: "movement CPU s", measured), and a
compute that keeps every core busy has no idle core to give it, so "CPU bound s" =
max(movement, compute + movement CPU / cores) is the best step this machine allows, and
"of CPU bound" the step's efficiency against it. The engine's statistics then say where
the rest went: exposed parameter I/O ("param wait"), exposed optimizer I/O ("opt wait":
reads not ready in time, the last writes, fsync and commit), the AdamW update, and
"engine compute": the step less its exposed waits.

A second table splits the CPU the stores' I/O took in the step (the engine's statistics:
`offload.costs`, thread CPU time of the I/O threads) by stage, per GB moved: system calls,
CRC-32C, copies, casts, zeroing; "process" is the CPU of the whole step per GB moved.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.plans import PLANS, TierPlan
from benchmarks.report import Row, bar_chart, base_parser, print_table, save_json, setup_logging
from benchmarks.runs import (
    RunResult,
    Schedule,
    add_schedule_arguments,
    model_layout,
    run_alternating,
    schedule_from,
)
from benchmarks.traffic import Movement, measure_movement
from engine.config import Config
from offload.costs import STAGES

CORES = os.cpu_count() or 1
FULL = Schedule(warmup=2, steps=8)
QUICK = Schedule(warmup=1, steps=2)


@dataclasses.dataclass
class Measurements:
    """Every run of one benchmark, by plan key: each plan's compute-only partner, its offloaded
    run and its data movement alone."""

    computes: dict[str, RunResult]
    runs: dict[str, RunResult]
    movements: dict[str, Movement]


def measure(
    plans: list[TierPlan], sections: dict[str, dict[str, Any]], schedule: Schedule, reps: int, work: Path
) -> Measurements:
    """Each plan's offloaded run alternating with its compute-only partner in one process, then
    its movement, so that the machine's drift hits all three alike; the stores go under ``work``."""
    m = Measurements({}, {}, {})
    for plan in plans:
        baseline = plan.compute_only().config(work / f"{plan.key}-compute", sections)
        config = plan.config(work / plan.key, sections)
        m.computes[plan.key], m.runs[plan.key] = run_alternating([baseline, config], schedule)
        m.movements[plan.key] = measure_movement(work / f"{plan.key}-traffic", model_layout(config), config, plan, reps)
    return m


def plan_row(plan: TierPlan, run: RunResult, compute: RunResult, movement: Movement, threads: int) -> Row:
    """One line of the table: the step against its ideal, and where the engine says it went."""
    step_s, compute_s = run.median("seconds"), compute.median("seconds")
    # A compute on every core gives the I/O's own CPU time no idle core to run on.
    shared_cpu_s = movement.cpu_s / CORES if threads >= CORES else 0.0
    cpu_bound_s = max(movement.seconds, compute_s + shared_cpu_s)
    return {
        "plan": plan.label,
        "step s": step_s,
        "compute s": compute_s,
        "movement s": movement.seconds,
        "overlap": max(compute_s, movement.seconds) / step_s,
        "movement CPU s": movement.cpu_s,
        "CPU bound s": cpu_bound_s,
        "of CPU bound": cpu_bound_s / step_s,
        "param wait s": run.median("param_wait_s"),
        "opt wait s": run.median("optimizer_wait_s"),
        "AdamW s": run.median("optimizer_s"),
        "engine compute s": run.median("compute_s"),
        "engine MB": (run.median("bytes_read") + run.median("bytes_written")) / 1e6,
        "movement MB": (movement.bytes_read + movement.bytes_written) / 1e6,
        "prefetch hit": run.median("prefetch_hit_rate"),
    }


def cost_row(plan: TierPlan, run: RunResult) -> Row:
    """The step's I/O CPU-seconds per GB moved, by stage (median over the timed steps)."""
    moved_gb = run.median("io_bytes") / 1e9
    stages = {stage: run.median_io_cpu(stage) for stage in (*STAGES, "total")}
    return {"plan": plan.label, **stages, "process": run.median("cpu_s") / moved_gb}


def shared_settings(config: Config) -> dict[str, Any]:
    """The config every plan runs with: all of it but the stage and the tiers (each plan's own)."""
    settings = config.to_dict()
    del settings["zero"]["stage"]
    for key in ("optimizer", "param", "nvme_path"):
        del settings["offload"][key]
    return settings


def chart(out: Path, rows: list[Row], model: str, params: int) -> None:
    """Each plan's step against its compute alone, its movement alone and its exposed I/O."""
    bar_chart(
        out / "step.png",
        [row["plan"] for row in rows],
        {
            "step": [row["step s"] for row in rows],
            "compute only": [row["compute s"] for row in rows],
            "movement only": [row["movement s"] for row in rows],
            "exposed I/O": [row["param wait s"] + row["opt wait s"] for row in rows],
        },
        ylabel="seconds per step",
        title=f"One step of GPT {model!r}, {params / 1e6:.2f}M params",
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--plans", nargs="+", choices=list(PLANS), default=list(PLANS), help="tier plans to run (default all)"
    )
    parser.add_argument("--preset", help='GPT preset (default the config\'s, "small"; --quick "tiny")')
    parser.add_argument("--reps", type=int, help="timed data-movement steps, median (default 5, --quick 2)")
    parser.add_argument("--dir", type=Path, default=Path("."), help="directory on the disk for the stores (default .)")
    add_schedule_arguments(parser, FULL, QUICK)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    schedule = schedule_from(args, FULL, QUICK)
    reps = args.reps or (2 if args.quick else 5)
    preset = args.preset or ("tiny" if args.quick else None)
    sections = {"model": {"preset": preset}} if preset else {}
    plans = [PLANS[key] for key in args.plans]

    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-step-", dir=args.dir) as work:
        m = measure(plans, sections, schedule, reps, Path(work))
    rows = [plan_row(p, m.runs[p.key], m.computes[p.key], m.movements[p.key], schedule.threads) for p in plans]

    # Every plan runs the same model and data: describe them from any plan's config.
    config = plans[0].config(args.dir, sections)
    first = m.runs[plans[0].key]
    model, params = config.model.preset, first.params
    print_table(
        f"One step of GPT {model!r} ({params / 1e6:.2f}M params, {first.compute_dtype}, "
        f"{config.data.micro_batch} x {config.data.seq_len} tokens, torch threads {schedule.threads}), "
        f"median of {schedule.steps} steps (movement: of {reps})",
        rows,
    )
    print(
        "compute s: the same stage with every tier on device; movement s: the step's store traffic alone; "
        "overlap: max(compute, movement) / step.\n"
        "CPU bound s: max(movement, compute + movement CPU s / cores), the I/O's CPU taken from a compute on "
        "every core; of CPU bound: that bound / step.\n"
        "param wait s, opt wait s: exposed I/O (the engine's per-step statistics); engine compute s: the step "
        "less its exposed waits; AdamW s: the update (on the step's thread or hidden in backward)."
    )
    costs = [cost_row(p, m.runs[p.key]) for p in plans if m.runs[p.key].median("io_bytes")]
    if costs:
        print()
        print_table("CPU-seconds per GB the stores moved, by stage (median of the steps)", costs)
    chart(args.out, rows, model, params)
    result = {
        "model": {"preset": model, "params": params},
        "config": shared_settings(config),
        "directory": str(args.dir.resolve()),
        "schedule": dataclasses.asdict(schedule),
        "reps": reps,
        "plans": [dataclasses.asdict(plan) for plan in plans],
        "rows": rows,
        "cpu_s_per_gb": costs,
        **dataclasses.asdict(m),
    }
    save_json(args.out, "step", result)
    return result


if __name__ == "__main__":
    main()
