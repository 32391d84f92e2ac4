"""A training step's forward and backward with nothing to fetch: the compute floor a step's
bound takes beside the disk's.

A model larger than RAM cannot run whole, so one decoder block is timed and multiplied by the
depth, plus the root (embedding, final norm, head and loss), on the device the engine computes
on and in its dtype: on a CPU without bf16 matrix units the same step in bf16 takes ~70x as
long, and a floor timed on another device or in another dtype than the run's bounds nothing.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from engine.config import Config
from engine.run.models.gpt import Block, GPTConfig
from engine.runtime.detect import detect_device
from engine.runtime.native_dtype import settle_compute_dtype
from engine.state.dtypes import compute_dtype

Mode = Literal["train", "recompute", "forward"]
"""A training step's work, the same with each block's forward run again in backward
(``zero.activation_checkpointing``), or a validation's forward."""
BlockCall = Callable[[torch.Tensor], torch.Tensor]


def run_dtype(config: Config) -> torch.dtype:
    """The dtype a run of ``config`` computes in, ``auto`` settled as the engine settles it."""
    return compute_dtype(settle_compute_dtype(config).precision.compute_dtype)


def compute_device() -> torch.device:
    """Where a run computes (``engine.runtime.detect``): the accelerator if there is one."""
    return detect_device().device


def timed(fn: Callable[[], None], reps: int) -> float:
    """The median seconds of ``reps`` calls after one warm-up (kernels and allocations), each
    until an accelerator has run what it queued."""

    def call() -> None:
        fn()
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def root_seconds(vocab: int, width: int, tokens: torch.Size, dtype: torch.dtype, mode: Mode, reps: int) -> float:
    """The embedding, final norm, head and loss, in ``mode`` (the root is never recomputed)."""
    emb = torch.nn.Embedding(vocab, width, dtype=dtype)
    head = torch.nn.Linear(width, vocab, bias=False, dtype=dtype)
    idx = torch.randint(0, vocab, tokens)

    def run_root() -> None:
        with torch.set_grad_enabled(mode != "forward"):
            loss = F.cross_entropy(head(F.layer_norm(emb(idx), (width,))).float().flatten(0, 1), idx.flatten())
        if mode != "forward":
            loss.backward()
            emb.zero_grad(set_to_none=True)
            head.zero_grad(set_to_none=True)

    return timed(run_root, reps)


def block_seconds(
    layer: torch.nn.Module, block: BlockCall, shape: tuple[int, ...], dtype: torch.dtype, mode: Mode, reps: int
) -> float:
    """One block's work in ``mode`` (``block`` calls ``layer``): forward and backward, with its
    forward run twice where activations are recomputed, or a validation's forward alone. Each
    rep's gradients are new, as a step's are."""

    def run_block() -> None:
        x = torch.randn(shape, dtype=dtype, requires_grad=mode != "forward")
        if mode == "forward":
            with torch.no_grad():
                block(x)
            return
        out = checkpoint(block, x, use_reentrant=False) if mode == "recompute" else block(x)
        out.float().sum().backward()
        layer.zero_grad(set_to_none=True)

    return timed(run_block, reps)


def gpt_compute_seconds(gpt: GPTConfig, micro_batch: int, dtype: torch.dtype, reps: int) -> float:
    """The built-in GPT's step: one block timed, times the depth, plus the root."""
    torch.manual_seed(0)
    with torch.device(compute_device()):
        block = Block(gpt).to(dtype)
        tokens = torch.Size((micro_batch, gpt.seq_len))
        one = block_seconds(block, block, (*tokens, gpt.d_model), dtype, "train", reps)
        return gpt.n_layer * one + root_seconds(gpt.vocab_size, gpt.d_model, tokens, dtype, "train", reps)


def hf_compute_seconds(
    settings: Any, tokens: torch.Size, dtype: torch.dtype, modes: tuple[Mode, ...], reps: int
) -> dict[Mode, float]:
    """A Hugging Face decoder's step (a Llama's, a Mixtral's) from its config, in each of
    ``modes``: one decoder layer built on the run's device with its rotary embedding, timed,
    times the depth, plus the root."""
    from transformers import AutoModelForCausalLM

    settings = copy.deepcopy(settings)
    settings._attn_implementation = "sdpa"  # what from_pretrained picks on a CPU
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(settings)
    torch.manual_seed(0)
    with compute_device():
        layer = type(meta.model.layers[0])(settings, 0).to(dtype)
        positions = torch.arange(tokens[1]).expand(tokens)
        hidden = (*tokens, settings.hidden_size)
        embeddings = type(meta.model.rotary_emb)(settings)(torch.empty(hidden, dtype=dtype), positions)

        def block(x: torch.Tensor) -> torch.Tensor:
            out = layer(x, position_embeddings=embeddings, position_ids=positions)
            return out[0] if isinstance(out, tuple) else out

        def seconds(mode: Mode) -> float:
            one = block_seconds(layer, block, hidden, dtype, mode, reps)
            root = root_seconds(settings.vocab_size, settings.hidden_size, tokens, dtype, mode, reps)
            return settings.num_hidden_layers * one + root

        return {mode: seconds(mode) for mode in modes}
