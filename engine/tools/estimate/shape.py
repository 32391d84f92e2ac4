"""The run an estimate is for: the model's shape, the engine's own layout of it, the config,
and the plans (ZeRO stage and tiers) it is estimated under."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import Config, ConfigError, Tier
from engine.run.data import TOKEN_SUFFIX, ByteTokenizer, load_tokens
from engine.run.models.gpt import GPT, HEAD_DIM, GPTConfig
from engine.run.train import build_model
from engine.tiers.store_io import settle_io
from engine.zero.partition import ModelLayout, build_layout, find_units, max_chunk_numel, unit_parameters
from engine.zero.precision import compute_dtype

TIER_ORDER: tuple[tuple[Tier, Tier], ...] = (
    ("device", "device"),
    ("cpu", "device"),
    ("cpu", "cpu"),
    ("nvme", "device"),
    ("nvme", "cpu"),
    ("nvme", "nvme"),
)
"""(optimizer, param) tiers from least to most offload: host memory before disk, and the
optimizer state (touched once a step) before the parameters (fetched every micro-batch)."""


@dataclass(frozen=True)
class Plan:
    """The stage and tiers ``--plan auto`` chooses among."""

    stage: int
    optimizer: Tier
    param: Tier = "device"

    def apply(self, config: Config) -> Config:
        """A copy of ``config`` with this plan's stage and tiers."""
        zero = dataclasses.replace(config.zero, stage=self.stage)
        offload = dataclasses.replace(config.offload, optimizer=self.optimizer, param=self.param)
        planned = dataclasses.replace(config, zero=zero, offload=offload)
        planned.validate()
        return planned

    def __str__(self) -> str:
        return f"stage {self.stage}, optimizer {self.optimizer}, param {self.param}"


def all_plans() -> list[Plan]:
    """Every valid plan, in ``TIER_ORDER`` and then by stage (parameter tiers need stage 3)."""
    return [
        Plan(stage, optimizer, param)
        for optimizer, param in TIER_ORDER
        for stage in (1, 2, 3)
        if param == "device" or stage == 3
    ]


def plan_of(config: Config) -> Plan:
    return Plan(config.zero.stage, config.offload.optimizer, config.offload.param)


@dataclass(frozen=True)
class RunShape:
    """What the terms need to know of a run: the model, its layout and the config."""

    gpt: GPTConfig
    layout: ModelLayout
    config: Config
    io: str = ""
    """The I/O settings the run would use, and why (``engine.tiers.store_io.settle_io``)."""

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: of the parameters, gathered units and activations."""
        return compute_dtype(self.config.precision.compute_dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per compute-dtype element."""
        return self.dtype.itemsize

    @property
    def padded(self) -> int:
        return sum(u.padded_numel for u in self.layout.units)

    @property
    def shard(self) -> int:
        return sum(u.shard_numel for u in self.layout.units)

    @property
    def largest_unit(self) -> int:
        return max(u.padded_numel for u in self.layout.units)

    @property
    def largest_shard(self) -> int:
        return max(u.shard_numel for u in self.layout.units)

    @property
    def largest_param(self) -> int:
        return max(slot.numel for u in self.layout.units for slot in u.params)


def vocab_size(config: Config) -> int:
    """The vocabulary ``python -m engine train`` would build the model with, without tokenising:
    a token file's own (its sidecar), 256 for bytes, ``data.vocab_size`` for a BPE (an upper
    bound: the trained BPE may come out smaller)."""
    if config.data.source.endswith(TOKEN_SUFFIX):
        return load_tokens(config.data.source)[1]
    return ByteTokenizer.vocab_size if config.data.tokenizer == "bytes" else config.data.vocab_size


def gpt_of(config: Config) -> GPTConfig:
    """The GPT shape ``python -m engine train`` builds for ``config``."""
    with torch.device("meta"):
        return build_model(config, vocab_size(config)).config


def gpt_shape(config: Config, params: float = 0, layers: int | None = None, hidden: int | None = None) -> GPTConfig:
    """The config's model, or the one ``params`` (about that many parameters), ``layers`` and
    ``hidden`` (d_model) describe, with the config's vocabulary and sequence length."""
    if not params and layers is None and hidden is None:
        return gpt_of(config)
    shape: dict[str, Any] = {
        "vocab_size": vocab_size(config),
        "seq_len": config.data.seq_len,
        "tie_embeddings": config.model.tie_embeddings,
    }
    fixed = {key: value for key, value in (("n_layer", layers), ("d_model", hidden)) if value is not None}
    if params:
        return GPTConfig.for_params(params, **shape, **fixed)
    if layers is None or hidden is None:
        raise ConfigError("give --layers and --hidden together, or --params N (with either of them to hold it fixed)")
    heads = next(h for h in range(max(1, hidden // HEAD_DIM), 0, -1) if hidden % h == 0)
    return GPTConfig(n_layer=layers, d_model=hidden, n_head=heads, **shape)


def run_shape(config: Config, world_size: int, gpt: GPTConfig | None = None) -> RunShape:
    """The engine's layout of ``gpt`` (default: the config's model) on ``world_size`` ranks,
    from a model built on the meta device (no memory, any size)."""
    if world_size < 1:
        raise ConfigError(f"world size = {world_size}: must be >= 1 (the number of ranks on this node)")
    gpt = gpt or gpt_of(config)
    config, io = settle_io(config, resume=True, measure=False)  # `train` resumes a store that is there
    with torch.device("meta"):
        model = GPT(gpt)
    units = find_units(model, config.zero.unit_classes)
    layout = build_layout(unit_parameters(model, units), world_size, max_chunk_numel(config.offload.chunk_mb))
    return RunShape(gpt, layout, config, io)
