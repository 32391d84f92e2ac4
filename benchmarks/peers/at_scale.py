"""DeepSpeed ZeRO-Infinity and ours at the size people train, one after the other in one invocation.

    python -m benchmarks.peers --params 1e9 [--forms fp32 compact] [--grad-clip C]
                               [--steps N] [--warmup N] [--rounds N] [--dir PATH]

Both train the model `python -m benchmarks.giant --params N` trains (the built-in GPT,
untied, the same data, 1 x 128 tokens, AdamW at giant's constant learning rate) on one
rank with every core, parameters and optimizer state on nvme, clipping the gradients'
global norm to `--grad-clip` on both sides (0, the default, clips nothing):

- DeepSpeed 0.19.8 ZeRO-Infinity, the model built partitioned (`zero.Init`: at this size
  its fp32 weights may not fit in memory whole), fp32 masters and moments, its only form;
- ours, `python -m engine train` with giant's settings, in each of `--forms`: `fp32`
  (fp32 masters and moments, as DeepSpeed keeps them) and `compact` (int8 moments, bf16
  masters, gradients spilled in bf16 when clipping).

Each contestant runs in a process group of its own (`benchmarks.peers.launch`), its
memory and disk sampled from outside the same way. Per contestant: the median step after
`--warmup`, and that step over DeepSpeed's ("x DeepSpeed"); the offload overhead, the step
minus the compute-only step (one block's forward and backward timed here and multiplied
out, `benchmarks.compute_only`; both sides compute in bf16, DeepSpeed's dtype); peak RSS
and the disk its files take. For ours, whose metrics count the bytes each step moves, also
the bound those bytes set at the disk's rate when reading and writing at once
(`benchmarks.bandwidth.mixed_disk_gbps`, measured after the runs at the share of them that
was read), and the step over it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import giant
from benchmarks.compute_only import gpt_compute_seconds
from benchmarks.peers.contest import Runner, group_failure, ran, rank_env, run_contestant, run_rounds, skipped
from benchmarks.peers.launch import python_module, run_ranks
from benchmarks.peers.workload import Contestant, Workload
from benchmarks.report import Row, print_table, save_json
from engine.runtime.sizes import GIB
from engine.state.dtypes import DTYPES
from engine.tools.estimate import gpt_of

GB = 1e9
OWN_STATISTICS = ("bytes_read", "bytes_written", "compute_s", "param_wait_s", "optimizer_wait_s")
"""What ours' metrics say of each step, kept as the median over the timed steps: the bytes it
moved, and its seconds split into the engine's compute and its exposed waits for parameters
and for optimizer state."""
DEEPSPEED = Contestant("deepspeed", "nvme", "nvme")
OURS = Contestant("ours", "nvme", "nvme")


@dataclass(frozen=True)
class StateForm:
    """How ours keeps the optimizer state: `benchmarks.giant`'s flags of the same names."""

    name: str
    state_dtype: str
    master_dtype: str
    grad_spill_dtype: str


FORMS = {
    form.name: form
    for form in (StateForm("fp32", "fp32", "fp32", "fp32"), StateForm("compact", "int8", "bf16", "bf16"))
}


COMPUTE_DTYPE = "bf16"
"""Both sides compute in DeepSpeed's dtype (``benchmarks.peers.trainers``), not in what ``auto``
picks for ours, so that the steps differ by their offload alone."""


def at_scale(params: float, warmup: int, steps: int, grad_clip: float = 0.0) -> Workload:
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
        grad_clip=grad_clip,
        partitioned=True,
    )


def ours_train_args(params: float, form: StateForm, workload: Workload, store: Path, metrics: Path) -> list[str]:
    """`python -m engine train`'s overrides, as `benchmarks.giant` sets them for this form (gradients
    are spilled only to be clipped: without clipping there is no spill to narrow)."""
    args = giant.parse_args(
        [
            *("--params", str(params), "--grad-clip", str(workload.grad_clip)),
            *("--state-dtype", form.state_dtype, "--master-dtype", form.master_dtype),
            *("--grad-spill-dtype", form.grad_spill_dtype if workload.grad_clip else "fp32"),
        ]
    )
    args.steps = workload.warmup + workload.steps  # one run, never stopped: giant's --stop-after plays no part
    return [*giant.run_config(args, store, metrics), "--precision.compute_dtype", COMPUTE_DTYPE]


def run_ours(params: float, form: StateForm, workload: Workload, timeout_s: float, work: Path) -> dict[str, Any]:
    """Ours in `work` as a user runs it, `python -m engine train`; its record, as
    `run_contestant` makes DeepSpeed's, with the bytes each step read and wrote."""
    record: dict[str, Any] = {"label": f"ours, nvme, {form.name}", **OURS.to_dict(), "placement": "nvme"}
    record["form"] = form.name
    store, metrics = work / "store", work / "metrics.jsonl"
    group = run_ranks(
        python_module("engine", "train", *ours_train_args(params, form, workload, store, metrics)),
        1,
        cwd=work,
        env=rank_env(OURS, workload),
        timeout_s=timeout_s,
        log_dir=work,
        watch=store,
    )
    if not group.ok:
        return skipped(record, *group_failure(work, group, timeout_s))
    steps = giant.steps_recorded(metrics)
    timed = steps[workload.warmup :]
    ran(
        record,
        workload,
        group,
        steps_s=[s["seconds"] for s in steps],
        losses=[s["loss"] for s in steps],
        setup_s=group.wall_s - sum(s["seconds"] for s in steps),
        rank_max_rss_bytes=[max(s["peak_rss_bytes"] for s in steps)],
    )
    record.update({key: statistics.median(s[key] for s in timed) for key in OWN_STATISTICS})
    record["disk_bytes"] = group.peak_disk_bytes
    return record


def runners(args: argparse.Namespace, workload: Workload, systems: list[str]) -> list[tuple[str, Runner]]:
    """DeepSpeed first, then ours in each of `--forms`, of the chosen systems."""
    chosen: list[tuple[str, Runner]] = []
    if "deepspeed" in systems:
        deepspeed = functools.partial(
            run_contestant, DEEPSPEED, workload, timeout_s=args.timeout, prepare_timeout_s=args.prepare_timeout
        )
        chosen.append((DEEPSPEED.label, deepspeed))
    if "ours" in systems:
        chosen += [
            (f"ours, nvme, {name}", functools.partial(run_ours, args.params, FORMS[name], workload, args.timeout))
            for name in args.forms
        ]
    return chosen


def add_bounds(records: list[dict[str, Any]], compute_s: float, mixed_gbps: dict[str, float]) -> None:
    """Each record's offload overhead and step over DeepSpeed's; ours' step over the bound its
    bytes set at `mixed_gbps[form]`, the disk's rate at that form's mix of reads and writes."""
    ran = [r for r in records if r["status"] == "ok"]
    deepspeed = next((r for r in ran if r["system"] == "deepspeed"), None)
    for record in ran:
        record["compute_only_s"] = compute_s
        record["overhead_s"] = record["step_s"] - compute_s
        if deepspeed is not None:
            record["x_deepspeed"] = record["step_s"] / deepspeed["step_s"]
        if record.get("form") in mixed_gbps:
            moved_gb = (record["bytes_read"] + record["bytes_written"]) / GB
            record["mixed_bound_s"] = max(compute_s, moved_gb / mixed_gbps[record["form"]])
            record["step_over_mixed"] = record["step_s"] / record["mixed_bound_s"]


def measure_mixed(records: list[dict[str, Any]], work: Path, quick: bool) -> dict[str, float]:
    """The disk's mixed rate at each of ours' forms' share of bytes read, as giant measures it."""
    return {
        r["form"]: giant.with_mixed_bound({}, [r], work, quick)["mixed_gbps"]
        for r in records
        if r["status"] == "ok" and "bytes_read" in r and r["bytes_written"]
    }


def table_rows(records: list[dict[str, Any]]) -> tuple[list[Row], list[Row]]:
    """The contestants that ran, blank where a column does not apply, and those skipped."""
    ran, skipped_rows = [], []
    for r in records:
        name = {"system": r["label"]}
        if r["status"] != "ok":
            skipped_rows.append(name | {"reason": r["reason"].splitlines()[0]})
            continue
        ran.append(
            name
            | {
                "step s": r["step_s"],
                "x DeepSpeed": r.get("x_deepspeed", ""),
                "overhead s": r["overhead_s"],
                "mixed bound s": r.get("mixed_bound_s", ""),
                "step/mixed": r.get("step_over_mixed", ""),
                "engine compute s": r.get("compute_s", ""),
                "param wait s": r.get("param_wait_s", ""),
                "opt wait s": r.get("optimizer_wait_s", ""),
                "read GB": r["bytes_read"] / GB if "bytes_read" in r else "",
                "written GB": r["bytes_written"] / GB if "bytes_written" in r else "",
                "peak RSS GiB": r["peak_rss_bytes"] / GIB,
                "rank hw GiB": max(r["rank_max_rss_bytes"]) / GIB,
                "disk GB": r["disk_bytes"] / GB,
                "first loss": r["losses"][0],
                "last loss": r["losses"][-1],
            }
        )
    return ran, skipped_rows


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """`python -m benchmarks.peers --params N`: the contestants in turn, their table and JSON."""
    systems = args.systems or ["deepspeed", "ours"]
    if not set(systems) <= {"deepspeed", "ours"}:
        parser.error("--params runs DeepSpeed and ours: plain PyTorch and FSDP2 hold the whole model in memory")
    warmup = args.warmup if args.warmup is not None else 1
    steps = args.steps if args.steps is not None else (1 if args.quick else 2)
    workload = at_scale(args.params, warmup, steps, args.grad_clip)
    _, vocab_size = workload.tokens()
    gpt = workload.gpt_config(vocab_size)
    compute_s = gpt_compute_seconds(gpt, workload.micro_batch, DTYPES[COMPUTE_DTYPE], reps=1 if args.quick else 3)
    print(f"compute-only step: {compute_s:.2f} s (forward and backward, no I/O)")
    records = run_rounds(runners(args, workload, systems), workload, args.rounds or 1, args.dir)
    add_bounds(records, compute_s, measure_mixed(records, args.dir, args.quick))
    ran, skipped_rows = table_rows(records)
    clip = f"clipped to {workload.grad_clip:g}" if workload.grad_clip else "no clipping"
    print_table(
        f"At scale: {gpt.num_params() / 1e6:,.0f}M params, 1 rank, parameters and optimizer on nvme, {clip}; "
        f"median of {steps} steps after {warmup}",
        ran,
    )
    if skipped_rows:
        print_table("Skipped", skipped_rows)
    result = {
        "workload": workload.to_dict(),
        "params": gpt.num_params(),
        "compute_s": compute_s,
        "contestants": records,
        "rows": ran,
        "skipped": skipped_rows,
    }
    save_json(args.out, f"peers-at-{args.params:.0e}".replace("+0", ""), result)
    return result
