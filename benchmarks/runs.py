"""Train the built-in model for a few steps and keep what each step cost, in this process or a fresh one.

Both benchmarks that time whole steps (`benchmarks.step`, `benchmarks.scale`) run the
model and data of `python -m engine train` under a given config, skip a few warm-up
steps (first-touch allocations, the store's first generations) and keep the engine's
own per-step statistics (`Engine.last_step_stats`) of the rest.

`run_alternating` runs several configs side by side in one process, taking turns, so that
their ratios (an offloaded step against its compute alone) survive the machine's drift.

Memory has to be measured in a fresh process: the kernel's high-water mark never
goes down, so a process that already ran a larger model would report that one.
`run_isolated` therefore runs `python -m benchmarks.runs` with the config on stdin
and reads the result back from the last line of its stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from benchmarks.optimizer import threads_restored
from engine.build import units_layout
from engine.config import Config
from engine.engine import Engine
from engine.run.data import TokenBatches, load_tokens
from engine.run.models.gpt import GPT
from engine.run.train import meta_model, peak_rss_bytes
from engine.runtime.device import SIM_ENV
from engine.runtime.heap import tune_heap
from engine.state.partition import ModelLayout, find_units
from engine.tiers.store_io import settle_io

DEFAULT_THREADS = os.cpu_count() or 1
"""What `python -m engine train` gives one rank: every core."""
REPO_ROOT = Path(__file__).resolve().parents[1]
"""Put on the child's path: `benchmarks` is not an installed package, only a folder of the repo."""


@dataclass(frozen=True)
class Schedule:
    """How a run steps: ``warmup`` untimed steps, then ``steps`` timed ones, on ``threads`` torch threads."""

    warmup: int
    steps: int
    threads: int = DEFAULT_THREADS


def add_schedule_arguments(parser: argparse.ArgumentParser, full: Schedule, quick: Schedule) -> None:
    """``--steps``, ``--warmup`` and ``--threads``, whose defaults depend on ``--quick``."""
    parser.add_argument(
        "--steps", type=int, help=f"timed steps per run, median (default {full.steps}, --quick {quick.steps})"
    )
    parser.add_argument(
        "--warmup", type=int, help=f"untimed steps first (default {full.warmup}, --quick {quick.warmup})"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"torch threads (default {DEFAULT_THREADS}: every core, as `python -m engine train` gives one rank)",
    )


def schedule_from(args: argparse.Namespace, full: Schedule, quick: Schedule) -> Schedule:
    """The schedule the parsed arguments ask for."""
    default = quick if args.quick else full
    return Schedule(
        warmup=default.warmup if args.warmup is None else args.warmup,
        steps=args.steps or default.steps,
        threads=args.threads,
    )


@dataclass
class RunResult:
    """What a run of a few steps cost; plain data, so it crosses a process boundary as JSON."""

    params: int
    compute_dtype: str
    """The dtype the model computed in: ``precision.compute_dtype`` as the engine settled it."""
    steps: list[dict[str, Any]]
    """`StepStats.to_dict()` of every timed step (warm-up steps excluded)."""
    rss_before_bytes: int
    """Resident memory once the model and the data are built, before the engine exists."""
    peak_rss_bytes: int
    """The process's resident high-water mark over everything it did (the kernel's, not sampled)."""
    store_bytes: int
    """Disk allocated under `offload.nvme_path` after the last step (0 when nothing is stored)."""
    device_peak_bytes: int
    """The CUDA caching allocator's high-water mark over everything the process did (activations
    and library workspaces included, which `zero.device_memory_limit_mb` leaves out); 0 without CUDA."""

    def median(self, key: str) -> float:
        """Median over the timed steps of one `StepStats` field."""
        return statistics.median(float(step[key]) for step in self.steps)

    def median_io_cpu(self, stage: str) -> float:
        """Median over the timed steps of one stage's CPU-seconds per GB the stores moved
        (`StepStats.io_cpu_s_per_gb`; "total" for their sum), 0 for a step that moved nothing."""
        return statistics.median(float(step["io_cpu_s_per_gb"].get(stage, 0.0)) for step in self.steps)


def model_and_data(config: Config) -> tuple[GPT, Callable[[dict[str, torch.Tensor]], None], TokenBatches]:
    """The model (on the meta device), its unit initialiser and the batches `python -m engine
    train` builds from ``config``, on one rank."""
    tokens, vocab_size = load_tokens(config.data.source, config.data.tokenizer, vocab_size=config.data.vocab_size)
    batches = TokenBatches(
        tokens, seq_len=config.data.seq_len, micro_batch=config.data.micro_batch, seed=config.data.seed
    )
    return *meta_model(config, vocab_size), batches


def model_layout(config: Config) -> ModelLayout:
    """The units, shards and chunks the engine lays ``config``'s model out in, on one rank,
    without building an engine (so without touching a store)."""
    config, _ = settle_io(config, resume=False)  # as the engine settles "auto" I/O settings
    model, _, _ = model_and_data(config)
    return units_layout(model, find_units(model, config.zero.unit_classes), config, world_size=1)[1]


def device_peak_bytes() -> int:
    """Most bytes this process ever held in tensors on the CUDA device, 0 without one."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def disk_usage(path: Path) -> int:
    """Bytes allocated on disk by the files under ``path`` (what `du` counts), 0 if it does not exist."""
    return sum(entry.stat().st_blocks * 512 for entry in path.rglob("*") if entry.is_file())


class DiskPeak:
    """The largest size of a folder, sampled every ``every`` seconds on a thread of its own."""

    def __init__(self, folder: Path, every: float):
        self.folder, self.every, self.peak = folder, every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            with contextlib.suppress(FileNotFoundError):  # a file deleted while counted
                self.peak = max(self.peak, disk_usage(self.folder))
            if self._done.wait(self.every):
                return

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, disk_usage(self.folder))


class TrainingRun:
    """One engine over the model and data of ``config``, stepped on demand."""

    def __init__(self, config: Config, total_steps: int):
        self.model, init, self.batches = model_and_data(config)
        self._accum = config.zero.grad_accum_steps
        self.rss_before_bytes = psutil.Process().memory_info().rss
        """Resident memory once the model and the data are built, before the engine exists."""
        self.engine = Engine(self.model, config, total_steps=total_steps, init_unit=init)

    def step(self) -> dict[str, Any]:
        """One optimizer step; the engine's statistics of it."""
        for _ in range(self._accum):
            self.engine.backward(self.engine(*self.batches.next()))
            self.engine.step()
        return self.engine.last_step_stats.to_dict()

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def result(self, steps: list[dict[str, Any]]) -> RunResult:
        """What the run cost in ``steps``, beside the process's memory high-water marks."""
        config = self.engine.config
        return RunResult(
            params=self.params,
            compute_dtype=config.precision.compute_dtype,
            steps=steps,
            rss_before_bytes=self.rss_before_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            store_bytes=disk_usage(Path(config.offload.store_path)),
            device_peak_bytes=device_peak_bytes(),
        )


def run_engine(config: Config, schedule: Schedule) -> RunResult:
    """Train ``schedule.warmup + schedule.steps`` optimizer steps in this process; keep the
    statistics of the timed ones."""
    total = schedule.warmup + schedule.steps
    with threads_restored():
        torch.set_num_threads(schedule.threads)
        run = TrainingRun(config, total)
        timed = []
        try:
            for step in range(total):
                stats = run.step()
                if step >= schedule.warmup:
                    timed.append(stats)
        finally:
            run.engine.close()
    return run.result(timed)


ALTERNATION_BLOCK = 4
"""Steps each run takes in a row when runs alternate; the first of each block is not timed."""


@contextlib.contextmanager
def simulated_device(spec: str | None) -> Iterator[None]:
    """Engines built inside run on the simulated asynchronous device ``spec`` (see
    ``engine.runtime.sim_device``), or with None on the machine's own."""
    before = os.environ.pop(SIM_ENV, None)
    if spec is not None:
        os.environ[SIM_ENV] = spec
    try:
        yield
    finally:
        os.environ.pop(SIM_ENV, None)
        if before is not None:
            os.environ[SIM_ENV] = before


def run_alternating(
    configs: list[Config], schedule: Schedule, devices: list[str | None] | None = None
) -> list[RunResult]:
    """Train one engine per config in this process, taking turns in blocks of steps, so that a
    slow spell of the machine (a shared host's speed drifts by tens of percent within minutes)
    hits every run alike and their ratios hold where their absolute times do not.

    A run's I/O must not spill into another's turn: each block ends with ``Engine.flush``
    (its last commit, untimed), and the block's first step, whose predecessor's write-back was
    thereby taken out of it, is not timed either. Every timed step thus pays for exactly its
    predecessor's deferred commit, as in an uninterrupted run. Memory is the process's, shared
    by all runs: ``peak_rss_bytes`` and ``device_peak_bytes`` are not any one run's. ``devices``
    gives each run a simulated device spec (``simulated_device``), None for the machine's own."""
    timed_per_block = ALTERNATION_BLOCK - 1
    blocks = -(-schedule.steps // timed_per_block)
    total = schedule.warmup + blocks * ALTERNATION_BLOCK
    timed: list[list[dict[str, float]]] = [[] for _ in configs]
    runs: list[TrainingRun] = []
    with threads_restored():
        torch.set_num_threads(schedule.threads)
        try:
            for config, device in zip(configs, devices or [None] * len(configs), strict=True):
                with simulated_device(device):
                    runs.append(TrainingRun(config, total))
            for run in runs:
                for _ in range(schedule.warmup):
                    run.step()
                run.engine.flush()
            for _ in range(blocks):
                for run, kept in zip(runs, timed, strict=True):
                    kept.extend([run.step() for _ in range(ALTERNATION_BLOCK)][1:])
                    run.engine.flush()
        finally:
            for run in runs:
                run.engine.close()
    return [run.result(kept[: schedule.steps]) for run, kept in zip(runs, timed, strict=True)]


def run_isolated(config: Config, schedule: Schedule) -> RunResult:
    """`run_engine` in a fresh Python process, so that its peak memory is its own."""
    spec = {"config": config.to_dict(), "schedule": asdict(schedule)}
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.runs"],
        input=json.dumps(spec),
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        check=False,
    )
    if child.returncode:
        model = f"{config.model.params / 1e6:g}M params" if config.model.params else f"preset {config.model.preset!r}"
        raise RuntimeError(
            f"the benchmark's child process (GPT of {model}) exited with code {child.returncode}; its output is above"
        )
    return RunResult(**json.loads(child.stdout.splitlines()[-1]))


def main() -> None:
    """The child side of `run_isolated`: a spec as JSON on stdin, the `RunResult` as one JSON line on stdout."""
    spec = json.load(sys.stdin)
    tune_heap()  # as `python -m engine train` does
    result = run_engine(Config.from_dict(spec["config"]), Schedule(**spec["schedule"]))
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
