"""AdamW step throughput: our shard optimizer against torch's AdamW and against memory bandwidth.

    python -m benchmarks.optimizer [--quick] [--params N]

The engine updates flat fp32 shards one unit at a time with `ShardAdamW`; this
measures that (both kernels) against `torch.optim.AdamW` (fused, foreach and
for-loop) stepping separate tensors of the same sizes, on one and two threads.

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

Each section returns its own rows, so more can follow (e.g. the same step with
its state streamed from disk).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.bandwidth import interleaved_medians, memcpy_gbps
from benchmarks.report import Row, bar_chart, base_parser, print_table, save_json, setup_logging
from engine.config import OptimConfig
from engine.optim import ShardAdamW

BYTES_PER_PARAM = 28  # fp32: read p, g, m, v; write p, m, v
STATE_BYTES_PER_PARAM = 16  # fp32 p, g, m, v

Step = Callable[[], None]


@dataclass(frozen=True)
class Setup:
    """What every section measures on: the sizes, the repetitions and the bound."""

    params: int
    shard_params: int
    threads: tuple[int, ...]
    reps: int
    bound_mparams: float
    """Parameters per second (millions) at the memory-bandwidth bound."""

    def shard_sizes(self) -> list[int]:
        full, rest = divmod(self.params, self.shard_params)
        return [self.shard_params] * full + ([rest] if rest else [])


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


def shard_adamw_step(sizes: list[int], kernel: str) -> Step:
    """One engine optimizer step: `ShardAdamW.update` on each flat shard in turn."""
    config = OptimConfig(kernel=kernel)
    opt = ShardAdamW(config)
    shards = [
        (p, g, torch.zeros_like(p), torch.zeros_like(p), opt.new_step_counter(p.device))
        for p, g in _params_and_grads(sizes)
    ]

    def step() -> None:
        for shard in shards:
            opt.update(*shard, lr=config.lr)

    return step


def torch_adamw_step(sizes: list[int], **flags: bool) -> Step:
    """One `torch.optim.AdamW` step over separate tensors, with the engine's hyperparameters."""
    params = []
    for p, g in _params_and_grads(sizes):
        param = torch.nn.Parameter(p)
        param.grad = g
        params.append(param)
    config = OptimConfig()
    opt = torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, **flags
    )
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


def host_memory_section(setup: Setup) -> list[Row]:
    """Every optimizer with its state in host memory: the compute side of a step.

    All optimizers are built at once (16 bytes of state per parameter each) so
    that their steps can interleave, round after round.
    """
    sizes = setup.shard_sizes()
    steps = {
        name: build(sizes) for name, build in tqdm(OPTIMIZERS.items(), desc="building", unit="optimizer")
    }
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
    return rows


SECTIONS: dict[str, Callable[[Setup], list[Row]]] = {"host memory": host_memory_section}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, help="parameters (default 50M, --quick 5M)")
    parser.add_argument(
        "--shard-params", type=int, default=4_000_000, help="parameters per shard, like one unit (default 4M)"
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts")
    parser.add_argument("--reps", type=int, help="timed rounds of steps, median (default 7, --quick 3)")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    params = args.params or (5_000_000 if args.quick else 50_000_000)
    reps = args.reps or (3 if args.quick else 7)

    memcpy = memcpy_gbps(STATE_BYTES_PER_PARAM // 2 * params)  # source and destination
    bound = 2 * memcpy * 1e9 / BYTES_PER_PARAM / 1e6
    setup = Setup(params, min(args.shard_params, params), tuple(args.threads), reps, bound)
    sections = {name: run(setup) for name, run in SECTIONS.items()}

    for name, rows in sections.items():
        print_table(
            f"AdamW step, {name}: {params / 1e6:g}M fp32 params in {len(setup.shard_sizes())} shards, "
            f"median of {reps} steps",
            rows,
        )
    print(
        f"\nMemory-bandwidth bound: memcpy {memcpy:.2f} GB/s copied = {2 * memcpy:.2f} GB/s moved; "
        f"/ {BYTES_PER_PARAM} B per param = {bound:.0f} Mparam/s"
    )

    memory_rows = sections["host memory"]
    bar_chart(
        args.out / "optimizer.png",
        list(OPTIMIZERS),
        {
            f"{t} thread{'s' * (t > 1)}": [r["Mparam/s"] for r in memory_rows if r["threads"] == t]
            for t in args.threads
        },
        ylabel="Mparam/s",
        title=f"AdamW step, {params / 1e6:g}M fp32 params",
        references={"memory-bandwidth bound": bound},
    )
    result = {
        "params": params,
        "shard_params": setup.shard_params,
        "reps": reps,
        "bytes_per_param": BYTES_PER_PARAM,
        "memcpy_gbps": memcpy,
        "bound_mparam_per_s": bound,
        "sections": sections,
    }
    save_json(args.out, "optimizer", result)
    return result


if __name__ == "__main__":
    main()
