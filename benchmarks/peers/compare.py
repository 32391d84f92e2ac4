"""Our engine beside plain PyTorch, FSDP2 and DeepSpeed: the same training, side by side, in one run.

    python -m benchmarks.peers [--quick] [--systems plain fsdp2 deepspeed ours] [--rounds N] [--dir PATH] [--out PATH]
    python -m benchmarks.peers --params 3e9 [--forms fp32 compact] [--grad-clip C] [--steps N] [--dir PATH]

Every contestant trains the same workload (`benchmarks.peers.workload`): the built-in
GPT, untied (21.1M parameters: 4 layers, d_model 512, 8 heads, a BPE vocabulary of
8192), on the built-in Shakespeare data, 4 x 256 tokens per rank, bf16 compute, AdamW
with the same hyper-parameters and no clipping (unless `--grad-clip`), on 2 gloo ranks of one thread each:

- plain PyTorch: DDP, bf16 autocast, fused AdamW; nothing sharded or offloaded: the floor;
- FSDP2: `fully_shard` per block and root, `CPUOffloadPolicy(pin_memory=False)`, bf16
  `MixedPrecisionPolicy` with fp32 gradient reduction;
- DeepSpeed 0.19.8 ZeRO-3, bf16, optimizer state and parameters offloaded to `cpu`, and to `nvme`;
- ours, stage 3, `offload.optimizer` and `offload.param` on `cpu`, and on `nvme`.

Each contestant runs in a process group of its own (`benchmarks.peers.launch`), so its
peak RSS is that of its ranks (and their children) only, sampled from outside, beside
the largest rank's own high-water mark from the kernel ("rank hw": a child forked from
a rank shows the rank's pages until it runs its program, and DeepSpeed starts one to
read the CPU's features each time it loads an op, so its sampled peak can count a large
rank twice); the
NVMe runs also report the disk their files occupy at the peak. A step is timed from
the batch to the finished update; a contestant's step time is the median over the
timed steps (after `warmup`) of the slowest rank's, over `--rounds` rounds in which every
contestant runs in turn (a shared machine's speed drifts by tens of percent within minutes:
rounds spread that over all contestants instead of whichever ran in a slow spell). Ratios pair contestants that keep
their state on the same tiers: "peer/ours" above 1 means ours is faster; "x plain" is
the price of offloading against the floor. A contestant that is not installed or fails
is listed as skipped, with the reason. `--quick` runs a 0.14M-parameter model on byte
tokens for three steps: a check that the script works, not a measurement.

With `--params N`, DeepSpeed ZeRO-Infinity and ours train the model `python -m
benchmarks.giant --params N` trains, in turn, on one rank with parameters and optimizer
state on nvme: `benchmarks.peers.at_scale` tells how.

The default install has no DeepSpeed; the `peers` extra brings it (and `tokenizers`,
for the BPE data). DeepSpeed builds against the installed torch, so its build must
see it, and its ops are compiled on first use rather than at install:

    apt-get install -y libaio-dev        # Debian: DeepSpeed's async I/O op, for the nvme contestant
    pip install wheel setuptools         # a fresh virtual environment: the build runs without isolation
    DS_BUILD_OPS=0 pip install --no-build-isolation -e ".[peers,bench]"

The first run compiles DeepSpeed's CPU Adam (about 2.5 minutes here) and async I/O ops
(up to 10 minutes) into torch's extension cache, in a process of its own before the
contestant's ranks start, so it counts in neither their step time nor their memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from benchmarks.peers import at_scale
from benchmarks.peers.at_scale import FORMS
from benchmarks.peers.contest import run_contestant, run_rounds
from benchmarks.peers.rank import threads_per_rank
from benchmarks.peers.workload import (
    FULL,
    QUICK,
    SYSTEM_NAMES,
    Contestant,
    System,
)
from benchmarks.report import (
    Row,
    bar_chart,
    base_parser,
    print_table,
    save_json,
    setup_logging,
)
from engine.runtime.sizes import MIB

CONTESTANTS = (
    Contestant("plain", "device", "device"),
    Contestant("fsdp2", "cpu", "cpu"),
    Contestant("deepspeed", "cpu", "cpu"),
    Contestant("ours", "cpu", "cpu"),
    Contestant("deepspeed", "nvme", "nvme"),
    Contestant("ours", "nvme", "nvme"),
)
"""In this order: the floor first, then each placement's peers before ours."""


def add_ratios(records: Sequence[dict[str, Any]]) -> None:
    """`x_plain`: step time over the floor's; `peer_over_ours`: a peer's step time over ours
    on the same tiers. Only between contestants that ran."""
    ran = {(r["system"], r["placement"]): r for r in records if r["status"] == "ok"}
    floor = ran.get(("plain", "device"))
    for (system, placement), record in ran.items():
        if floor is not None and record is not floor:
            record["x_plain"] = record["step_s"] / floor["step_s"]
        ours = ran.get(("ours", placement))
        if system not in ("plain", "ours") and ours is not None:
            record["peer_over_ours"] = record["step_s"] / ours["step_s"]


def table_rows(records: Sequence[dict[str, Any]]) -> tuple[list[Row], list[Row]]:
    """The contestants that ran, as the table shows them (blank where a column does not
    apply, so every row has every column in order), and those skipped, with why."""
    ran, skipped = [], []
    for r in records:
        name = {"system": SYSTEM_NAMES[r["system"]], "placement": r["placement"]}
        if r["status"] != "ok":
            skipped.append(name | {"reason": r["reason"].splitlines()[0]})  # the JSON has all of it
            continue
        ran.append(
            name
            | {
                "step ms": 1000 * r["step_s"],
                "x plain": r.get("x_plain", ""),
                "peer/ours": r.get("peer_over_ours", ""),
                "tokens/s": r["tokens_per_s"],
                "peak RSS MiB": r["peak_rss_bytes"] / MIB,
                "rank hw MiB": max(r["rank_max_rss_bytes"]) / MIB,
                "disk MiB": r["disk_bytes"] / MIB if "disk_bytes" in r else "",
                "first loss": r["losses"][0],
                "last loss": r["losses"][-1],
                "setup s": r["setup_s"],
            }
        )
    return ran, skipped


def plot(path: Path, records: Sequence[dict[str, Any]], title: str) -> Path | None:
    """Step time per placement, one bar per system, the floor as a line."""
    ran = [r for r in records if r["status"] == "ok"]
    offloaded = [r for r in ran if r["system"] != "plain"]
    if not offloaded:
        return None
    placements = list(dict.fromkeys(r["placement"] for r in offloaded))
    systems = list(dict.fromkeys(r["system"] for r in offloaded))
    ms = {(r["system"], r["placement"]): 1000 * r["step_s"] for r in offloaded}
    series = {SYSTEM_NAMES[s]: [ms.get((s, p), math.nan) for p in placements] for s in systems}
    floors = {f"{SYSTEM_NAMES['plain']}, no offload": 1000 * r["step_s"] for r in ran if r["system"] == "plain"}
    return bar_chart(path, placements, series, ylabel="ms per step (median)", title=title, references=floors)


def side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen contestant at the peers' own size (`FULL`, or `QUICK`), in `--rounds` rounds."""
    workload = QUICK if args.quick else FULL
    workload = dataclasses.replace(
        workload,
        steps=args.steps if args.steps is not None else workload.steps,
        warmup=args.warmup if args.warmup is not None else workload.warmup,
        grad_clip=args.grad_clip,
    )
    systems = args.systems or get_args(System)
    contestants = [c for c in CONTESTANTS if c.system in systems]
    rounds = args.rounds or (1 if args.quick else 2)
    _, vocab_size = workload.tokens()  # tokenise (and train the BPE) once, before any rank needs it
    params = workload.gpt_config(vocab_size).num_params()
    runners = [
        (
            c.label,
            functools.partial(
                run_contestant, c, workload, timeout_s=args.timeout, prepare_timeout_s=args.prepare_timeout
            ),
        )
        for c in contestants
    ]
    records = run_rounds(runners, workload, rounds, args.dir)
    add_ratios(records)
    ran, skipped = table_rows(records)
    model = f"{params / 1e6:.2f}M params, {workload.micro_batch} x {workload.seq_len} tokens per rank, bf16"
    ranks = f"{workload.world_size} gloo rank(s) x {threads_per_rank(workload.world_size)} thread(s)"
    print_table(
        f"Peers side by side: {model}, {ranks}; median of {workload.steps} steps after {workload.warmup}, "
        f"in each of {rounds} round(s)",
        ran,
    )
    if skipped:
        print_table("Skipped", skipped)
    result = {
        "workload": workload.to_dict(),
        "vocab_size": vocab_size,
        "params": params,
        "contestants": records,
        "rows": ran,
        "skipped": skipped,
    }
    plot(args.out / "peers.png", records, f"Step time: {model}\n{ranks}")
    save_json(args.out, "peers", result)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.prog = "python -m benchmarks.peers"
    systems: tuple[System, ...] = get_args(System)
    parser.add_argument("--systems", nargs="+", choices=systems, help="contestants to run (default all)")
    parser.add_argument("--steps", type=int, help=f"timed steps (default {FULL.steps}, --quick {QUICK.steps})")
    parser.add_argument(
        "--warmup", type=int, help=f"untimed first steps (default {FULL.warmup}, --quick {QUICK.warmup})"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="times every contestant runs, in turn, so that the machine's drift hits all alike (default 2, --quick 1)",
    )
    parser.add_argument(
        "--grad-clip", type=float, default=0.0, help="global gradient norm clipped to (default 0: none)"
    )
    parser.add_argument(
        "--params",
        type=float,
        help="DeepSpeed ZeRO-Infinity and ours, nvme, one rank, at the model benchmarks.giant trains at --params N",
    )
    parser.add_argument(
        "--forms",
        nargs="+",
        choices=list(FORMS),
        default=list(FORMS),
        help="with --params: the state forms ours runs in (default all)",
    )
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the NVMe contestants write (default .)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one contestant may run")
    parser.add_argument(
        "--prepare-timeout", type=float, default=1800.0, help="seconds to compile a system's ops on first use"
    )
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.grad_clip < 0:
        parser.error("--grad-clip must be >= 0")
    return at_scale.main(parser, args) if args.params is not None else side_by_side(args)
