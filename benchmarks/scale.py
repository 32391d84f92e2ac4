"""How a step's time, bytes, memory and disk grow with the model, everything on NVMe.

    python -m benchmarks.scale [--quick] [--sizes M ...] [--plan KEY] [--dir PATH]

Trains the built-in GPT at several sizes (`GPTConfig.for_params`, the engine's other
defaults) with the plan that offloads the most, stage 3 with the optimizer state and
the parameter shards on nvme, and reports per size: the median step, the bytes the
step read and wrote (the engine's per-step statistics), the process's peak resident
memory (the kernel's high-water mark of the whole process; psutil, which has no such
counter, gives the resident memory before the engine for comparison) and the store's
size on disk. Each size runs in a fresh process, so that its peak memory is its own
(`benchmarks.runs.run_isolated`).

With ``--clipping`` it measures instead what gradient clipping costs in memory: each size
runs three times, with clipping (``optim.grad_clip``, the default; on nvme each unit's gradient
shard is spilled to the store during backward, ``offload.grad_spill``), with clipping and the
gradient shards kept in memory until the step (``offload.grad_spill = false``), and without
clipping; the table gives each one's peak RSS and its ratio to the unclipped run's.

    python -m benchmarks.scale --clipping --sizes 100 --plan s2-nvme --seq_len 64 --micro_batch 1

Two linear fits against parameters are printed: of the step time (what each extra
million parameters costs a step; the intercept is the fixed cost) and of the peak
RSS (the host bytes each extra parameter costs: the fp32 masters and moments alone
would be 12, and they are on disk here, so what remains is what the run still holds
per parameter in memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.plans import PLANS, TierPlan
from benchmarks.plots import line_panels
from benchmarks.report import Row, base_parser, print_table, save_json, setup_logging
from benchmarks.runs import RunResult, Schedule, add_schedule_arguments, run_isolated, schedule_from

FULL = Schedule(warmup=1, steps=3)
QUICK = Schedule(warmup=1, steps=2)
FULL_SIZES = (12.5, 25.0, 50.0, 100.0)
QUICK_SIZES = (0.25, 0.5, 1.0, 2.0)
"""Millions of parameters: four sizes spanning 8x."""
DEFAULT_PLAN = "s3-nvme-nvme"


@dataclasses.dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope * params`` by least squares, and how well it fits (R^2)."""

    slope: float
    intercept: float
    r2: float

    @classmethod
    def of(cls, params: list[float], values: list[float]) -> LinearFit:
        """The least-squares line through ``(params[i], values[i])``."""
        x, y = np.asarray(params, dtype=float), np.asarray(values, dtype=float)
        slope, intercept = np.polyfit(x, y, 1)
        residual = float(((y - (slope * x + intercept)) ** 2).sum())
        spread = float(((y - y.mean()) ** 2).sum())
        return cls(float(slope), float(intercept), 1.0 - residual / spread if spread else 1.0)

    def __call__(self, params: float) -> float:
        return self.intercept + self.slope * params


def size_row(run: RunResult) -> Row:
    """One size: what its step cost, and what it held in memory and on disk."""
    moved = run.median("bytes_read") + run.median("bytes_written")
    return {
        "params M": run.params / 1e6,
        "step s": run.median("seconds"),
        "GB moved": moved / 1e9,
        "GB/s": moved / run.median("seconds") / 1e9,
        "peak RSS MB": run.peak_rss_bytes / 1e6,
        "RSS before engine MB": run.rss_before_bytes / 1e6,
        "store MB": run.store_bytes / 1e6,
        "store B/param": run.store_bytes / run.params,
    }


CLIPPING = {
    "clipped, gradients spilled": {},
    "clipped, gradients in memory": {"offload": {"grad_spill": False}},
    "not clipped": {"optim": {"grad_clip": 0.0}},
}
"""The runs ``--clipping`` compares at each size: config sections on top of the plan's."""


def compare_clipping(
    sizes: list[float], plan: TierPlan, schedule: Schedule, work: Path, data: dict[str, int]
) -> list[Row]:
    """Each size run with clipping (spilled and in memory) and without: peak RSS, and its ratio
    to the unclipped run's."""
    rows: list[Row] = []
    for millions in sizes:
        peaks: dict[str, RunResult] = {}
        for name, sections in CLIPPING.items():
            store = work / f"{millions:g}M-{len(peaks)}"
            config = plan.config(store, {"model": {"params": millions * 1e6}, "data": data, **sections})
            peaks[name] = run_isolated(config, schedule)
            shutil.rmtree(store, ignore_errors=True)
        unclipped = peaks["not clipped"].peak_rss_bytes
        for name, run in peaks.items():
            rows.append(
                {
                    "params M": run.params / 1e6,
                    "run": name,
                    "peak RSS MB": run.peak_rss_bytes / 1e6,
                    "x unclipped": run.peak_rss_bytes / unclipped,
                    "step s": run.median("seconds"),
                    "GB moved": (run.median("bytes_read") + run.median("bytes_written")) / 1e9,
                }
            )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, ``sizes`` in millions of parameters and sorted; refuses a fit of fewer than two."""
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        help=f"millions of parameters (default {' '.join(map(str, FULL_SIZES))}, --quick {' '.join(map(str, QUICK_SIZES))})",
    )
    parser.add_argument("--plan", choices=list(PLANS), default=DEFAULT_PLAN, help=f"tier plan (default {DEFAULT_PLAN})")
    parser.add_argument("--dir", type=Path, default=Path("."), help="directory on the disk for the stores (default .)")
    parser.add_argument("--clipping", action="store_true", help="peak RSS with and without gradient clipping")
    parser.add_argument("--seq_len", type=int, help="tokens per sequence (default the config's)")
    parser.add_argument("--micro_batch", type=int, help="sequences per micro-batch (default the config's)")
    add_schedule_arguments(parser, FULL, QUICK)
    args = parser.parse_args(argv)
    args.sizes = sorted(args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES))
    if not args.clipping and len(args.sizes) < 2:
        parser.error("--sizes needs at least two sizes to fit a line")
    return args


def clipping(args: argparse.Namespace, plan: TierPlan, schedule: Schedule, data: dict[str, int]) -> dict[str, Any]:
    """``--clipping``: peak RSS with and without gradient clipping, at each size."""
    with tempfile.TemporaryDirectory(prefix="bench-clip-", dir=args.dir) as work:
        rows = compare_clipping(args.sizes, plan, schedule, Path(work), data)
    print_table(f"Peak RSS with and without clipping, {plan.label}, one process per run", rows)
    result = {
        "plan": dataclasses.asdict(plan),
        "schedule": dataclasses.asdict(schedule),
        "data": data,
        "rows": rows,
    }
    save_json(args.out, "scale-clipping", result)
    return result


def chart(
    out: Path, plan: TierPlan, params: list[float], rows: list[Row], step_fit: LinearFit, rss_fit: LinearFit
) -> None:
    line_panels(
        out / "scale.png",
        params,
        {
            "seconds per step": {
                "step": [row["step s"] for row in rows],
                "linear fit": step_fit,
            },
            "peak RSS, MB": {
                "peak RSS": [row["peak RSS MB"] for row in rows],
                "RSS before engine": [row["RSS before engine MB"] for row in rows],
                "linear fit": lambda p: rss_fit(p) / 1e6,
            },
        },
        xlabel="parameters",
        title=f"Scaling, {plan.label}",
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    setup_logging(args.verbose)
    sizes = args.sizes
    schedule = schedule_from(args, FULL, QUICK)
    plan = PLANS[args.plan]
    data = {key: value for key in ("seq_len", "micro_batch") if (value := getattr(args, key)) is not None}
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.clipping:
        return clipping(args, plan, schedule, data)

    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.dir) as work:
        for millions in sizes:
            store = Path(work) / f"{millions:g}M"
            runs.append(run_isolated(plan.config(store, {"model": {"params": millions * 1e6}, "data": data}), schedule))
            shutil.rmtree(store, ignore_errors=True)  # measured by the run; the next size needs the disk
    rows = [size_row(run) for run in runs]
    params = [float(run.params) for run in runs]
    step_fit = LinearFit.of(params, [row["step s"] for row in rows])
    rss_fit = LinearFit.of(params, [float(run.peak_rss_bytes) for run in runs])

    print_table(
        f"GPT sizes, {plan.label}, median of {schedule.steps} steps each (torch threads {schedule.threads}), "
        f"one process per size",
        rows,
    )
    print(
        f"Linear fit: step s = {step_fit.intercept:.3f} + {step_fit.slope * 1e6:.4f} x (M params), "
        f"R^2 = {step_fit.r2:.3f}, over {params[-1] / params[0]:.1f}x in parameters.\n"
        f"Peak RSS: {rss_fit.slope:.1f} bytes per parameter on top of {rss_fit.intercept / 1e6:.0f} MB, "
        f"R^2 = {rss_fit.r2:.3f}."
    )
    chart(args.out, plan, params, rows, step_fit, rss_fit)
    result = {
        "plan": dataclasses.asdict(plan),
        "sizes_m": sizes,
        "schedule": dataclasses.asdict(schedule),
        "directory": str(args.dir.resolve()),
        "step_fit": dataclasses.asdict(step_fit),
        "rss_fit": dataclasses.asdict(rss_fit),
        "rows": rows,
        "runs": [dataclasses.asdict(run) for run in runs],
    }
    save_json(args.out, "scale", result)
    return result


if __name__ == "__main__":
    main()
