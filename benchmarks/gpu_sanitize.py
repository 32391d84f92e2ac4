"""Short trainings under PyTorch's CUDA sanitizer: ``python -m benchmarks.gpu --sanitize``.

The sanitizer (CSAN, ``torch.cuda._sanitizer``) follows every kernel's reads and writes of
every tensor, on each stream, with the events between streams, and reports an access on one
stream that nothing orders after a conflicting access on another: a copy that reads a buffer
the compute stream is still writing, a tensor freed while a copy still reads it. It turns on
when ``TORCH_CUDA_SANITIZER`` is set before torch is imported, so each training runs as
``python -m engine train`` in a child process with that variable set. Two trainings run at
once, a process each: stage 3 with the parameters and the optimizer state on nvme (the copies
to and from the store's pinned buffers), and stage 1 with the optimizer state in host memory
(the host worker's copies). A training is clean when it exits with 0 and
its output holds no ``RACE_MARK``; its race report is the output from the first mark on.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.runs import REPO_ROOT

RACE_MARK = "CSAN detected a possible data race"
"""How the sanitizer's report of a race begins (``torch.cuda._sanitizer.UnsynchronizedAccessError``)."""
STEPS = 3
COMMON = ("--model.preset", "tiny", "--train.steps", str(STEPS), "--train.log-every", "1")
COMMON += ("--precision.compute-dtype", "bf16")
ALL_ON_NVME = ("--zero.stage", "3", "--offload.param", "nvme", "--offload.optimizer", "nvme")
TRAININGS: dict[str, tuple[str, ...]] = {
    "stage 3, parameters and optimizer on nvme": ALL_ON_NVME,
    # Clipped (the default), so each unit's new shard goes up for the next forward during the update.
    "stage 3, parameters cpu, optimizer nvme": (
        "--zero.stage",
        "3",
        "--offload.param",
        "cpu",
        "--offload.optimizer",
        "nvme",
    ),
    # Each unit updated in the next forward, going up from its new master before its gather.
    "stage 3, parameters and optimizer on nvme, update deferred": (*ALL_ON_NVME, "--optim.defer-update", "true"),
    "stage 1, optimizer cpu": ("--zero.stage", "1", "--offload.optimizer", "cpu"),
}
"""The sanitized trainings by name: their options on top of ``COMMON`` (a store of their own is added)."""
TAIL_CHARS = 4000
"""The end of a training's output kept in the record (its progress and its error, if any)."""


@dataclasses.dataclass
class Sanitized:
    """One training under the sanitizer: how it ended, and the race it reported, if any."""

    name: str
    command: list[str]
    exit_code: int | None
    """None where it ran past its time limit and was stopped."""
    seconds: float
    race: str
    """The sanitizer's report from its first ``RACE_MARK`` on; empty where it reported none."""
    tail: str

    @property
    def clean(self) -> bool:
        return self.exit_code == 0 and not self.race

    def verdict(self) -> str:
        if self.race:
            return "a possible data race"
        if self.exit_code is None:
            return "ran past its time limit"
        return "clean" if self.exit_code == 0 else f"exited with code {self.exit_code}"


def race_report(output: str) -> str:
    """``output`` from the line holding the first ``RACE_MARK`` on; empty without one."""
    at = output.find(RACE_MARK)
    return "" if at < 0 else output[output.rfind("\n", 0, at) + 1 :]


def _text(captured: str | bytes | None) -> str:
    """A child's captured output as text (a timed-out run hands it back as bytes)."""
    if isinstance(captured, bytes):
        return captured.decode(errors="replace")
    return captured or ""


def run_sanitized(name: str, command: list[str], timeout_s: float) -> Sanitized:
    """``command`` in a child process with the sanitizer on, stopped after ``timeout_s``."""
    paths = [str(REPO_ROOT), os.environ.get("PYTHONPATH")]
    env = os.environ | {"TORCH_CUDA_SANITIZER": "1", "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    began = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output, code = _text(err.stdout) + _text(err.stderr), None
    return Sanitized(name, command, code, time.monotonic() - began, race_report(output), output[-TAIL_CHARS:])


def sanitize(work: Path, timeout_s: float) -> list[Sanitized]:
    """Each of ``TRAININGS`` under the sanitizer at once, a store each under ``work``."""
    commands = {
        name: [sys.executable, "-m", "engine", "train", *COMMON, *options, "--offload.nvme-path", str(work / f"{i}")]
        for i, (name, options) in enumerate(TRAININGS.items())
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        runs = [pool.submit(run_sanitized, name, command, timeout_s) for name, command in commands.items()]
        return [run.result() for run in runs]


def print_sanitized(runs: list[Sanitized]) -> None:
    """Each training's verdict, and the race report or the end of the output of one that is not clean."""
    for run in runs:
        print(f"{run.name}: {run.verdict()} ({run.seconds:.0f} s): {' '.join(run.command[1:])}")
    for run in runs:
        if not run.clean:
            print(f"\n=== {run.name}: {run.verdict()}\n{run.race or run.tail}")
