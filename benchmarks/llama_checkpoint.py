"""A Llama-shaped checkpoint (or a Mixtral's) of a given size, written as ``save_pretrained``
shards it with random bf16 weights, one shard in memory at a time: the source a fine-tune
benchmark imports, made here since none can be downloaded."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

from engine.run.pretrained import INDEX_FILE
from engine.runtime.sizes import GIB

WIDTHS = ((3e9, 4096), (3e8, 2048), (1e7, 512), (0, 256))
"""The hidden size by parameters (a mixture of experts' divided by its experts): Llama-3-8B's
4096 from 3B up; heads of 128, a quarter as many key/value heads, a feed-forward of 3.5x."""
EXPERTS, ROUTED = 8, 2
SHARD_BYTES = 2 * GIB


def model_config(params: float, vocab: int, moe: bool, positions: int) -> Any:
    """A Llama (or a Mixtral with ``moe``) of about ``params`` parameters: width from ``WIDTHS``, depth to make up the rest."""
    from transformers import LlamaConfig, MixtralConfig

    hidden = next(h for floor, h in WIDTHS if params / (EXPERTS if moe else 1) >= floor)
    heads, ffn = hidden // 128, hidden * 7 // 2
    layer = 2 * hidden * hidden + 2 * hidden * (hidden // 4) + (EXPERTS if moe else 1) * 3 * hidden * ffn
    layers = max(1, round((params - 2 * vocab * hidden) / layer))
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers)
    shape |= dict(num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=positions)
    if moe:
        return MixtralConfig(**shape, num_local_experts=EXPERTS, num_experts_per_tok=ROUTED)
    return LlamaConfig(**shape)


def meta_of(settings: Any) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(settings, dtype=torch.float32)


def random_values(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """A tensor's random initial values, drawn from its name: norms 1, others N(0, 0.02)."""
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, 0.02, generator=generator).to(dtype)


def write_checkpoint(settings: Any, folder: Path) -> int:
    """Random bf16 weights in ``folder`` as ``save_pretrained`` shards them, one shard in memory
    at a time, with the index and config; the parameters written."""
    from safetensors.torch import save_file

    from engine.run.conversion import stored_tensors

    model = meta_of(settings)  # the tensors save_pretrained writes: names on disk, shapes
    shapes = {name: tuple(t.shape) for name, t in stored_tensors(model, dict(model.state_dict())).items()}
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards, size = [*shards, []], 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for index, names in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: random_values(n, shapes[n], torch.bfloat16) for n in names}, folder / file, {"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    count = sum(torch.Size(s).numel() for s in shapes.values())
    index_record = {"metadata": {"total_size": 2 * count}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index_record, indent=2) + "\n")
    settings.save_pretrained(folder)
    return count
