"""The engine on a CUDA device: host-device copies, each tier plan's step, and the largest model
that trains within a device memory limit; or, with --sanitize, short trainings under PyTorch's
CUDA sanitizer.

    python -m benchmarks.gpu [--quick] [--plans KEY ...] [--limit-mb MB] [--start-params N]
                             [--search-s S] [--dir PATH]
    python -m benchmarks.gpu --sanitize [--sanitize-s S] [--dir PATH]

Without a CUDA device it measures and saves nothing: it prints one line on stderr and exits
with code 2 (``NO_DEVICE_EXIT``), so that a script running every benchmark sees that this one
did not run.

- copies: GB/s of host-to-device and device-to-host copies of a few sizes, by three paths
  (``COPY_PATHS``): the engine's own, `Device.copy` between a device tensor and a buffer of
  `Device.empty_host` (cut from the engine's pinned pool), queued on the engine's copy stream
  and waited for by its event; and torch's ``copy_(non_blocking=True)`` on the current stream
  from a `torch.empty(..., pin_memory=True)` buffer and from pageable memory, waited for by
  the stream. The clock stops once the copy is done; the paths take turns
  (`benchmarks.bandwidth.interleaved_medians`).
- steps: `benchmarks.step`'s measurement of every tier plan, here on the device: the offloaded
  step against the same stage with every tier on the device and against its store traffic
  alone (on the host side: the copies to the device are the first table's), overlap =
  max(compute, movement) / step; and the most device memory the engine held in a step, by its
  own count.
- largest model: stage 3 with the optimizer state and the parameter shards on nvme, under
  ``zero.device_memory_limit_mb = --limit-mb``, for models doubling from --start-params, each
  built and trained one step in a fresh process (`benchmarks.runs.run_isolated`), until one
  fails (the engine refuses a unit that cannot fit the limit; the child's error is printed
  above the tables) or the next, taking about twice as long, would end after --search-s. Per
  size: the engine's device high-water mark against the limit, and the allocator's peak
  (`torch.cuda.max_memory_allocated`), which also holds the activations and the library
  workspaces that the limit leaves out.
- --sanitize: `benchmarks.gpu_sanitize`'s trainings, each in a child process under the
  sanitizer; it prints any race the sanitizer reports, saves each training's verdict and
  report (``gpu-sanitize.json``) and exits with code 1 unless every training is clean. It
  measures nothing else.

--quick steps two plans (``QUICK_PLANS``), not all four, and searches under 8 MiB (three sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_sanitize, step
from benchmarks.bandwidth import interleaved_medians
from benchmarks.plans import PLANS, TierPlan
from benchmarks.report import Row, bar_chart, base_parser, print_table, save_json, setup_logging
from benchmarks.runs import RunResult, Schedule, add_schedule_arguments, run_isolated, schedule_from
from engine.runtime.detect import detect_device
from engine.runtime.device import Device
from engine.runtime.sizes import MIB

NO_DEVICE_EXIT = 2
SEARCH_PLAN = PLANS["s3-nvme-nvme"]
"""The plan that offloads the most, so the largest model is bounded by its units alone."""
DIRECTIONS = ("to device", "to host")
SANITIZE_FAILED_EXIT = 1


def pinned_for(device: Device, nbytes: int) -> Device:
    """``device`` with a pinned pool of ``nbytes`` of its own (the engine's slab, sized to one buffer)."""
    device.bound_pinned(nbytes)
    return device


def engine_copy(device: Device, dst: torch.Tensor, src: torch.Tensor) -> None:
    """One copy as the engine makes it: on its copy stream, waited for by the event it returns."""
    device.copy(dst, src).synchronize()


def torch_copy(device: Device, dst: torch.Tensor, src: torch.Tensor) -> None:
    """One copy as plain torch makes it: ``copy_`` on the current stream, waited for by the stream."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream(device.device).synchronize()


@dataclasses.dataclass(frozen=True)
class CopyPath:
    """A way to copy between host and device: the host buffer it uses, and one copy waited for."""

    host: Callable[[Device, int], torch.Tensor]
    copy: Callable[[Device, torch.Tensor, torch.Tensor], None]


COPY_PATHS = {
    "engine": CopyPath(lambda device, nbytes: pinned_for(device, nbytes).empty_host(nbytes, torch.uint8), engine_copy),
    "torch pinned": CopyPath(lambda _, nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch_copy),
    "torch pageable": CopyPath(lambda _, nbytes: torch.empty(nbytes, dtype=torch.uint8), torch_copy),
}
"""The copy paths timed, by name."""
QUICK_PLANS = ("s2-cpu", "s3-nvme-nvme")
"""The plans --quick steps: the least and the most data moved per step."""


@dataclasses.dataclass(frozen=True)
class Extent:
    """How much each section measures: --quick takes the small one, and each option replaces its field."""

    reps: int
    """Timed repetitions of each plan's data movement (median)."""
    copy_reps: int
    """Timed repetitions of each copy (median): a copy takes milliseconds, so more of them."""
    copy_mib: tuple[int, ...]
    limit_mb: float
    start_params: float
    search_s: float


# A running stage 3 unit needs about 10 bytes of the limit per parameter (its bf16 parameters and
# two fp32 gradient buckets): 256 MiB refuses the 800M model of `GPTConfig.for_params` (blocks of
# 31M parameters), whose store still fits a small disk, and 8 MiB refuses the 4M one.
FULL = Extent(reps=5, copy_reps=20, copy_mib=(1, 16, 256), limit_mb=256, start_params=25e6, search_s=600)
QUICK = Extent(reps=2, copy_reps=10, copy_mib=(1, 64), limit_mb=8, start_params=1e6, search_s=60)


@dataclasses.dataclass
class Search:
    """The largest-model search: one row per size tried, the largest that trained, why it stopped."""

    rows: list[Row]
    largest_params: int
    """Parameters of the largest model that trained its step; 0 when none did."""
    stopped: str


def copy_rows(device: Device, sizes_mib: tuple[int, ...], reps: int) -> list[Row]:
    """GB/s of one copy each way between a device buffer and the host buffer of each path, per size."""
    rows: list[Row] = []
    for mib in sizes_mib:
        nbytes = mib * MIB
        on_device = torch.ones(nbytes, dtype=torch.uint8, device=device.device)
        # Filled before timing: a page's first touch costs more than its copy.
        hosts = {name: path.host(device, nbytes).fill_(1) for name, path in COPY_PATHS.items()}
        copies = {}
        for name, host in hosts.items():
            copy = COPY_PATHS[name].copy
            copies[name, "to device"] = functools.partial(copy, device, on_device, host)
            copies[name, "to host"] = functools.partial(copy, device, host, on_device)
        seconds = interleaved_medians(copies, reps)
        for name, host in hosts.items():
            row: Row = {"path": name, "MiB": mib, "pinned": host.is_pinned()}
            rows.append(row | {f"{way} GB/s": nbytes / seconds[name, way] / 1e9 for way in DIRECTIONS})
    return rows


def engine_device_bytes(run: RunResult) -> int:
    """The most device memory the engine held in any timed step, by its own count."""
    return max(int(stats["device_high_water"]) for stats in run.steps)


def plan_rows(plans: list[TierPlan], m: step.Measurements, threads: int) -> list[Row]:
    """`benchmarks.step`'s row of each plan, with the engine's device high-water mark."""
    return [
        step.plan_row(plan, m.runs[plan.key], m.computes[plan.key], m.movements[plan.key], threads)
        | {"engine device MiB": engine_device_bytes(m.runs[plan.key]) / MIB}
        for plan in plans
    ]


def size_row(run: RunResult, limit_mb: float) -> Row:
    """One size of the search: its step, and its device memory against the limit."""
    return {
        "params M": run.params / 1e6,
        "step s": run.median("seconds"),
        "limit MiB": limit_mb,
        "engine device MiB": engine_device_bytes(run) / MIB,
        "device peak MiB": run.device_peak_bytes / MIB,
        "peak RSS MiB": run.peak_rss_bytes / MIB,
        "store MB": run.store_bytes / 1e6,
    }


def largest_model(limit_mb: float, start_params: float, budget_s: float, threads: int, work: Path) -> Search:
    """Models doubling from ``start_params`` at `SEARCH_PLAN` under ``limit_mb``, one step each in
    a fresh process, until one fails or the next would end after ``budget_s`` seconds."""
    schedule = Schedule(warmup=0, steps=1, threads=threads)
    rows: list[Row] = []
    largest, params, last_s, started = 0, start_params, 0.0, time.monotonic()
    while True:
        # A model twice as large takes about twice as long to build into the store and to step.
        if rows and time.monotonic() - started + 2 * last_s > budget_s:
            return Search(rows, largest, f"{params / 1e6:g}M params would end after --search-s {budget_s:g}")
        store = work / f"{params:g}"
        config = SEARCH_PLAN.config(store, {"model": {"params": params}, "zero": {"device_memory_limit_mb": limit_mb}})
        begun = time.monotonic()
        try:
            run = run_isolated(config, schedule)
        except RuntimeError as err:
            return Search(rows, largest, str(err))
        finally:
            shutil.rmtree(store, ignore_errors=True)  # measured by the run; the next size needs the disk
        last_s = time.monotonic() - begun
        rows.append(size_row(run, limit_mb))
        largest, params = run.params, 2 * params


def extent_from(args: argparse.Namespace) -> Extent:
    """The extent the parsed arguments ask for."""
    default = QUICK if args.quick else FULL
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Extent) if getattr(args, f.name) is not None}
    if "copy_mib" in given:
        given["copy_mib"] = tuple(given["copy_mib"])
    return dataclasses.replace(default, **given)


def add_extent_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that replace a field of the ``Extent``."""
    parser.add_argument(
        "--reps", type=int, help=f"timed data movements, median (default {FULL.reps}, --quick {QUICK.reps})"
    )
    parser.add_argument(
        "--copy-reps", type=int, help=f"timed copies, median (default {FULL.copy_reps}, --quick {QUICK.copy_reps})"
    )
    parser.add_argument(
        "--copy-mib",
        type=int,
        nargs="+",
        help=f"copy sizes, MiB (default {' '.join(map(str, FULL.copy_mib))}, "
        f"--quick {' '.join(map(str, QUICK.copy_mib))})",
    )
    parser.add_argument(
        "--limit-mb",
        type=float,
        help=f"zero.device_memory_limit_mb of the search (default {FULL.limit_mb:g}, --quick {QUICK.limit_mb:g})",
    )
    parser.add_argument(
        "--start-params",
        type=float,
        help=f"the search's first size (default {FULL.start_params:g}, --quick {QUICK.start_params:g})",
    )
    parser.add_argument(
        "--search-s",
        type=float,
        help=f"seconds the search may take (default {FULL.search_s:g}, --quick {QUICK.search_s:g})",
    )


SANITIZE_S = 75.0
"""Default seconds each sanitized training may take: the trainings run at once, and .ci/gpu
gives the whole part 90."""


def build_parser() -> argparse.ArgumentParser:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--plans",
        nargs="+",
        choices=list(PLANS),
        help=f"tier plans to step (default all; --quick {' '.join(QUICK_PLANS)})",
    )
    parser.add_argument("--preset", help='GPT preset of the steps (default the config\'s, "small"; --quick "tiny")')
    add_extent_arguments(parser)
    parser.add_argument("--dir", type=Path, default=Path("."), help="directory on the disk for the stores (default .)")
    parser.add_argument(
        "--sanitize",
        action="store_true",
        help="instead of measuring, run short trainings under PyTorch's CUDA sanitizer; exit 1 unless all are clean",
    )
    parser.add_argument(
        "--sanitize-s",
        type=float,
        default=SANITIZE_S,
        help=f"seconds each sanitized training may take ({SANITIZE_S:g})",
    )
    add_schedule_arguments(parser, step.FULL, step.QUICK)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; exits, saying why, where there is no CUDA device to measure."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(
            NO_DEVICE_EXIT,
            f"benchmarks.gpu: no CUDA device (torch.cuda.is_available() is False, torch {torch.__version__}): "
            f"nothing measured; it needs an NVIDIA GPU and the CUDA build of torch\n",
        )
    if args.plans is None:
        args.plans = list(QUICK_PLANS if args.quick else PLANS)
    return args


def print_report(
    name: str, copies: list[Row], steps: list[Row], search: Search, extent: Extent, title: str, schedule_steps: int
) -> None:
    """The copies', the steps' and the search's tables, on device ``name``."""
    print_table(f"Copies between {name} and host memory, median of {extent.copy_reps}, each waited for", copies)
    print("engine: Device.copy from and into Device.empty_host; torch: copy_(non_blocking=True) on the current stream")
    print_table(f"{title} on {name}, median of {schedule_steps} steps (movement: of {extent.reps})", steps)
    print(
        "columns as in python -m benchmarks.step; engine device MiB: the most the engine held in a step, by its count"
    )
    print_table(
        f"{SEARCH_PLAN.label}, zero.device_memory_limit_mb = {extent.limit_mb:g}: one step per size, a process each",
        search.rows,
    )
    print(
        f"largest: {search.largest_params / 1e6:.1f}M params trained a step within {extent.limit_mb:g} MiB "
        f"(stopped: {search.stopped}); device peak MiB also holds the activations, outside the limit"
    )


def device_record(device: Device) -> dict[str, Any]:
    """The CUDA device, for a record."""
    return {
        "name": torch.cuda.get_device_name(device.device),
        "memory_bytes": torch.cuda.get_device_properties(device.device).total_memory,
        "cuda": torch.version.cuda,
    }


def sanitize_main(args: argparse.Namespace) -> dict[str, Any]:
    """``--sanitize``: the trainings under the sanitizer, their record; exits with code 1 unless all are clean."""
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sanitize-", dir=args.dir) as work:
        runs = gpu_sanitize.sanitize(Path(work), args.sanitize_s)
    gpu_sanitize.print_sanitized(runs)
    result = {
        "device": device_record(detect_device()),
        "clean": all(run.clean for run in runs),
        "trainings": [dataclasses.asdict(run) | {"verdict": run.verdict()} for run in runs],
    }
    save_json(args.out, "gpu-sanitize", result)
    if not result["clean"]:
        raise SystemExit(SANITIZE_FAILED_EXIT)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    setup_logging(args.verbose)
    if args.sanitize:
        return sanitize_main(args)
    extent, schedule = extent_from(args), schedule_from(args, step.FULL, step.QUICK)
    preset = args.preset or ("tiny" if args.quick else None)
    sections = {"model": {"preset": preset}} if preset else {}
    plans = [PLANS[key] for key in args.plans]
    device = detect_device()

    copies = copy_rows(device, extent.copy_mib, extent.copy_reps)
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=args.dir) as work:
        m = step.measure(plans, sections, schedule, extent.reps, Path(work))
        search = largest_model(extent.limit_mb, extent.start_params, extent.search_s, schedule.threads, Path(work))
    steps = plan_rows(plans, m, schedule.threads)

    name = torch.cuda.get_device_name(device.device)
    config = plans[0].config(args.dir, sections)
    first = m.runs[plans[0].key]
    params = first.params
    title = f"One step of GPT {config.model.preset!r} ({params / 1e6:.2f}M params, {first.compute_dtype})"
    print_report(name, copies, steps, search, extent, title, schedule.steps)
    bar_chart(
        args.out / "gpu-copies.png",
        [f"{mib} MiB" for mib in extent.copy_mib],
        {
            f"{path}, {way}": [row[f"{way} GB/s"] for row in copies if row["path"] == path]
            for path in COPY_PATHS
            for way in DIRECTIONS
        },
        ylabel="GB/s",
        title=f"Host-device copies, {name}",
    )
    result = {
        "device": device_record(device),
        "extent": dataclasses.asdict(extent),
        "schedule": dataclasses.asdict(schedule),
        "model": {"preset": config.model.preset, "params": params},
        "directory": str(args.dir.resolve()),
        "copies": copies,
        "plans": [dataclasses.asdict(plan) for plan in plans],
        "steps": steps,
        "search": dataclasses.asdict(search),
        **dataclasses.asdict(m),
    }
    save_json(args.out, "gpu", result)
    return result


if __name__ == "__main__":
    main()
