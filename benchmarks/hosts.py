"""Several hosts against one: the same ranks as 2 simulated hosts, each with its own store
(``offload.nvme_path`` holding ``{node}``), and as 1 host with one store.

Both run ``python -m engine train`` on 2 ranks of this machine (the "hosts" share its cores
and disk, as the ranks of one host do, so only the stores and the commit protocol differ) with
the optimizer state and the parameters on nvme. Each configuration runs twice: with
``store.defer_commit = false``, so the commit (the last writes, fsync, the hosts' two barriers
and ``COMMITTED``) is inside the step and its cost shows in the optimizer wait, and with the
default deferred commit, which hides it behind the next step's forward. The configurations take
turns over ``--rounds``, so that the machine's drift reaches all of them; the table gives, per
configuration, the median over its steps after ``--warmup`` of every round of the step time and
of the optimizer wait; the commit's added latency per step is the 2-host optimizer wait minus
the 1-host one, commit not deferred.

    python -m benchmarks.hosts [--quick] [--steps N] [--rounds R] [--preset small]
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.peers.launch import python_module, run_ranks
from benchmarks.report import base_parser, print_table, save_json, setup_logging
from benchmarks.runs import REPO_ROOT


def run(folder: Path, hosts: int, defer: bool, preset: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    """One configuration's run; the statistics of its steps after the warm-up."""
    store = folder / ("node-{node}" if hosts > 1 else "store")
    metrics = folder / "metrics.jsonl"
    argv = python_module(
        "engine", "train", "--preset", preset, "--stage", "3", "--optimizer", "nvme", "--param", "nvme",
        "--nvme_path", str(store), "--steps", str(warmup + steps), "--store.defer_commit", str(defer).lower(),
        "--train.metrics", str(metrics), "--log_every", "1000",
    )  # fmt: skip
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    result = run_ranks(argv, 2, cwd=REPO_ROOT, env=env, timeout_s=600, log_dir=folder, hosts=hosts)
    if not result.ok:
        raise RuntimeError(f"the {hosts}-host run failed: see {folder}/rank*.log")
    return [json.loads(line) for line in metrics.read_text().splitlines()][warmup:]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="the built-in GPT's size (default tiny)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 10, --quick 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="turns of every configuration (default 2)")
    args = parser.parse_args()
    setup_logging(args.verbose)
    steps = args.steps or (4 if args.quick else 10)
    configs = [(hosts, defer) for defer in (False, True) for hosts in (1, 2)]
    records: dict[tuple[int, bool], list[dict[str, Any]]] = {config: [] for config in configs}
    with tempfile.TemporaryDirectory(prefix="hosts-") as scratch:
        for turn in range(args.rounds):
            for hosts, defer in configs:
                folder = Path(scratch) / f"{turn}-{hosts}-{defer}"
                folder.mkdir()
                records[hosts, defer] += run(folder, hosts, defer, args.preset, steps, args.warmup)
    rows = [
        {
            "hosts": hosts,
            "defer_commit": defer,
            "step_s": statistics.median(r["seconds"] for r in kept),
            "optimizer_wait_s": statistics.median(r["optimizer_wait_s"] for r in kept),
            "steps": len(kept),
        }
        for (hosts, defer), kept in records.items()
    ]
    print_table(f"2 ranks as 1 host or 2 hosts, preset {args.preset}, stage 3, all on nvme", rows)
    waits = {(r["hosts"], r["defer_commit"]): r["optimizer_wait_s"] for r in rows}
    added = waits[2, False] - waits[1, False]
    print(f"the commit's added latency per step (2 hosts against 1, commit not deferred): {added * 1e3:.1f} ms")
    save_json(args.out, "hosts", {"rows": rows, "commit_added_latency_s": added, "preset": args.preset})


if __name__ == "__main__":
    main()
