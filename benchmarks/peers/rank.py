"""One rank of one contestant: build the workload, train it with the contestant's system, time each step.

    python -m benchmarks.peers.rank SPEC.json             # a rank (RANK, WORLD_SIZE, MASTER_* set)
    python -m benchmarks.peers.rank --prepare SPEC.json   # once, before the ranks: compile ops

The loop is shared by every system, so each step is timed the same way: from the
batch in hand to the optimizer's update done (`step` returns after it). The rank
writes what it saw to `<out_dir>/rank<r>.json`, or the error that stopped it, which
the parent reports as the contestant's reason for being skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers.trainers import PREPARE, TRAINERS
from benchmarks.peers.workload import Contestant, Workload


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs, written by the parent as JSON."""

    workload: Workload
    contestant: Contestant
    nvme_path: Path
    out_dir: Path

    def write(self, path: Path) -> None:
        payload = {
            "workload": self.workload.to_dict(),
            "contestant": self.contestant.to_dict(),
            "nvme_path": str(self.nvme_path),
            "out_dir": str(self.out_dir),
        }
        path.write_text(json.dumps(payload, indent=2))

    @classmethod
    def read(cls, path: Path) -> RankSpec:
        raw = json.loads(path.read_text())
        return cls(
            Workload.from_dict(raw["workload"]),
            Contestant.from_dict(raw["contestant"]),
            Path(raw["nvme_path"]),
            Path(raw["out_dir"]),
        )


def result_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.json"


def threads_per_rank(world_size: int) -> int:
    """The cores shared out among the ranks, the same for every system: two ranks on two cores
    get one thread each, a single rank all of them."""
    return max(1, (os.cpu_count() or 1) // world_size)


def train(spec: RankSpec, rank: int) -> dict[str, Any]:
    """Set up the contestant, run warmup and timed steps; per-step seconds and losses."""
    workload = spec.workload
    tokens, vocab_size = workload.tokens()
    data = workload.batches(tokens, rank)
    params = workload.gpt_config(vocab_size).num_params()
    started = time.perf_counter()
    seconds, losses = [], []
    build = functools.partial(workload.model, vocab_size)
    with TRAINERS[spec.contestant.system](build, workload, spec.contestant, spec.nvme_path) as step:
        setup = time.perf_counter() - started
        for _ in range(workload.warmup + workload.steps):
            x, y = data.next()
            begin = time.perf_counter()
            loss = step(x, y)
            seconds.append(time.perf_counter() - begin)
            losses.append(loss.item())
    return {
        "params": params,
        "setup_s": setup,
        "step_s": seconds,
        "losses": losses,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--prepare", action="store_true", help="build what the system needs once, then exit")
    args = parser.parse_args(argv)
    spec = RankSpec.read(args.spec)
    if args.prepare:
        PREPARE[spec.contestant.system](spec.contestant)
        return
    torch.set_num_threads(threads_per_rank(spec.workload.world_size))
    rank = int(os.environ["RANK"])
    try:
        result = train(spec, rank)
    except BaseException as error:
        # The parent's reason for skipping the contestant; the traceback goes to the rank's log.
        result_path(spec.out_dir, rank).write_text(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        raise
    result_path(spec.out_dir, rank).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
