"""Host<->device copies overlapped with compute, measured on the simulated asynchronous device.

    python -m benchmarks.copies [--quick] [--gbps B] [--plans KEY ...] [--defer-update]

Without a GPU the copies an accelerator would make are run by `engine.runtime.sim_device`: each
lands later on the copy stream's own thread, at `--gbps` (default: a quarter of the rate
at which the plan computes, so that copies take a real share of the step). For each stage-3
tier plan, three engines take turns in one process (`benchmarks.runs.run_alternating`):

- no copies: the plan on the CPU itself, where a copy costs a memcpy (the step's compute and
  its store I/O);
- async: the plan on the simulated device, copies on the copy stream guarded by events;
- sync: the same device with every copy completed before `copy` returns (the engine as it
  would be without a copy stream).

copy s = the step's bytes copied / the copy bandwidth; bound s = max(no copies, copy s);
overlap = bound / async step, 1 when the copies hide entirely behind the rest of the step;
and async / sync, below 1 when the copy stream pays off.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.plans import PLANS, TierPlan
from benchmarks.report import Row, base_parser, print_table, save_json, setup_logging
from benchmarks.runs import RunResult, Schedule, add_schedule_arguments, run_alternating, schedule_from

FULL = Schedule(warmup=2, steps=8)
QUICK = Schedule(warmup=1, steps=3)
STAGE3 = {key: plan for key, plan in PLANS.items() if plan.stage == 3} | {
    "s3-cpu-cpu": TierPlan("s3-cpu-cpu", 3, "cpu", "cpu")
}
"""The stage-3 plans of the step benchmarks, and parameters and optimizer both in host memory (the
copy stream's own case: no disk in the step)."""


def device_spec(gbps: float, sync: bool) -> str:
    return f"seed=0,delay_ms=0,gbps={gbps:g}" + (",sync=1" if sync else "")


def plan_row(plan: TierPlan, plain: RunResult, async_run: RunResult, sync_run: RunResult, gbps: float) -> Row:
    """One line of the table: the overlapped step against its bound and the synchronous step."""
    step_s, sync_s, plain_s = async_run.median("seconds"), sync_run.median("seconds"), plain.median("seconds")
    copy_s = async_run.median("bytes_copied") / (gbps * 1e9)
    bound_s = max(plain_s, copy_s)
    return {
        "plan": plan.label,
        "no copies s": plain_s,
        "copy MB": async_run.median("bytes_copied") / 1e6,
        "copy s": copy_s,
        "async s": step_s,
        "sync s": sync_s,
        "overlap": bound_s / step_s,
        "async / sync": step_s / sync_s,
    }


def measure(plan: TierPlan, sections: dict[str, Any], schedule: Schedule, gbps: float, work: Path) -> list[RunResult]:
    """The plan with no copies, with copies overlapped, and with copies synchronous, taking turns."""
    configs = [plan.config(work / f"{plan.key}-{name}", sections) for name in ("plain", "async", "sync")]
    return run_alternating(configs, schedule, [None, device_spec(gbps, sync=False), device_spec(gbps, sync=True)])


def copy_rate(plan: TierPlan, sections: dict[str, Any], schedule: Schedule, work: Path) -> float:
    """GB/s at which copies take a quarter of the plan's step on the CPU: bytes copied per
    step over four times the step (the issue's "copies at 1/4 of compute speed")."""
    (plain,) = run_alternating([plan.config(work / f"{plan.key}-probe", sections)], schedule)
    return plain.median("bytes_copied") / (4 * plain.median("seconds")) / 1e9


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--plans", nargs="+", choices=list(STAGE3), default=list(STAGE3), help="stage-3 tier plans (default all)"
    )
    parser.add_argument("--preset", help='GPT preset (default the config\'s, "small"; --quick "tiny")')
    parser.add_argument("--gbps", type=float, help="copy bandwidth, GB/s (default: a quarter of each plan's rate)")
    parser.add_argument(
        "--defer-update",
        action="store_true",
        help="optim.defer_update: each unit updated in the next forward, just before it runs",
    )
    add_schedule_arguments(parser, FULL, QUICK)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    schedule = schedule_from(args, FULL, QUICK)
    preset = args.preset or ("tiny" if args.quick else None)
    sections = {"model": {"preset": preset}} if preset else {}
    if args.defer_update:
        sections["optim"] = {"defer_update": True}
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-copies-") as work:
        for key in args.plans:
            plan = STAGE3[key]
            gbps = args.gbps or copy_rate(plan, sections, schedule, Path(work))
            plain, async_run, sync_run = measure(plan, sections, schedule, gbps, Path(work))
            rows.append(plan_row(plan, plain, async_run, sync_run, gbps) | {"GB/s": gbps})
            runs[key] = {"plain": plain, "async": async_run, "sync": sync_run}
    dtypes = "/".join(sorted({run.compute_dtype for r in runs.values() for run in r.values()}))
    print_table(f"Stage 3 on the simulated device, compute {dtypes}, median of {schedule.steps} steps", rows)
    print(
        "no copies s: the plan on the CPU; copy s: bytes copied / GB/s; overlap: max(no copies, copy) / async step; "
        "async / sync: the copy stream's step against copies completed in place."
    )
    result = {
        "schedule": dataclasses.asdict(schedule),
        "defer_update": args.defer_update,
        "rows": rows,
        "runs": {key: {name: dataclasses.asdict(run) for name, run in r.items()} for key, r in runs.items()},
    }
    save_json(args.out, "copies", result)
    return result


if __name__ == "__main__":
    main()
