"""Where each copy stream idles within a step, on the simulated asynchronous device.

    python -m benchmarks.copy_timeline [--quick] [--plan KEY] [--gbps B] [--preset P] [--defer-update]

`benchmarks.copies` gives each plan's overlap; this says where the rest of the step went. One
stage-3 plan runs on the simulated device (`engine.runtime.sim_device`) at `--gbps`, and every
forward, backward and `step()` of the timed steps is timed on the training thread and laid
against the busy spans of the two copy streams (up: to the device; down: to the host). For each
phase: its seconds (median over the steps), and the seconds within it that the up stream, the
down stream and both at once sat idle. Time with both idle is what no copy filled: a step bound
by its copies takes them plus that.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.copies import STAGE3, device_spec
from benchmarks.optimizer import threads_restored
from benchmarks.report import Row, base_parser, print_table, save_json, setup_logging
from benchmarks.runs import Schedule, TrainingRun, add_schedule_arguments, schedule_from, simulated_device
from engine.runtime.sim_device import DIRECTIONS, SimDevice

FULL = Schedule(warmup=2, steps=6)
QUICK = Schedule(warmup=1, steps=2)
PHASES = ("forward", "backward", "step")
STREAMS = {"up": (DIRECTIONS[True],), "down": (DIRECTIONS[False],), "both": tuple(DIRECTIONS.values())}
"""Which copy streams must be idle for a moment to count as idle for each column."""

Span = tuple[float, float]


def idle_s(busy: list[Span], start: float, end: float) -> float:
    """Seconds of ``[start, end)`` that no span of ``busy`` covers."""
    covered, reach = 0.0, start
    for first, last in sorted(busy):
        first, last = max(first, reach), min(last, end)
        if last > first:
            covered += last - first
            reach = last
    return (end - start) - covered


def timed_step(run: TrainingRun) -> list[tuple[str, Span]]:
    """One optimizer step, each call on the training thread with its phase and its span."""
    engine, calls = run.engine, []

    def timed(phase: str, call, *args):
        start = time.perf_counter()
        result = call(*args)
        calls.append((phase, (start, time.perf_counter())))
        return result

    for _ in range(engine.config.zero.grad_accum_steps):
        loss = timed("forward", engine, *run.batches.next())
        timed("backward", engine.backward, loss)
        timed("step", engine.step)
    return calls


def phase_rows(steps: list[list[tuple[str, Span]]], busy: list[tuple[str, float, float]]) -> list[Row]:
    """Each phase's seconds and its idle seconds per stream, median over the steps, and the step's."""
    spans = {name: [(s, e) for d, s, e in busy if d in directions] for name, directions in STREAMS.items()}

    def measured(calls: list[tuple[str, Span]]) -> dict[str, float]:
        row = {"s": sum(end - start for _, (start, end) in calls)}
        for name in STREAMS:  # "both": idle where the two streams' spans together leave a gap
            row[f"{name} idle s"] = sum(idle_s(spans[name], start, end) for _, (start, end) in calls)
        return row

    rows = []
    for phase in (*PHASES, "whole step"):
        per_step = [
            measured(calls if phase == "whole step" else [c for c in calls if c[0] == phase]) for calls in steps
        ]
        rows.append({"phase": phase} | {key: statistics.median(m[key] for m in per_step) for key in per_step[0]})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=list(STAGE3), default="s3-nvme-nvme", help="stage-3 tier plan")
    parser.add_argument("--preset", help='GPT preset (default the config\'s, "small"; --quick "tiny")')
    parser.add_argument("--gbps", type=float, default=0.027, help="copy bandwidth each way, GB/s (default 0.027)")
    parser.add_argument("--defer-update", action="store_true", help="optim.defer_update")
    add_schedule_arguments(parser, FULL, QUICK)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    schedule = schedule_from(args, FULL, QUICK)
    preset = args.preset or ("tiny" if args.quick else None)
    sections: dict[str, dict[str, Any]] = {"model": {"preset": preset}} if preset else {}
    if args.defer_update:
        sections["optim"] = {"defer_update": True}
    with tempfile.TemporaryDirectory(prefix="bench-copy-timeline-") as work, threads_restored():
        torch.set_num_threads(schedule.threads)
        with simulated_device(device_spec(args.gbps, sync=False)):
            run = TrainingRun(
                STAGE3[args.plan].config(Path(work) / "store", sections), schedule.warmup + schedule.steps
            )
        device, dtype = run.engine.device, run.engine.config.precision.compute_dtype
        assert isinstance(device, SimDevice)
        try:
            for _ in range(schedule.warmup):
                run.step()
            device.take_counts()  # the warm-up's copies
            steps = [timed_step(run) for _ in range(schedule.steps)]
            device.synchronize()
            busy = device.take_counts().busy
        finally:
            run.engine.close()
    rows = phase_rows(steps, busy)
    title = f"{STAGE3[args.plan].label} at {args.gbps:g} GB/s, compute {dtype}, median of {schedule.steps} steps"
    print_table(title, rows)
    print("idle s: time within the phase that the stream(s) copied nothing; both idle: no copy ran at all.")
    result = {
        "plan": args.plan,
        "gbps": args.gbps,
        "defer_update": args.defer_update,
        "compute_dtype": dtype,
        "rows": rows,
    }
    save_json(args.out, "copy_timeline", result)
    return result


if __name__ == "__main__":
    main()
