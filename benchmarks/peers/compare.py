"""Our engine beside plain PyTorch, FSDP2 and DeepSpeed: the same training, side by side, in one run.

    python -m benchmarks.peers [--quick] [--systems plain fsdp2 deepspeed ours] [--rounds N] [--dir PATH] [--out PATH]
    python -m benchmarks.peers --params 3e9 [--steps N] [--warmup N] [--dir PATH] [--timeout S]

Every contestant trains the same workload (`benchmarks.peers.workload`): the built-in
GPT, untied (21.1M parameters: 4 layers, d_model 512, 8 heads, a BPE vocabulary of
8192), on the built-in Shakespeare data, 4 x 256 tokens per rank, bf16 compute, AdamW
with the same hyper-parameters and no clipping, on 2 gloo ranks of one thread each:

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

With `--params N`, DeepSpeed ZeRO-Infinity alone trains the model `python -m
benchmarks.giant --params N` trains ours on (`at_scale`: the same GPT, untied as ours
is, the same data, 1 x 128 tokens, AdamW with giant's constant learning rate, no
clipping), on one rank with every core, parameters and optimizer state on nvme. Such a
model's fp32 weights may not fit in memory, so DeepSpeed builds it already partitioned
(`zero.Init`). Ours at that size is `benchmarks.giant` itself; its table is the one to
put beside this one. The step time is the median of the steps after `--warmup` (1).

The default install has no DeepSpeed; the `peers` extra brings it (and `tokenizers`,
for the BPE data). DeepSpeed builds against the installed torch, so its build must
see it, and its ops are compiled on first use rather than at install:

    apt-get install -y libaio-dev        # Debian: DeepSpeed's async I/O op, for the nvme contestant
    DS_BUILD_OPS=0 pip install --no-build-isolation -e ".[peers,bench]"

The first run compiles DeepSpeed's CPU Adam (about 2.5 minutes here) and async I/O ops
(up to 10 minutes) into torch's extension cache, in a process of its own before the
contestant's ranks start, so it counts in neither their step time nor their memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from benchmarks import giant
from benchmarks.peers.launch import python_module, run_one, run_ranks
from benchmarks.peers.rank import RankSpec, result_path, threads_per_rank
from benchmarks.peers.trainers import ENVIRONMENT, PREPARE, REQUIRES
from benchmarks.peers.workload import (
    FULL,
    QUICK,
    SYSTEM_NAMES,
    Contestant,
    System,
    Workload,
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
from engine.tools.estimate import gpt_of

RANK_MODULE = "benchmarks.peers.rank"
INSTALL = 'DS_BUILD_OPS=0 pip install --no-build-isolation -e ".[peers]"'
REPO = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 20

CONTESTANTS = (
    Contestant("plain", "device", "device"),
    Contestant("fsdp2", "cpu", "cpu"),
    Contestant("deepspeed", "cpu", "cpu"),
    Contestant("ours", "cpu", "cpu"),
    Contestant("deepspeed", "nvme", "nvme"),
    Contestant("ours", "nvme", "nvme"),
)
"""In this order: the floor first, then each placement's peers before ours."""

AT_SCALE = Contestant("deepspeed", "nvme", "nvme")
"""The peer of `benchmarks.giant`: ZeRO-Infinity, parameters and optimizer state on nvme."""


def _rank_env(contestant: Contestant, workload: Workload) -> dict[str, str]:
    """This environment, plus the rank's share of the cores, the repository on the path (the benchmarks
    are not installed) and what the system itself needs."""
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads_per_rank(workload.world_size)),
        "PYTHONPATH": os.pathsep.join(path),
        **ENVIRONMENT.get(contestant.system, {}),
    }


def _log_tail(log: Path) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except FileNotFoundError:
        return []


def _meaningful(line: str) -> bool:
    """Not blank, not indented (a warning's code line, a traceback's frames) and not a warning."""
    return bool(line.strip()) and not line[0].isspace() and "Warning: " not in line and "[WARNING]" not in line


def _rank_error(work: Path, rank: int, code: int | None) -> str:
    """Why a rank stopped: the error it recorded, else the signal that ended it (SIGKILL, when
    memory ran out, is the kernel's OOM killer's) or its exit code, and its last line of output
    that is not a warning or the code line a warning prints under it."""
    try:
        return json.loads(result_path(work, rank).read_text())["error"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        lines = [line for line in _log_tail(work / f"rank{rank}.log") if _meaningful(line)]
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return f"rank {rank} {how}: {lines[-1] if lines else 'no output'}"


def _skipped(record: dict[str, Any], reason: str, log: Path | None = None) -> dict[str, Any]:
    record.update(status="skipped", reason=reason)
    if log is not None:
        record["log_tail"] = _log_tail(log)
    return record


def at_scale(params: float, warmup: int, steps: int) -> Workload:
    """The workload `python -m benchmarks.giant --params N` trains, on one rank, built
    partitioned: the engine's config from giant's own defaults, read back as a workload."""
    args = giant.parse_args(["--params", str(params)])
    config = giant.train_config(giant.run_config(args, args.store, Path("metrics.jsonl")))
    gpt, optim = gpt_of(config), config.optim
    if gpt.tie_embeddings:
        raise ValueError("DeepSpeed's nvme parameter offload needs an untied model; giant's config ties it")
    return Workload(
        tokenizer=config.data.tokenizer,
        vocab_size=config.data.vocab_size,
        seq_len=gpt.seq_len,
        n_layer=gpt.n_layer,
        n_head=gpt.n_head,
        d_model=gpt.d_model,
        micro_batch=config.data.micro_batch,
        warmup=warmup,
        steps=steps,
        world_size=1,
        seed=config.train.seed,
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        partitioned=True,
    )


def run_contestant(
    contestant: Contestant, workload: Workload, work: Path, timeout_s: float, prepare_timeout_s: float
) -> dict[str, Any]:
    """Run one contestant in `work` (its spec, logs, rank results and NVMe files); its record."""
    record: dict[str, Any] = {"label": contestant.label, **contestant.to_dict(), "placement": contestant.placement}
    module = REQUIRES.get(contestant.system)
    if module is not None and importlib.util.find_spec(module) is None:
        return _skipped(record, f"{module} is not installed: {INSTALL}")
    nvme = work / "nvme"
    spec_path = work / "spec.json"
    RankSpec(workload, contestant, nvme, work).write(spec_path)
    env = _rank_env(contestant, workload)
    if contestant.system in PREPARE:
        started = time.perf_counter()
        log = work / "prepare.log"
        command = python_module(RANK_MODULE, "--prepare", str(spec_path))
        code = run_one(command, cwd=work, env=env, timeout_s=prepare_timeout_s, log=log)
        if code != 0:
            why = f"timed out after {prepare_timeout_s:.0f} s" if code is None else f"exit code {code}"
            return _skipped(record, f"preparing {contestant.system} failed ({why})", log)
        record["prepare_s"] = time.perf_counter() - started
    group = run_ranks(
        python_module(RANK_MODULE, str(spec_path)),
        workload.world_size,
        cwd=work,
        env=env,
        timeout_s=timeout_s,
        log_dir=work,
        watch=nvme if contestant.uses_nvme else None,
    )
    if not group.ok:
        failed = group.first_failure()
        if failed is None:
            return _skipped(record, f"timed out after {timeout_s:.0f} s", work / "rank0.log")
        return _skipped(record, _rank_error(work, failed, group.returncodes[failed]), work / f"rank{failed}.log")
    ranks = [json.loads(result_path(work, rank).read_text()) for rank in range(workload.world_size)]
    step_s = [max(times) for times in zip(*(r["step_s"] for r in ranks), strict=True)]
    median = statistics.median(step_s[workload.warmup :])
    record.update(
        status="ok",
        params=ranks[0]["params"],
        step_s=median,
        steps_s=step_s,
        tokens_per_s=workload.tokens_per_step / median,
        setup_s=max(r["setup_s"] for r in ranks),
        losses=[statistics.fmean(losses) for losses in zip(*(r["losses"] for r in ranks), strict=True)],
        peak_rss_bytes=group.peak_rss_bytes,
        rank_max_rss_bytes=[r["max_rss_bytes"] for r in ranks],
        wall_s=group.wall_s,
    )
    if contestant.uses_nvme:
        record["disk_bytes"] = group.peak_disk_bytes
    return record


def merge_rounds(rounds: Sequence[dict[str, Any]], workload: Workload) -> dict[str, Any]:
    """One contestant's records from several rounds as one: its step time the median of every
    round's timed steps, its memory and disk the largest any round saw. A round that failed
    stands for all of them."""
    failed = next((r for r in rounds if r["status"] != "ok"), None)
    if failed is not None or len(rounds) == 1:
        return failed or rounds[0]
    step_s = statistics.median(s for r in rounds for s in r["steps_s"][workload.warmup :])
    merged = dict(rounds[0])
    merged.update(
        step_s=step_s,
        round_step_s=[r["step_s"] for r in rounds],
        tokens_per_s=workload.tokens_per_step / step_s,
        setup_s=statistics.median(r["setup_s"] for r in rounds),
        peak_rss_bytes=max(r["peak_rss_bytes"] for r in rounds),
        wall_s=sum(r["wall_s"] for r in rounds),
    )
    if "disk_bytes" in merged:
        merged["disk_bytes"] = max(r["disk_bytes"] for r in rounds)
    return merged


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


def _side_by_side_run(args: argparse.Namespace) -> tuple[Workload, list[Contestant], int]:
    """Every chosen contestant at the peers' own size (`FULL`, or `QUICK`), in `--rounds` rounds."""
    workload = QUICK if args.quick else FULL
    workload = dataclasses.replace(
        workload,
        steps=args.steps if args.steps is not None else workload.steps,
        warmup=args.warmup if args.warmup is not None else workload.warmup,
    )
    systems = args.systems or get_args(System)
    return workload, [c for c in CONTESTANTS if c.system in systems], args.rounds or (1 if args.quick else 2)


def _at_scale_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Workload, list[Contestant], int]:
    """DeepSpeed ZeRO-Infinity at giant's `--params`, once; refused without DeepSpeed."""
    if args.systems not in (None, ["deepspeed"]):
        parser.error("--params runs DeepSpeed alone; ours at that size is: python -m benchmarks.giant --params N")
    if importlib.util.find_spec(REQUIRES["deepspeed"]) is None:
        raise SystemExit(f"--params runs DeepSpeed, which is not installed: apt-get install -y libaio-dev && {INSTALL}")
    warmup = args.warmup if args.warmup is not None else 1
    steps = args.steps if args.steps is not None else (1 if args.quick else 2)
    return at_scale(args.params, warmup, steps), [AT_SCALE], args.rounds or 1


def run_rounds(
    contestants: list[Contestant], workload: Workload, rounds: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every contestant in turn, ``rounds`` times over, each in a fresh folder under ``--dir``:
    one record each, its rounds merged."""
    runs: list[list[dict[str, Any]]] = [[] for _ in contestants]
    args.dir.mkdir(parents=True, exist_ok=True)
    for round_index in range(rounds):
        for contestant, kept in zip(contestants, runs, strict=True):
            print(f"round {round_index + 1} of {rounds}: running {contestant.label} ...", flush=True)
            with tempfile.TemporaryDirectory(prefix="bench-peers-", dir=args.dir) as work:
                record = run_contestant(contestant, workload, Path(work), args.timeout, args.prepare_timeout)
            kept.append(record)
            ran = record["status"] == "ok"
            print(f"  {1000 * record['step_s']:.0f} ms/step" if ran else f"  skipped: {record['reason']}", flush=True)
    return [merge_rounds(kept, workload) for kept in runs]


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
        "--params",
        type=float,
        help="DeepSpeed alone, nvme, one rank, at the model benchmarks.giant trains at --params N",
    )
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the NVMe contestants write (default .)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one contestant may run")
    parser.add_argument(
        "--prepare-timeout", type=float, default=1800.0, help="seconds to compile a system's ops on first use"
    )
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    if args.params is not None:
        workload, contestants, rounds = _at_scale_run(parser, args)
    else:
        workload, contestants, rounds = _side_by_side_run(args)
    if workload.steps < 1 or workload.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if rounds < 1:
        parser.error("--rounds must be >= 1")
    _, vocab_size = workload.tokens()  # tokenise (and train the BPE) once, before any rank needs it
    params = workload.gpt_config(vocab_size).num_params()
    records = run_rounds(contestants, workload, rounds, args)
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
    name = "peers" if args.params is None else f"peers-at-{args.params:.0e}".replace("+0", "")
    plot(args.out / f"{name}.png", records, f"Step time: {model}\n{ranks}")
    save_json(args.out, name, result)
    return result
