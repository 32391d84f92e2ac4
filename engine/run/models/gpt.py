"""The built-in model: a GPT-2-style decoder in one readable file.

The model is written so that the engine can build it on the ``meta`` device and
materialise it one unit at a time, however the units are cut. Initialisation is
therefore defined per parameter, from a generator derived from ``(seed, parameter
name)``: the same seed gives the same weights whichever order, process, device or
grouping initialises them.

There is no dropout: training must be deterministic.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.run.loss import loss_through_head

logger = logging.getLogger(__name__)

__all__ = [
    "GPT",
    "Block",
    "GPTConfig",
    "KVCache",
    "init_parameters_",
    "packed_causal_mask",
    "param_generator",
]

INIT_STD = 0.02
HEAD_DIM = 64  # the width per attention head that ``for_params`` keeps

# Nominal sizes are at the byte vocabulary (256), so every preset trains on the
# built-in data as is; a larger vocab_size override adds 1-2 x vocab x d_model.
_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, d_model=64, seq_len=64),  # ~0.24M
    "small": dict(n_layer=6, n_head=4, d_model=256, seq_len=256),  # ~4.9M
    "medium": dict(n_layer=8, n_head=8, d_model=512, seq_len=512),  # ~25M
    "large": dict(n_layer=18, n_head=12, d_model=768, seq_len=1024),  # ~129M
    "1b": dict(n_layer=20, n_head=32, d_model=2048, seq_len=1024),  # ~1.0B
    "3b": dict(n_layer=38, n_head=40, d_model=2560, seq_len=1024),  # ~3.0B
}

_MAX_LAYERS = 256  # the depths ``for_params`` considers
_TARGET_ASPECT = 64.0  # d_model / n_layer of GPT-2 small, a well-trodden shape
_GOOD_FIT = 0.05  # among shapes this close to the target, prefer the best aspect
_MAX_FIT_ERROR = 0.10


def _count_params(vocab_size: int, seq_len: int, n_layer: int, d_model: int, tied: bool) -> int:
    """Parameters of a GPT of this shape; the one formula behind ``num_params`` and ``for_params``."""
    d = d_model
    # ln1, ln2: 2 x 2d; qkv: 3d^2 + 3d; attn proj: d^2 + d; fc: 4d^2 + 4d; mlp proj: 4d^2 + d
    per_block = 12 * d * d + 13 * d
    embeddings = vocab_size * d + seq_len * d
    head = 0 if tied else vocab_size * d
    return embeddings + n_layer * per_block + 2 * d + head


def _nearest_widths(base: GPTConfig, n_layer: int, n_params: float) -> list[int]:
    """The multiples of 64 on either side of the d_model that gives ``n_params`` at this depth.

    The count is ``a d^2 + b d`` in d_model, so the exact width is a root of a quadratic.
    """
    a = 12 * n_layer
    b = 13 * n_layer + base.vocab_size * (1 if base.tie_embeddings else 2) + base.seq_len + 2
    exact = (-b + math.sqrt(b * b + 4 * a * n_params)) / (2 * a)
    below = max(HEAD_DIM, int(exact // HEAD_DIM) * HEAD_DIM)
    return [below, below + HEAD_DIM]


@dataclass
class GPTConfig:
    """The shape of a GPT; presets and ``for_params`` build the common ones."""

    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}): "
                f"pick n_head among {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named size: tiny (~0.24M, tests), small (~4.9M, the default), medium (~25M),
        large (~129M), 1b, 3b. Overrides replace any field."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}: choose one of {', '.join(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def for_params(cls, n_params: float, **overrides: Any) -> GPTConfig:
        """A config with about ``n_params`` parameters (within 10%).

        Searches n_layer and d_model (a multiple of 64, n_head = d_model // 64) for
        the shapes within 5% of the target and keeps the one whose d_model / n_layer
        is closest to GPT-2's 64, so that sizes scale like known-good models.
        Fields given in ``overrides`` are held fixed; vocab_size, seq_len and
        tie_embeddings count towards the total.
        """
        if n_params <= 0:
            raise ValueError(f"GPTConfig.for_params needs a positive parameter count, got {n_params}")
        base = replace(cls(), **{k: v for k, v in overrides.items() if k not in ("n_layer", "d_model", "n_head")})
        layers = [overrides["n_layer"]] if "n_layer" in overrides else range(1, _MAX_LAYERS + 1)
        candidates = []
        for n_layer in layers:
            widths = [overrides["d_model"]] if "d_model" in overrides else _nearest_widths(base, n_layer, n_params)
            for d_model in widths:
                count = _count_params(base.vocab_size, base.seq_len, n_layer, d_model, base.tie_embeddings)
                error = abs(count - n_params) / n_params
                aspect = abs(math.log(d_model / n_layer / _TARGET_ASPECT))
                candidates.append((error, aspect, n_layer, d_model))
        good = [c for c in candidates if c[0] <= _GOOD_FIT]
        error, _, n_layer, d_model = min(good, key=lambda c: c[1]) if good else min(candidates)
        if error > _MAX_FIT_ERROR:
            raise ValueError(
                f"no GPT shape has about {n_params:.3g} parameters with {overrides or 'the defaults'} "
                f"(closest is {error:.0%} off): ask for a larger size or a smaller vocab_size/seq_len"
            )
        n_head = overrides.get("n_head", max(1, d_model // HEAD_DIM))
        config = replace(base, n_layer=n_layer, d_model=d_model, n_head=n_head)
        logger.debug("for_params(%.3g) -> %s with %d parameters", n_params, config, config.num_params())
        return config

    def num_params(self) -> int:
        """The exact parameter count of ``GPT(self)``, without building it (a tied weight counts once)."""
        return _count_params(self.vocab_size, self.seq_len, self.n_layer, self.d_model, self.tie_embeddings)


class LayerCache:
    """One block's keys and values of the positions fed so far, ``[batch, head, position,
    head_dim]``, in buffers of ``seq_len`` positions allocated on first use (no copy per token)."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' keys and values; every position's so far."""
        if self.keys is None or self.values is None:
            shape = (*k.shape[:2], self.seq_len, k.shape[3])
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        end = self.length + k.shape[2]
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every block's keys and values of the positions a decode has fed so far: with it, each
    new token's forward computes that position alone (``GPT.forward(idx, cache=...)``)."""

    def __init__(self, config: GPTConfig) -> None:
        self.layers = [LayerCache(config.seq_len) for _ in range(config.n_layer)]

    @property
    def length(self) -> int:
        """Positions held."""
        return self.layers[0].length


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through the fused SDPA kernel."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``mask`` (``packed_causal_mask``), if given, says which positions each one sees:
        packed examples each see only their own, causally. Without it (and without a cache's
        past), attention is plainly causal."""
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # [batch, seq, width] -> [batch, head, seq, head_dim]
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.append(k, v)
        if past:  # the new positions see every cached one, and each other causally
            mask = torch.ones(seq, past + seq, dtype=torch.bool, device=x.device).tril(diagonal=past)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """The position-wise feed-forward layer, 4x wide."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: the engine's natural unit."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only language model.

    Built normally it is initialised from ``seed``; built under
    ``torch.device("meta")`` it holds no memory and is left for the caller to
    materialise and initialise unit by unit with :func:`init_parameters_`, which
    gives the same weights.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        if not self.tok_emb.weight.is_meta:  # a meta model is initialised later, unit by unit
            self.reset_parameters(seed)

    def tie_weights(self) -> None:
        """Share the embedding with the head when configured; needed again after
        ``to_empty``, which gives every parameter its own new tensor."""
        if self.config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def reset_parameters(self, seed: int = 0) -> None:
        """Initialise every parameter from its own generator (see :func:`init_parameters_`)."""
        init_parameters_(dict(self.named_parameters()), self.config, seed)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``, or the mean cross-entropy loss (fp32) over the targets
        that are not -100 if ``targets`` is given, computed a chunk of tokens at a time
        (``chunked_cross_entropy`` through the head module, ``loss_through_head``: the loss's logits never exist whole).
        With ``cache`` (decoding), ``idx`` holds the positions after those the cache holds, and
        their keys and values are added to it. With ``positions`` (``[batch, seq]``, packed
        examples: each starts where its position is 0), each token is embedded at its position
        and attends only to the earlier tokens of its own example."""
        if isinstance(cache, torch.Tensor):
            raise TypeError("GPT.forward got a tensor as its cache: pass packed positions by keyword, positions=...")
        if positions is not None and cache is not None:
            raise ValueError("GPT.forward takes positions (packed training) or cache (decoding), not both: pass one")
        past = cache.length if cache is not None else 0
        seq = past + idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"input has {seq} positions but GPTConfig.seq_len is {self.config.seq_len}: "
                f"crop the input or build the model with seq_len >= {seq}"
            )
        mask = None
        if positions is None:
            positions = torch.arange(past, seq, device=idx.device)
        else:
            mask = packed_causal_mask(positions, idx.shape)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for index, block in enumerate(self.blocks):
            if cache is not None:
                x = block(x, cache.layers[index])
            else:
                x = block(x) if mask is None else block(x, mask=mask)
        x = self.ln_f(x)
        if targets is None:
            return self.head(x)
        return loss_through_head(self.head, x, targets)


def packed_causal_mask(positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The attention mask of rows of packed examples, ``[batch, 1, seq, seq]`` (True: may
    attend): block-diagonal and causal, an example starting wherever its position is 0 (what
    comes before a row's first 0 is an example of its own)."""
    if positions.shape != shape:
        raise ValueError(
            f"positions of shape {tuple(positions.shape)} do not match the input's {tuple(shape)}: give one "
            f"position per token, counting from 0 in each packed example"
        )
    example = (positions == 0).cumsum(dim=1)
    same = example.unsqueeze(2) == example.unsqueeze(1)
    causal = torch.ones(shape[1], shape[1], dtype=torch.bool, device=positions.device).tril()
    return (same & causal).unsqueeze(1)


def param_generator(seed: int, name: str) -> torch.Generator:
    """The generator that initialises parameter ``name`` of a model seeded with ``seed``.

    ``SeedSequence`` mixes the pair so parameters get unrelated streams.
    """
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    state = np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed((int(state[0]) << 31) ^ int(state[1]))


def init_parameters_(params: dict[str, torch.Tensor], config: GPTConfig, seed: int) -> None:
    """Initialise the named parameters of a GPT in place: any subset, in any order.

    Weights are normal(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer) as in
    GPT-2, biases zero, LayerNorms identity. Values are drawn in fp32 on the CPU and
    copied in, so the weights are the same on any device and in any dtype (rounded to it).
    """
    residual_std = INIT_STD / math.sqrt(2 * config.n_layer)
    with torch.no_grad():
        for name, tensor in params.items():
            module, leaf = name.rsplit(".", 1)
            if module.rsplit(".", 1)[-1] in ("ln1", "ln2", "ln_f"):
                tensor.fill_(1.0) if leaf == "weight" else tensor.zero_()
            elif leaf == "bias":
                tensor.zero_()
            elif module.endswith(("attn.proj", "mlp.proj")):
                _normal_(tensor, residual_std, param_generator(seed, name))
            elif leaf == "weight":
                _normal_(tensor, INIT_STD, param_generator(seed, name))
            else:
                raise ValueError(f"{name!r} is not a parameter of a GPT")


def _normal_(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    tensor.copy_(values)
