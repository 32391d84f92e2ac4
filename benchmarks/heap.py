"""What the process's heap setting costs a step's compute: a whole Llama shaped as the
fine-tune's (`benchmarks.finetune`, at a size that fits in memory with its gradients) trained a
few steps in the run's dtype, each layer recomputed as the fine-tune does, in a fresh process per
setting, in turn over `--rounds`: glibc's own heap, and the engine's
(`engine.runtime.heap.tune_heap`: every buffer of `--thresholds-mb` MiB or more mapped on its
own, 256 MiB being `python -m engine train`'s, smaller ones kept for reuse within the bound of
`engine.runtime.heap_bound` set for the model's largest weight, with torch's huge pages on).

    python -m benchmarks.heap [--quick] [--params N] [--thresholds-mb T ...] [--rounds R] [--reps K]

A buffer mapped on its own is returned to the system when freed, so the resident set is what
is live; the next buffer of its size is fresh memory, and its first touch faults page by page.
A step's matmuls make and free temporaries the size of their weights (and their weights'
gradients) many times over, so what the setting costs shows in the compute alone, with no
engine buffers at all. glibc's own heap keeps freed buffers up to 32 MiB (its threshold rises
to the largest one freed) and reuses them, larger ones mapped, and it keeps them without bound. One
layer timed again and again (`benchmarks.compute_only`) reuses its few sizes and hides most of
this: the whole model is timed.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from engine.runtime import heap_bound
from engine.runtime.heap import MMAP_THRESHOLD, TORCH_HUGE_PAGES, tune_heap

GLIBC = "glibc"
"""The setting that leaves the heap as the C library makes it."""


def step_seconds(params: float, setting: str, reps: int) -> dict[str, Any]:
    """In this process, made fresh for it: ``setting`` (``GLIBC``, or a threshold in MiB) before
    torch is imported (it reads its huge-page switch at its first allocation), then the whole
    model's median step and the process's resident high-water mark."""
    tuned = setting != GLIBC and tune_heap(int(setting) << 20)
    from benchmarks.compute_only import run_dtype, timed
    from benchmarks.llama_checkpoint import model_config
    from benchmarks.sft import TOKENIZER_VOCAB
    from engine.config import Config
    from engine.runtime.rss import peak_rss_bytes

    dtype = run_dtype(Config())
    seconds = timed(whole_step(model_config(params, TOKENIZER_VOCAB, False, positions=512), dtype), reps)
    huge = os.environ.get(TORCH_HUGE_PAGES) == "1"
    bound = heap_bound.bound_process_heap() if tuned else None
    return {"seconds": seconds, "dtype": str(dtype).removeprefix("torch."), "peak_rss_bytes": peak_rss_bytes()} | {
        "mapped_from_mb": int(setting) if tuned else None,
        "huge_pages": huge,
        "kept_mb": bound.keep >> 20 if bound else None,
        "trims": bound.trims if bound else None,
    }


def whole_step(settings: Any, dtype: Any) -> Callable[[], None]:
    """One training step of the whole model on 256 tokens, each decoder layer's forward run
    again in its backward (``torch.utils.checkpoint``, as ``zero.activation_checkpointing``)."""
    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers import AutoModelForCausalLM

    settings._attn_implementation = "sdpa"  # what from_pretrained picks on a CPU
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(settings, dtype=dtype)
    heap_bound.keep_for(max(p.numel() for p in model.parameters()) * dtype.itemsize)  # as the engine's largest unit
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    tokens = torch.randint(0, settings.vocab_size, (1, 256))

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def measured(params: float, setting: str, reps: int) -> dict[str, Any]:
    """``step_seconds`` in a child process: a heap setting holds for the whole process."""
    command = [sys.executable, "-m", "benchmarks.heap", "--child", setting, "--params", str(params)]
    env = {key: value for key, value in os.environ.items() if key != TORCH_HUGE_PAGES}  # glibc's run: torch's own
    done = subprocess.run([*command, "--reps", str(reps)], capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the {setting} run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # before anything imports torch
        params, reps = float(argv[argv.index("--params") + 1]), int(argv[argv.index("--reps") + 1])
        print(json.dumps(step_seconds(params, argv[1], reps)))
        return {}
    from benchmarks.report import base_parser, print_table, save_json, setup_logging

    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, help="the Llama's parameters (default 2e9; --quick 2e7)")
    parser.add_argument(
        "--thresholds-mb",
        type=int,
        nargs="+",
        default=[1, MMAP_THRESHOLD >> 20],
        help=f"MiB from which buffers are mapped on their own (default 1, and {MMAP_THRESHOLD >> 20}, the engine's)",
    )
    parser.add_argument("--rounds", type=int, help="settings run in turn this many times (default 2; --quick 1)")
    parser.add_argument("--reps", type=int, help="timed steps a run, after one (default 3; --quick 1)")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    params = args.params or (2e7 if args.quick else 2e9)
    rounds, reps = args.rounds or (1 if args.quick else 2), args.reps or (1 if args.quick else 3)
    settings = [GLIBC, *map(str, args.thresholds_mb)]
    runs = {setting: [] for setting in settings}
    for _ in range(rounds):
        for setting in settings:
            runs[setting].append(measured(params, setting, reps))
    base = min(run["seconds"] for run in runs[GLIBC])
    rows = [
        {
            "heap": "glibc's own"
            if setting == GLIBC
            else f"mapped from {setting} MiB, kept within {done[0]['kept_mb']} MiB",
            "step s (fastest round)": min(run["seconds"] for run in done),
            "x glibc": min(run["seconds"] for run in done) / base,
            "each round s": " ".join(f"{run['seconds']:.2f}" for run in done),
            "peak RSS GiB": max(run["peak_rss_bytes"] for run in done) / 2**30,
        }
        for setting, done in runs.items()
    ]
    dtype = runs[GLIBC][0]["dtype"]
    print_table(f"a step of a whole {params / 1e9:.2f}B Llama in {dtype}, by the heap's setting", rows)
    payload = {"params": params, "dtype": dtype, "rounds": rounds, "reps": reps, "rows": rows, "runs": runs}
    save_json(args.out, "heap", payload)
    return payload


if __name__ == "__main__":
    main()
