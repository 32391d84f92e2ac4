"""AdamW step throughput: in memory against torch's AdamW and memory bandwidth, on NVMe against the disk.

    python -m benchmarks.optimizer [--quick] [--params N] [--nvme-params N] [--dir PATH] [--state-dtype D]

The engine updates flat fp32 shards one unit at a time with `ShardAdamW`; the
"host memory" section measures that (both kernels) against `torch.optim.AdamW`
(fused, foreach and for-loop) stepping separate tensors of the same sizes, on
one and two threads.

The bound: an AdamW step reads p, g, m, v and writes p, m, v, 28 bytes of
memory traffic per fp32 parameter. A memcpy moves 2 bytes per byte copied
(one read, one write), so the traffic rate is twice the measured copy rate,
and a step at memcpy speed handles 2 x memcpy GB/s / 28 B parameters per
second. It is a yardstick, not a hard ceiling: memcpy streams one buffer in
and one out, and this machine's memory serves several concurrent streams
faster (the fused kernel, reading four, runs above it), so "of bound" near or
above 1 means memory-bound rather than a broken limit. The copy runs over
buffers as large as the step's state (16 bytes per parameter), so both meet
the same caches; with a small `--params` both fit in the last-level cache and
the figure means little. One copying thread: a second adds nothing to memcpy
on this machine.

The "nvme tier" section runs the engine's whole optimizer step with its state
on disk (`StoreOptimizerState`: stream each unit's master and moments in,
update, write back, then fsync and commit the new generation), with the page
cache dropped before every timed step so that reads come from the disk. Its
bound is the disk: the bytes read at the raw read rate plus the bytes written
at the raw write rate (reads and writes share one disk, so their times add),
the raw rates measured by `benchmarks.bandwidth.raw_disk_gbps` on the same
directory in the same rounds. A step that hides its compute behind its I/O
takes max(compute, I/O bound); "of bound" (I/O bound / step) says how close
the store comes, with the goal `NVME_GOAL`. Compute is timed on the same
shards held in memory, so that the two can be compared. The default 200M
parameters move 4.8 GB through the disk per step (about 4-5 s here), enough
to reach the disk's steady rates while the section stays near a minute and a half.

With `--state-dtype bf16` or `int8` (`optim.state_dtype`), or `--master-dtype bf16`
(`optim.master_dtype`), the host memory section adds the engine's update on state of that form
(`CompactAdamW`), and the nvme tier section runs its step on a store of that form; its row gives the bytes per parameter stored and moved (read
plus written) per step, as measured from the store's pipeline. With `int8`, the 8-bit AdamW of
bitsandbytes and of torchao join the host memory section where they import.

Each section returns its own table, so more can follow.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import mmap
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from benchmarks.bandwidth import interleaved_medians, memcpy_gbps
from benchmarks.nvme_step import NvmeRound, NvmeSetup, measure_nvme
from benchmarks.report import Row, bar_chart, base_parser, print_table, save_json, setup_logging
from engine.config import OffloadConfig, OptimConfig
from engine.runtime.sizes import MIB
from engine.state.forms import FP32_STATE, StateForm
from engine.state.partition import ModelLayout, build_layout, max_chunk_numel
from engine.tiers.sizing import AUTO_BUFFER_FLOOR_MB
from engine.zero.compact_update import CompactAdamW
from offload import CHUNK_RANGE, auto_settings

BYTES_PER_PARAM = 28  # fp32: read p, g, m, v; write p, m, v
STATE_BYTES_PER_PARAM = 16  # fp32 p, g, m, v
NVME_GOAL = 0.8
RAW_MAX_BYTES = 1 << 30  # enough to reach the disk's steady rate; more only adds minutes

Step = Callable[[], None]


@dataclass(frozen=True)
class Setup:
    """What every section measures on: the sizes, the repetitions and the bound."""

    params: int
    shard_params: int
    threads: tuple[int, ...]
    reps: int
    memcpy_gbps: float
    nvme: NvmeSetup
    form: StateForm = FP32_STATE

    @property
    def bound_mparams(self) -> float:
        """Parameters per second (millions) at the memory-bandwidth bound."""
        return 2 * self.memcpy_gbps * 1e9 / BYTES_PER_PARAM / 1e6

    def shard_sizes(self, params: int | None = None) -> list[int]:
        """`params` (default `self.params`) cut into shards of `shard_params`, the last one shorter."""
        full, rest = divmod(self.params if params is None else params, self.shard_params)
        return [self.shard_params] * full + ([rest] if rest else [])


@dataclass
class Section:
    """One section's output: its table, with a title and the lines that explain it.

    `details` go to the JSON record only: figures the notes quote, kept
    out of the table so that it stays readable.
    """

    title: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def threads_restored() -> Iterator[None]:
    """Put torch's thread count back as it was, whatever the block sets it to."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _params_and_grads(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3) for n in sizes]


def shard_adamw_step(sizes: list[int], kernel: str, form: StateForm = FP32_STATE) -> Step:
    """One engine optimizer step: `CompactAdamW.update` (`ShardAdamW`'s, for fp32 state) on
    each flat shard in turn, its state in ``form``."""
    config = OptimConfig(kernel=kernel, state_dtype=form.name, master_dtype=form.master)
    opt = CompactAdamW(config)
    units = synthetic_layout(sizes, CHUNK_RANGE[1], form).units
    shards = []
    for unit, (p, g) in zip(units, _params_and_grads([u.shard_numel for u in units]), strict=True):
        master, exp_avg, exp_avg_sq = form.empty(unit)
        master.copy_(p)
        shards.append((master, g, exp_avg.zero_(), exp_avg_sq.zero_(), opt.new_step_counter(p.device)))

    def step() -> None:
        for shard in shards:
            opt.update(*shard, lr=config.lr)

    return step


def torch_adamw_step(sizes: list[int], optimizer: type = torch.optim.AdamW, **flags: bool) -> Step:
    """One `torch.optim.AdamW` step (or another AdamW class's) over separate tensors, with the
    engine's hyperparameters."""
    params = []
    for p, g in _params_and_grads(sizes):
        param = torch.nn.Parameter(p)
        param.grad = g
        params.append(param)
    config = OptimConfig()
    opt = optimizer(params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, **flags)
    return opt.step


OPTIMIZERS: dict[str, Callable[[list[int]], Step]] = {
    "ShardAdamW fused": lambda sizes: shard_adamw_step(sizes, "fused"),
    "ShardAdamW foreach": lambda sizes: shard_adamw_step(sizes, "foreach"),
    "torch AdamW fused": lambda sizes: torch_adamw_step(sizes, fused=True),
    "torch AdamW foreach": lambda sizes: torch_adamw_step(sizes, foreach=True),
    "torch AdamW for-loop": lambda sizes: torch_adamw_step(sizes, foreach=False),
}


def _on_threads(step: Step, threads: int) -> Step:
    def run() -> None:
        torch.set_num_threads(threads)
        step()

    return run


def library_8bit() -> dict[str, type]:
    """The 8-bit AdamW of bitsandbytes and of torchao, those that import here: what the
    engine's own 8-bit moments are measured against."""
    found = {}
    for name, module in (("bitsandbytes", "bitsandbytes.optim"), ("torchao", "torchao.optim")):
        with contextlib.suppress(Exception):  # absent, or built for another torch
            found[f"{name} AdamW8bit"] = importlib.import_module(module).AdamW8bit
    return found


def form_name(form: StateForm) -> str:
    """How a table names a state form: its moments' dtype, and its masters' where not fp32."""
    return f"{form.name} moments" + (f", {form.master} masters" if form.master != "fp32" else "")


def optimizers(form: StateForm) -> dict[str, Callable[[list[int]], Step]]:
    """``OPTIMIZERS``, and the engine's update on compact state of ``form`` (for int8 moments,
    beside the libraries' 8-bit AdamW that import here)."""
    if form == FP32_STATE:
        return OPTIMIZERS
    found: dict[str, Callable[[list[int]], Step]] = {
        f"CompactAdamW fused {form.name}" + (f" {form.master} master" if form.master != "fp32" else ""): (
            lambda sizes: shard_adamw_step(sizes, "fused", form)
        )
    }
    if form.name == "int8":
        for name, cls in library_8bit().items():
            found[name] = functools.partial(torch_adamw_step, optimizer=cls)
    return {**OPTIMIZERS, **found}


def host_memory_section(setup: Setup) -> Section:
    """Every optimizer with its state in host memory: the compute side of a step.

    All optimizers are built at once (16 bytes of state per parameter each) so
    that their steps can interleave, round after round.
    """
    sizes = setup.shard_sizes()
    built = optimizers(setup.form).items()
    steps = {name: build(sizes) for name, build in tqdm(built, desc="building", unit="optimizer")}
    runs = {(name, t): _on_threads(step, t) for name, step in steps.items() for t in setup.threads}
    with threads_restored():
        seconds = interleaved_medians(runs, setup.reps, desc="steps")
    rows = []
    for (name, threads), s in seconds.items():
        mparams = setup.params / s / 1e6
        rows.append(
            {
                "optimizer": name,
                "threads": threads,
                "ms/step": s * 1e3,
                "Mparam/s": mparams,
                "GB/s moved": mparams * BYTES_PER_PARAM / 1e3,
                "of bound": mparams / setup.bound_mparams,
            }
        )
    title = (
        f"{setup.params / 1e6:g}M fp32 params in {len(sizes)} shards, median of {setup.reps} steps; "
        f"of bound: Mparam/s / memory-bandwidth bound"
    )
    bound = (
        f"Memory-bandwidth bound: memcpy {setup.memcpy_gbps:.2f} GB/s copied = {2 * setup.memcpy_gbps:.2f} GB/s "
        f"moved; / {BYTES_PER_PARAM} B per param = {setup.bound_mparams:.0f} Mparam/s"
    )
    return Section(title, rows, [bound])


def synthetic_layout(sizes: list[int], chunk_mb: int, form: StateForm = FP32_STATE) -> ModelLayout:
    """One rank's layout of units of `sizes` parameters, like a stack of transformer blocks,
    chunked as the engine chunks state of ``form``.

    The parameters live on the meta device: the layout needs only their shapes.
    """
    units = {f"block{i}": [("weight", nn.Parameter(torch.empty(n, device="meta")))] for i, n in enumerate(sizes)}
    return build_layout(units, world_size=1, max_chunk_numel=max_chunk_numel(chunk_mb), align=form.chunk_align)


def nvme_tier_section(setup: Setup) -> Section:
    """The optimizer step with its state on disk, against the disk's raw rates and the compute alone.

    Ratios are taken between medians: the rounds interleave, so the medians
    come from the same stretch of time.
    """
    nvme = setup.nvme
    layout = synthetic_layout(setup.shard_sizes(nvme.params), nvme.chunk_mb, setup.form)
    state_bytes = sum(setup.form.unit_bytes(unit) for unit in layout.units)
    raw_bytes = max(mmap.PAGESIZE, min(RAW_MAX_BYTES, state_bytes) // mmap.PAGESIZE * mmap.PAGESIZE)
    sizes = [unit.shard_numel for unit in layout.units]
    compute = shard_adamw_step(sizes, OptimConfig().kernel, setup.form)
    rounds = measure_nvme(nvme, layout, raw_bytes, setup.reps, compute, _params_and_grads(sizes), setup.form)
    row, details = _nvme_row(rounds, state_bytes, layout.numel)
    details["raw_bytes"] = raw_bytes
    reads = "cold (page cache dropped before each step)" if details["cold"] else "WARM (page cache not dropped)"
    title = (
        f"{nvme.params / 1e6:g}M params ({form_name(setup.form)}) in {len(layout.units)} units, buffer {nvme.buffer_mb} MiB, "
        f"{nvme.chunk_mb} MiB chunks, {nvme.io_threads} I/O threads, {torch.get_num_threads()} torch threads; "
        f"median of {setup.reps} steps, reads {reads}"
    )
    return Section(title, [row], _nvme_notes(nvme, row, details), details)


def _nvme_row(rounds: list[NvmeRound], state_bytes: int, numel: int) -> tuple[Row, dict[str, Any]]:
    """The section's row, of medians over ``rounds``, and the figures its notes quote."""

    def median(value: Callable[[NvmeRound], float]) -> float:
        return statistics.median(value(r) for r in rounds)

    raw_read, raw_write = median(lambda r: float(r.raw["read"])), median(lambda r: float(r.raw["write"]))
    bytes_read, bytes_written = rounds[-1].stats.bytes_read, rounds[-1].stats.bytes_written
    io_bound = bytes_read / raw_read / 1e9 + bytes_written / raw_write / 1e9
    step_s, compute_s = median(lambda r: r.step_s), median(lambda r: r.compute_s)
    of_bound = io_bound / step_s
    row: Row = {
        "step s": step_s,
        "compute s": compute_s,
        "I/O bound s": io_bound,
        "step/max": step_s / max(compute_s, io_bound),
        "of bound": of_bound,
        "read wait s": median(lambda r: r.stats.read_wait_s),
        "write wait s": median(lambda r: r.stats.write_wait_s),
        "hidden I/O s": median(lambda r: r.stats.hidden_s),
        "finish s": median(lambda r: r.finish_s),
        "GB/s": (bytes_read + bytes_written) / step_s / 1e9,
        "B/param stored": state_bytes / numel,
        "B/param moved": (bytes_read + bytes_written) / numel,
    }
    details = {
        "bytes_read": bytes_read,
        "bytes_written": bytes_written,
        "raw_read_gbps": raw_read,
        "raw_write_gbps": raw_write,
        "direct": all(bool(r.raw["direct"]) for r in rounds),
        "cold": all(r.cold for r in rounds),
        "goal": NVME_GOAL,
        "goal_met": of_bound >= NVME_GOAL,
    }
    return row, details


def _nvme_notes(nvme: NvmeSetup, row: Row, details: dict[str, Any]) -> list[str]:
    """The lines under the section's table: what its bound is, and each column that needs saying."""
    return [
        (
            f"I/O bound: {details['bytes_read'] / 1e9:.2f} GB / raw read {details['raw_read_gbps']:.2f} GB/s + "
            f"{details['bytes_written'] / 1e9:.2f} GB / raw write {details['raw_write_gbps']:.2f} GB/s "
            f"({'O_DIRECT' if details['direct'] else 'buffered'}, {nvme.io_threads} threads, "
            f"{details['raw_bytes'] / MIB:.0f} MiB, same directory, same rounds)."
        ),
        "step/max: step / max(compute, I/O bound), 1 when one hides the other entirely.",
        "hidden I/O s: I/O task time summed over the I/O threads, less the step's waits for reads and writes.",
        "finish s: draining the last writes, fsync and commit (part of step s).",
        (
            f"Goal: of bound (I/O bound / step) >= {NVME_GOAL}: {row['of bound']:.2f}, "
            f"{'met' if details['goal_met'] else 'NOT met'}."
        ),
    ]


SECTIONS: dict[str, Callable[[Setup], Section]] = {
    "host memory": host_memory_section,
    "nvme tier": nvme_tier_section,
}


def _int_or_auto(text: str) -> int | str:
    """An ``[offload]`` size: a whole number, or ``auto`` (sized from the units)."""
    return text if text == "auto" else int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, ``auto`` sizes resolved from the disk's I/O profile and ``--quick`` defaults applied."""
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, help="parameters in host memory (default 50M, --quick 5M)")
    parser.add_argument(
        "--shard-params", type=int, default=4_000_000, help="parameters per shard, like one unit (default 4M)"
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts")
    parser.add_argument("--reps", type=int, help="timed rounds of steps, median (default 7, --quick 3)")
    offload = OffloadConfig()
    nvme_group = parser.add_argument_group("nvme tier")
    nvme_group.add_argument("--nvme-params", type=int, help="parameters on disk (default 200M, --quick 4M)")
    nvme_group.add_argument("--dir", type=Path, default=Path("."), help="directory on the disk to measure (default .)")
    for name, help_ in {
        "buffer_mb": "host staging budget, MiB",
        "chunk_mb": "largest chunk, MiB",
        "io_threads": "threads doing reads and writes",
    }.items():
        default = getattr(offload, name)
        nvme_group.add_argument(
            f"--{name.replace('_', '-')}", type=_int_or_auto, default=default, help=f"{help_} (default {default})"
        )
    parser.add_argument(
        "--state-dtype", choices=["fp32", "bf16", "int8"], default="fp32", help="optim.state_dtype (default fp32)"
    )
    parser.add_argument(
        "--master-dtype", choices=["fp32", "bf16"], default="fp32", help="optim.master_dtype (default fp32)"
    )
    args = parser.parse_args(argv)
    buffer_mb = AUTO_BUFFER_FLOOR_MB if args.buffer_mb == "auto" else args.buffer_mb
    auto = auto_settings(args.dir, max_chunk_mb=min(CHUNK_RANGE[1], max(1, buffer_mb // 3)))
    args.chunk_mb = auto.chunk_mb if args.chunk_mb == "auto" else args.chunk_mb
    args.io_threads = auto.io_threads if args.io_threads == "auto" else args.io_threads
    args.params = args.params or (5_000_000 if args.quick else 50_000_000)
    args.nvme_params = args.nvme_params or (4_000_000 if args.quick else 200_000_000)
    args.reps = args.reps or (3 if args.quick else 7)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    setup_logging(args.verbose)
    params, reps = args.params, args.reps
    memcpy = memcpy_gbps(STATE_BYTES_PER_PARAM // 2 * params)  # source and destination
    nvme = NvmeSetup(args.dir, args.nvme_params, args.buffer_mb, args.chunk_mb, args.io_threads)
    form = StateForm(args.state_dtype, args.master_dtype)
    setup = Setup(params, args.shard_params, tuple(args.threads), reps, memcpy, nvme, form)
    sections = {name: run(setup) for name, run in SECTIONS.items()}

    for name, section in sections.items():
        print_table(f"AdamW step, {name}: {section.title}", section.rows)
        print("\n".join(section.notes))

    memory_rows = sections["host memory"].rows
    bar_chart(
        args.out / "optimizer.png",
        list(optimizers(form)),
        {f"{t} thread{'s' * (t > 1)}": [r["Mparam/s"] for r in memory_rows if r["threads"] == t] for t in args.threads},
        ylabel="Mparam/s",
        title=f"AdamW step, {params / 1e6:g}M fp32 params",
        references={"memory-bandwidth bound": setup.bound_mparams},
    )
    result = {
        "params": params,
        "nvme_params": args.nvme_params,
        "shard_params": setup.shard_params,
        "reps": reps,
        "bytes_per_param": BYTES_PER_PARAM,
        "state_dtype": args.state_dtype,
        "master_dtype": args.master_dtype,
        "memcpy_gbps": memcpy,
        "bound_mparam_per_s": setup.bound_mparams,
        "nvme": {**dataclasses.asdict(nvme), "directory": str(nvme.directory.resolve())},
        "sections": {name: dataclasses.asdict(section) for name, section in sections.items()},
    }
    save_json(args.out, "optimizer", result)
    return result


if __name__ == "__main__":
    main()
