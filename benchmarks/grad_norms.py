"""What widening bf16 gradients costs their norm: each parameter's norm over a Llama's decoder
layers, as one rank takes it of its spilled bf16 gradients (`engine.zero.optim.piece_norms`),
widened to fp32 by torch in fresh memory against in the thread's scratch (the engine's), timed
in turn in one process under the engine's heap, the two compared bit for bit.

    python -m benchmarks.grad_norms [--quick] [--params N] [--rounds R]

Under `engine.runtime.heap.tune_heap` (as `python -m engine train` runs) every fp32 copy torch
makes of a piece of 1 MiB or more is mapped fresh and faults in page by page; the scratch is
written over. The pieces are one layer's, listed once a layer: every layer's are alike in size,
and a layer's bf16 gradients already outgrow the last-level cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine.runtime.heap import tune_heap

tune_heap()  # before torch allocates: the heap the engine trains under

import torch  # noqa: E402

from benchmarks.llama_checkpoint import meta_of, model_config  # noqa: E402
from benchmarks.report import base_parser, print_table, save_json, setup_logging  # noqa: E402
from benchmarks.sft import TOKENIZER_VOCAB  # noqa: E402
from engine.zero.optim import piece_norms  # noqa: E402

Norms = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def by_torch(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The norms as one foreach pass that widens each piece into a temporary of its own."""
    return list(torch._foreach_norm(pieces, 2.0, dtype=torch.float32))


WAYS: dict[str, Norms] = {"widened by torch (fresh memory)": by_torch, "widened in scratch (the engine's)": piece_norms}


def layer_gradients(params: float) -> tuple[list[torch.Tensor], int]:
    """Random bf16 gradients shaped as one decoder layer's parameters, and the layer count."""
    settings = model_config(params, TOKENIZER_VOCAB, False, positions=512)
    layer = meta_of(settings).model.layers[0]
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16) for p in layer.parameters()]
    return grads, settings.num_hidden_layers


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, help="the Llama's parameters (default 2e9; --quick 2e7)")
    parser.add_argument("--rounds", type=int, help="the two ways run in turn this many times (default 3; --quick 1)")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    params, rounds = args.params or (2e7 if args.quick else 2e9), args.rounds or (1 if args.quick else 3)
    grads, layers = layer_gradients(params)
    pieces = grads * layers
    seconds: dict[str, list[float]] = {name: [] for name in WAYS}
    norms: dict[str, list[torch.Tensor]] = {}
    for _ in range(rounds):
        for name, way in WAYS.items():
            start = time.perf_counter()
            norms[name] = way(pieces)
            seconds[name].append(time.perf_counter() - start)
    same = all(map(torch.equal, *norms.values()))
    elements = sum(p.numel() for p in pieces)
    base = min(next(iter(seconds.values())))
    rows = [
        {
            "widening": name,
            "s (fastest round)": min(done),
            "x torch's": min(done) / base,
            "each round s": " ".join(f"{s:.3f}" for s in done),
            "bf16 GB/s": 2 * elements / min(done) / 1e9,
        }
        for name, done in seconds.items()
    ]
    print_table(f"norms of {len(pieces)} bf16 gradients, {elements / 1e9:.2f}B elements (bit for bit: {same})", rows)
    payload = {"params": params, "layers": layers, "elements": elements, "rounds": rounds, "same_bits": same}
    payload |= {"rows": rows, "seconds": seconds}
    save_json(args.out, "grad_norms", payload)
    return payload


if __name__ == "__main__":
    main()
