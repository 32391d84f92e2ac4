"""The headline: train a model whose training state is larger than this machine's RAM, stop
it mid-run, resume it from the store, and finish.

    python -m benchmarks.giant [--params 3e9] [--steps 3] [--mode in-place|generations]
                               [--store PATH] [--quick]

The run is ``python -m engine train`` itself (a subprocess, as a user runs it): the built-in
GPT at ``--params``, built on the ``meta`` device and materialised unit by unit into the
store (a unit per ``nn.Linear``, so that one unit's optimizer state fits the staging buffer), stage 3 with the parameter shards, masters and AdamW moments on nvme. By default no clipping, so
that each unit's gradient shard is consumed by its update as soon as it is reduced (the
gradients never exist for the whole model at once); with ``--grad-clip`` they are spilled to
the store until the norm is known (``--grad-spill-dtype bf16`` halves those bytes).
``--state-dtype`` and ``--master-dtype`` choose the compact state forms. After step ``--stop-after`` the run is
stopped once: with ``store.mode = "generations"`` by ``kill -9`` half-way into the next step
(a crash: the store resumes at its last commit, the last finished step or, if the kill came
before that step's deferred commit, the one before), ``"in-place"`` by SIGTERM (a
scheduler's preemption: the step in flight finishes, commits, and the process exits). The
same command then resumes from the store and finishes the steps.

Per step it prints the engine's own statistics (``train.metrics``): loss; seconds split into
compute, exposed parameter I/O and exposed optimizer I/O; bytes read and written; disk GB/s
achieved; peak RSS of the process tree (polled with psutil, and the kernel's high-water mark);
the device budget's high-water mark; and each phase's seconds and waits (forward, backward,
update, the loop's own), in a table and drawn to ``giant_phases.png`` (``benchmarks.phase_plot``,
which also draws several saved runs one above the other). And the bound it is held against,
measured in this run: max(compute-only time, read bytes / raw read bandwidth + written bytes / raw write
bandwidth), the raw bandwidths from ``benchmarks.bandwidth.raw_disk_gbps`` on the store's
disk, the compute-only time from one block's forward and backward (and the root's) at this
width in the run's compute dtype, timed and multiplied out, with no I/O at all
(``benchmarks.compute_only``). The estimator's predictions of peak RSS
and store size (``engine.tools.estimate``) are printed beside the measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.bandwidth import mixed_disk_gbps, raw_disk_gbps
from benchmarks.compute_only import gpt_compute_seconds, run_dtype
from benchmarks.phase_plot import phase_bars, phase_rows, phase_steps
from benchmarks.report import Row, base_parser, print_table, save_json, setup_logging
from benchmarks.runs import disk_usage
from engine.config import Config, ZeroConfig
from engine.run.models.gpt import GPTConfig
from engine.runtime.sizes import GIB, MIB
from engine.tiers.store_io import settle_io
from engine.tools.estimate import estimate, gpt_of, measured_baseline_bytes, plan_of, run_shape
from offload import read_committed

GB = 1e9
POLL_S = 0.25


def run_config(args: argparse.Namespace, store: Path, metrics: Path) -> list[str]:
    """The ``--section.key value`` overrides of the run (the same for the first run and the resume)."""
    overrides = {
        "zero.stage": 3,
        "offload.optimizer": "nvme",
        "offload.param": "nvme",
        "offload.nvme_path": store,
        "offload.buffer_mb": args.buffer_mb,
        "zero.prefetch_mb": args.prefetch_mb,
        "zero.unit_classes": '["Linear"]',  # finer than blocks: a unit's state must fit half the buffer
        "store.mode": args.mode,
        "model.params": args.params,
        "data.micro_batch": args.micro_batch,
        "data.seq_len": args.seq_len,
        "optim.grad_clip": args.grad_clip,
        "optim.state_dtype": args.state_dtype,
        "optim.master_dtype": args.master_dtype,
        "offload.grad_spill_dtype": args.grad_spill_dtype,
        "optim.defer_update": str(args.defer_update).lower(),
        "optim.lr": args.lr,
        "optim.warmup_steps": 0,
        "optim.schedule": "constant",
        "train.steps": args.steps,
        "train.log_every": 1,
        "train.metrics": metrics,
    }
    return [part for key, value in overrides.items() for part in (f"--{key}", str(value))]


def train_config(train_args: list[str]) -> Config:
    """The config ``python -m engine train`` reads from these ``--section.key value`` overrides."""
    return Config.from_dict({}, [f"{k[2:]}={v}" for k, v in zip(train_args[::2], train_args[1::2], strict=True)])


class TreeRSS:
    """The peak resident memory of a process and its children, polled in the background."""

    def __init__(self, pid: int):
        self.peak = 0
        self._root = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                procs = [self._root, *self._root.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:  # the process ended between two looks
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def steps_recorded(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def launch(train_args: list[str], log: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "engine", "train", *train_args], stdout=out, stderr=out, env=env)


def first_run(train_args: list[str], mode: str, stop_after: int, metrics: Path, log: Path) -> dict[str, Any]:
    """Train until step ``stop_after`` is recorded, then stop the run once: kill -9 half-way into
    the next step (generations) or SIGTERM (in place). Returns how it ended."""
    proc = launch(train_args, log)
    rss = TreeRSS(proc.pid)
    sent = None
    while proc.poll() is None:
        records = steps_recorded(metrics)
        if sent is None and records and records[-1]["step"] >= stop_after:
            if mode == "generations":
                time.sleep(records[-1]["seconds"] / 2)  # mid-step: reads, updates and writes in flight
                proc.kill()
                sent = "SIGKILL"
            else:
                proc.send_signal(signal.SIGTERM)
                sent = "SIGTERM"
        time.sleep(POLL_S)
    code = proc.wait()
    return {"signal": sent, "exit_code": code, "peak_rss_bytes": rss.stop()}


def resumed_run(train_args: list[str], log: Path) -> dict[str, Any]:
    proc = launch(train_args, log)
    rss = TreeRSS(proc.pid)
    code = proc.wait()
    return {"exit_code": code, "peak_rss_bytes": rss.stop()}


def step_rows(records: list[dict[str, Any]], runs: list[str], bound: dict[str, float]) -> list[Row]:
    """Each step against its bound: the larger of the compute-only step (``compute_s``) and its
    bytes at the disk's rates. A validation runs after its step's record, so the next step's
    clock, which starts with the first forward after a step, holds it: that step's floor adds a
    validation's forward (``eval_s``)."""
    rows = []
    validated = [False] + ["val_loss" in before and runs[i] == runs[i + 1] for i, before in enumerate(records[:-1])]
    for record, run, after_validation in zip(records, runs, validated, strict=True):
        moved_s = record["bytes_read"] / GB / bound["read_gbps"] + record["bytes_written"] / GB / bound["write_gbps"]
        compute_s = bound["compute_s"] + (bound.get("eval_s", 0.0) if after_validation else 0.0)
        step_bound = max(compute_s, moved_s)
        mixed = {}
        if "mixed_gbps" in bound:
            mixed_s = max(compute_s, (record["bytes_read"] + record["bytes_written"]) / GB / bound["mixed_gbps"])
            mixed = {"mixed bound s": mixed_s, "step/mixed": record["seconds"] / mixed_s}
        rows.append(
            {
                "run": run,
                "step": record["step"],
                "loss": record["loss"],
                "step s": record["seconds"],
                "compute s": record["compute_s"],
                "param wait s": record["param_wait_s"],
                "opt wait s": record["optimizer_wait_s"],
                "read GB": record["bytes_read"] / GB,
                "written GB": record["bytes_written"] / GB,
                "disk GB/s": (record["bytes_read"] + record["bytes_written"]) / GB / record["seconds"],
                "hit rate": record["prefetch_hit_rate"],
                "RSS GiB": record["peak_rss_bytes"] / GIB,
                "device hw MiB": record["device_high_water"] / MIB,
                "bound s": step_bound,
                "step/bound": record["seconds"] / step_bound,
            }
            | mixed
        )
    return rows


def with_mixed_bound(
    bound: dict[str, float], records: list[dict[str, Any]], work: Path, quick: bool
) -> dict[str, float]:
    """``bound`` with the disk's rate when reading and writing at once (``mixed_gbps``), measured
    in ``work`` after the run at the median share of the steps' bytes that were read: a step's
    reads and write-backs overlap, so the summed read and write times are not its limit."""
    shares = [r["bytes_read"] / (r["bytes_read"] + r["bytes_written"]) for r in records if r["bytes_written"]]
    if not shares:
        return bound
    mixed = mixed_disk_gbps(
        work, (64 if quick else 1024) * MIB, statistics.median(shares), threads=4, reps=1 if quick else 3
    )
    print(f"mixed disk: {mixed['gbps']:.2f} GB/s read and written at once, {mixed['read_share']:.2f} of the bytes read")
    return bound | {"mixed_gbps": mixed["gbps"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser("Train a model larger than RAM from an nvme store, stop it once, resume it.")
    parser.add_argument("--params", type=float, help="model parameters (default 3e9; --quick 5e7)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps in all (default 3)")
    parser.add_argument(
        "--stop-after", type=int, default=1, help="step after which the run is stopped once (default 1)"
    )
    parser.add_argument("--mode", choices=("in-place", "generations"), default="in-place", help="store.mode")
    parser.add_argument("--store", type=Path, default=Path("giant_store"), help="store folder (default ./giant_store)")
    parser.add_argument("--keep-store", action="store_true", help="leave the store on disk afterwards")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--buffer-mb", type=int, default=1024, help="offload.buffer_mb (default 1024)")
    parser.add_argument(
        "--prefetch-mb",
        default=ZeroConfig.prefetch_mb,
        help=f"zero.prefetch_mb: MiB of parameters read ahead, or auto (default {ZeroConfig.prefetch_mb})",
    )
    parser.add_argument(
        "--grad-clip", type=float, default=0.0, help="optim.grad_clip (default 0: each unit updated in backward)"
    )
    parser.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32", help="optim.state_dtype")
    parser.add_argument("--master-dtype", choices=("fp32", "bf16"), default="fp32", help="optim.master_dtype")
    parser.add_argument(
        "--grad-spill-dtype", choices=("fp32", "bf16"), default="fp32", help="offload.grad_spill_dtype (with clipping)"
    )
    parser.add_argument(
        "--defer-update",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="optim.defer_update: with --grad-clip, each unit updated in the next forward (default off)",
    )
    # Adam's first steps move every weight by about lr: at d_model 2560, 3e-5 already overshoots;
    # at 10B (d_model 3776, 59 layers) 1e-6 does, and 3e-7 does not.
    parser.add_argument("--lr", type=float, default=3e-6, help="learning rate (default 3e-6, constant)")
    args = parser.parse_args(argv)
    args.params = args.params or (5e7 if args.quick else 3e9)
    if not 1 <= args.stop_after < args.steps:
        parser.error(f"--stop-after must be in [1, --steps - 1] = [1, {args.steps - 1}]")
    return args


def stop_and_resume(
    args: argparse.Namespace, train_args: list[str], store: Path, metrics: Path, log: Path
) -> tuple[dict[str, Any], dict[str, Any], int, list[str], int]:
    """The run stopped by a signal part-way, and resumed to its end: each run's outcome, the step
    committed at the stop, which run each recorded step came from, and the store's size on disk
    (the store removed after, unless ``--keep-store``)."""
    try:
        first = first_run(train_args, args.mode, args.stop_after, metrics, log)
        if first["signal"] is None:
            raise SystemExit(
                f"the run ended (exit code {first['exit_code']}) before it could be stopped:\n{_tail(log)}"
            )
        committed = read_committed(store)["step"]
        first_steps = len(steps_recorded(metrics))
        resumed = resumed_run(train_args, log)
        if resumed["exit_code"] != 0:
            raise SystemExit(f"the resumed run failed (exit code {resumed['exit_code']}):\n{_tail(log)}")
        records = steps_recorded(metrics)
        store_size = disk_usage(store)
    finally:
        if not args.keep_store:
            shutil.rmtree(store, ignore_errors=True)
    runs = ["first"] * first_steps + ["resumed"] * (len(records) - first_steps)
    return first, resumed, committed, runs, store_size


def measure_bound(work: Path, config: Config, gpt: GPTConfig, micro_batch: int, quick: bool) -> dict[str, float]:
    """What bounds a step from below: the raw disk's read and write rates in ``work``, and the
    compute-only step's seconds (printed as measured)."""
    disk = raw_disk_gbps(work, (64 if quick else 1024) * MIB, threads=config.offload.io_threads, reps=1 if quick else 3)
    bound = {
        "read_gbps": disk["read"],
        "write_gbps": disk["write"],
        "compute_s": gpt_compute_seconds(gpt, micro_batch, run_dtype(config), reps=1 if quick else 3),
    }
    print(
        f"raw disk: write {disk['write']:.2f} GB/s, read {disk['read']:.2f} GB/s; compute-only step {bound['compute_s']:.2f} s"
    )
    return bound


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    setup_logging(args.verbose)
    store = args.store.resolve()
    if store.exists():
        raise SystemExit(f"{store} exists: remove it or pass another --store (the run starts a new store)")
    work = store.parent / f"{store.name}-run"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    metrics, log = work / "metrics.jsonl", work / "train.log"
    train_args = run_config(args, store, metrics)
    config, _ = settle_io(train_config(train_args), resume=False)  # as the engine settles "auto" I/O settings
    gpt = gpt_of(config)
    predicted = estimate(run_shape(config, 1, gpt), plan_of(config), baseline_bytes=measured_baseline_bytes())
    n_params = gpt.num_params()
    print(
        f"model: {n_params / 1e9:.2f}B params ({gpt.n_layer} layers, d_model {gpt.d_model}), "
        f"state {16 * n_params / GIB:.1f} GiB in fp32 (master + 2 moments + bf16 params + fp32 grads), stored as "
        f"{config.optim.state_dtype} moments and {config.optim.master_dtype} masters, vs "
        f"RAM {psutil.virtual_memory().total / GIB:.1f} GiB; predicted peak RSS {predicted.peak_rss_bytes / GIB:.2f} GiB, "
        f"store {predicted.disk_bytes / GIB:.1f} GiB"
    )
    bound = measure_bound(work, config, gpt, args.micro_batch, args.quick)
    started = time.perf_counter()
    first, resumed, committed, runs, store_size = stop_and_resume(args, train_args, store, metrics, log)
    records = steps_recorded(metrics)
    bound = with_mixed_bound(bound, records, work, args.quick)
    rows = step_rows(records, runs, bound)
    print_table(f"giant: {n_params / 1e9:.2f}B params, store.mode = {args.mode!r}", rows)
    phases = phase_steps(records, runs)
    print_table("phases", phase_rows(phases))
    peak_rss = max(first["peak_rss_bytes"], resumed["peak_rss_bytes"], *(r["peak_rss_bytes"] for r in records))
    summary = {
        "params": n_params,
        "mode": args.mode,
        "stopped_by": first["signal"],
        "first_exit_code": first["exit_code"],
        "committed_at_stop": committed,
        "resumed_exit_code": resumed["exit_code"],
        "steps_done": records[-1]["step"] if records else 0,
        "peak_rss_bytes": peak_rss,
        "predicted_peak_rss_bytes": predicted.peak_rss_bytes,
        "store_bytes": store_size,
        "predicted_store_bytes": predicted.disk_bytes,
        "wall_s": time.perf_counter() - started,
        **{f"raw_{k}": v for k, v in bound.items()},
    }
    print_table("summary", [summary])
    save_json(
        args.out,
        "giant",
        {"summary": summary, "steps": rows, "phases": phases, "train_log_tail": _tail(log).splitlines()},
    )
    phase_bars(args.out / "giant_phases.png", {f"{n_params / 1e9:.2f}B": phases}, "giant: a step's phases")
    shutil.rmtree(work, ignore_errors=True)
    return {"summary": summary, "steps": rows, "phases": phases}


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    main()
