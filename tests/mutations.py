"""Deliberate faults in the arithmetic and the guards, each of which some test must catch.

    python -m tests.mutations [--only WORD ...] [--out FILE.json] [--no-baseline]

The repository is copied to a temporary folder once; each fault replaces one piece of text
of one file there (each ``old`` must occur exactly once, or the fault is stale and the
script stops), runs the few tests named to catch it with ``PYTHONPATH`` set to the copy,
and restores the file. A fault is caught when those tests fail (pytest's exit status 1).
First, unless ``--no-baseline``, every named test runs on the unchanged copy and must pass:
a test failing without a fault would catch anything. Prints a table and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "*.egg-info")
RESULTS = ROOT / "benchmarks" / "results" / "mutations.json"
EQUIVALENCE = "tests/engine/test_equivalence.py"
COMPACT = "tests/engine/test_compact_update.py"
HOST = "tests/engine/test_host_update.py"


@dataclass(frozen=True)
class Fault:
    name: str
    path: str
    edits: tuple[tuple[str, str], ...]
    """``(old, new)`` replacements in ``path``, each ``old`` found exactly once."""
    tests: tuple[str, ...]
    """pytest node ids or files that must fail with the fault in place."""


def fault(name: str, path: str, old: str, new: str, *tests: str) -> Fault:
    return Fault(name, path, ((old, new),), tests)


FAULTS = [
    Fault(
        "schedule: warmup and decay removed",
        "engine/zero/optim.py",
        (
            ("return (step + 1) / config.warmup_steps", "return 1.0"),
            ("return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * left", "return 1.0"),
        ),
        (f"{EQUIVALENCE}::test_tied_embeddings_bit_identical",),  # the reference's schedule is its own
    ),
    fault(
        "schedule: decay stretched over the warmup too",
        "engine/zero/optim.py",
        "max(1, total_steps - config.warmup_steps)",
        "max(1, total_steps)",
        "tests/engine/test_schedule.py",
    ),
    fault(
        "fp16: gradients never unscaled",
        "engine/zero/precision.py",
        "torch.full((1,), 1.0 / self.scale,",
        "torch.full((1,), 1.0,",
        "tests/engine/test_loss_scaling.py",
    ),
    fault(
        "bf16: learning rate halved",
        "engine/engine.py",
        "lr = self.config.optim.lr * lr_factor(",
        'lr = (0.5 if self.config.precision.compute_dtype == "bf16" else 1.0) * self.config.optim.lr * lr_factor(',
        f"{EQUIVALENCE}::test_bf16_follows_autocast_reference",
    ),
    fault(
        "bf16: learning rate doubled",
        "engine/engine.py",
        "lr = self.config.optim.lr * lr_factor(",
        'lr = (2.0 if self.config.precision.compute_dtype == "bf16" else 1.0) * self.config.optim.lr * lr_factor(',
        f"{EQUIVALENCE}::test_bf16_follows_autocast_reference",
    ),
    fault(
        "compact: beta2 forced to 0.999",
        "engine/zero/compact_update.py",
        "values = (lr, beta1, beta2,",
        "values = (lr, beta1, 0.999,",
        COMPACT,
    ),
    fault(
        "compact: weight decay removed",
        "engine/zero/compact_update.py",
        "shrink = 1 - lr * weight_decay",
        "shrink = 1 - lr * weight_decay * 0",
        COMPACT,
    ),
    fault(
        "compact: epsilon 100 times too large",
        "engine/zero/compact_update.py",
        "values = (lr, beta1, beta2, config.eps,",
        "values = (lr, beta1, beta2, config.eps * 100,",
        COMPACT,
    ),
    fault(
        "compact: bias correction removed",
        "engine/zero/compact_update.py",
        "1 - beta1**step, math.sqrt(1 - beta2**step))",
        "1.0, 1.0)",
        COMPACT,
    ),
    fault(
        "host kernel: the second moment's noise from the period's start in every block",
        "engine/zero/host_adamw.c",
        "*restrict noise_v = job->noise_v + e0 % PERIOD;",
        "*restrict noise_v = job->noise_v;",
        HOST,
    ),
    fault(
        "host kernel: the decay mask ignored",
        "engine/zero/host_adamw.c",
        "w[i] = d[i] ? w[i] * shrink : w[i];",
        "w[i] = w[i] * shrink;",
        HOST,
    ),
    fault(
        "host kernel: the last thread's last block left out",
        "engine/zero/host_adamw.c",
        "blocks * t / threads, blocks * (t + 1) / threads};",
        "blocks * t / threads, blocks * (t + 1) / threads - (t == threads - 1)};",
        HOST,
    ),
    fault(
        "fp32 AdamW: wrong beta1",
        "engine/zero/optim.py",
        "beta1=beta1,",
        "beta1=beta1 * 0.99,",
        f"{EQUIVALENCE}::test_tied_embeddings_bit_identical",
    ),
    fault(
        "fp32 AdamW: wrong epsilon",
        "engine/zero/optim.py",
        "eps=self.config.eps,",
        "eps=self.config.eps * 10,",
        f"{EQUIVALENCE}::test_tied_embeddings_bit_identical",
    ),
    fault(
        "clipping skipped",
        "engine/zero/optim.py",
        "return torch.clamp(max_norm / (total + 1e-6), max=1.0)",
        "return torch.ones_like(total)",
        f"{EQUIVALENCE}::test_clipping_is_bit_identical_to_clip_grad_norm_every_step[2-cpu]",
    ),
    fault(
        "a rank's shard one element off",
        "engine/state/partition.py",
        "return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)",
        "return slice(rank * (self.shard_numel - 1), rank * (self.shard_numel - 1) + self.shard_numel)",
        f"{EQUIVALENCE}::test_two_gloo_ranks_match_one_process[3-cpu]",
    ),
    fault(
        "chunk files not fsynced",
        "offload/store.py",
        "self._fsync_all([*chunk_files, *files], dirs)",
        "self._fsync_all([*files], dirs)",
        "tests/offload/test_store.py::test_sync_fsyncs_every_written_chunk_and_its_directories",
    ),
    fault(
        "a dropped prefetch freed before its copy's event",
        "engine/zero/unit_params.py",
        "            if self.copied is not None and not self.copied.query():\n                self.copied.synchronize()\n",
        "            if False:\n                self.copied.synchronize()\n",
        "tests/engine/test_sim_device.py::test_evaluations_between_steps_change_nothing_with_late_copies",
    ),
    fault(
        "accumulated gradients summed, not averaged",
        "engine/engine.py",
        "(scaled / accum if accum > 1 else scaled).backward()",
        "scaled.backward()",
        f"{EQUIVALENCE}::test_gradient_accumulation_equals_one_large_batch",
    ),
    fault(
        "a resumed run starts its batches over",
        "engine/run/train.py",
        "    if saved is not None:\n        data.load_state_dict(saved)",
        "    if False:\n        data.load_state_dict(saved)",
        "tests/benchmarks/test_giant.py",
    ),
    fault(
        "peers: ours at half the learning rate",
        "benchmarks/peers/trainers.py",
        '**workload.adamw_kwargs(),\n                "no_decay"',
        '**workload.adamw_kwargs(),\n                "lr": workload.lr / 2,\n                "no_decay"',
        "tests/benchmarks/test_peers.py::test_plain_fsdp2_and_ours",
    ),
]


def run_tests(copy: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int, float]:
    """pytest's exit status on ``tests`` in ``copy`` (whatever their markers), and its seconds."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow", *tests]
    env = os.environ | {"PYTHONPATH": str(copy)}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - start
    return done.returncode, time.perf_counter() - start


def patched(path: Path, edits: tuple[tuple[str, str], ...]) -> str:
    """``path``'s text with ``edits`` made; refused unless each old text occurs exactly once."""
    text = path.read_text()
    for old, new in edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"{path}: {old!r} occurs {count} times, not once: the fault no longer fits the code")
        text = text.replace(old, new)
    return text


def check(copy: Path, item: Fault, timeout_s: float) -> dict:
    """Apply ``item`` in ``copy``, run its tests, restore the file; its row of the table."""
    target = copy / item.path
    original = target.read_text()
    target.write_text(patched(target, item.edits))
    try:
        status, seconds = run_tests(copy, item.tests, timeout_s)
    finally:
        target.write_text(original)
    verdict = {1: "caught", 0: "NOT CAUGHT", -1: "timed out"}.get(status, f"error (pytest exit {status})")
    return {"fault": item.name, "file": item.path, "tests": list(item.tests), "result": verdict, "seconds": seconds}


def print_table(rows: list[dict]) -> None:
    header = ("fault", "file", "tests run", "caught?", "s")
    lines = [_line(r) for r in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
    for line in (header, *lines):
        print(" | ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))


def _line(row: dict) -> tuple[str, ...]:
    tests = " ".join(t.split("/")[-1] for t in row["tests"])
    return (row["fault"], row["file"], tests, row["result"], f"{row['seconds']:.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="faults whose name contains one of these")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"where to write the table as JSON (default {RESULTS})"
    )
    parser.add_argument("--no-baseline", action="store_true", help="do not check that the tests pass without a fault")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed to each fault's tests")
    args = parser.parse_args(argv)
    faults = [f for f in FAULTS if not args.only or any(word in f.name for word in args.only)]
    with tempfile.TemporaryDirectory(prefix="mutations-") as folder:
        copy = Path(folder) / "repo"
        shutil.copytree(ROOT, copy, ignore=IGNORED)
        for item in faults:  # every fault fits the code before any time is spent
            patched(copy / item.path, item.edits)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for f in faults for t in f.tests))
            status, seconds = run_tests(copy, tests, args.timeout * len(faults))
            print(f"baseline: the named tests without a fault: pytest exit {status} in {seconds:.0f} s")
            if status != 0:
                raise SystemExit("the named tests fail without any fault: fix them first")
        rows = []
        for item in faults:
            rows.append(check(copy, item, args.timeout))
            print(f"{item.name}: {rows[-1]['result']} ({rows[-1]['seconds']:.0f} s)", flush=True)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0 if all(r["result"] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
