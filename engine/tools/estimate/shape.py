"""The run an estimate is for: the model's shape, the engine's own layout of it, the config,
and the plans (ZeRO stage and tiers) it is estimated under.

The model is the built-in GPT the config describes, the Hugging Face model of ``model.hf``
(built from its ``config.json`` alone, on the meta device: no weights are read), or any
``nn.Module`` (``run_shape(config, world, model=module)``, best built on the meta device)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.build import units_layout
from engine.config import Config, ConfigError, OffloadConfig, Tier, spills_gradients
from engine.run.data import TOKEN_SUFFIX, ByteTokenizer, load_tokens
from engine.run.models.gpt import GPT, HEAD_DIM, GPTConfig
from engine.run.train import build_model
from engine.runtime.native_dtype import settle_compute_dtype
from engine.state.dtypes import compute_dtype
from engine.state.forms import StateForm
from engine.state.partition import ROOT_UNIT, ModelLayout, find_units
from engine.tiers.store_io import settle_io

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
        """A copy of ``config`` with this plan's stage and tiers, validated (a ``ConfigError``
        says why the engine would refuse it)."""
        planned = self.laid_over(config)
        planned.validate()
        return planned

    def laid_over(self, config: Config) -> Config:
        """A copy of ``config`` with this plan's stage and tiers, not validated: what the
        estimate sizes, even for a plan the engine refuses (``refusal`` says why)."""
        zero = dataclasses.replace(config.zero, stage=self.stage)
        offload = dataclasses.replace(config.offload, optimizer=self.optimizer, param=self.param)
        if offload.grad_spill is True and (not offload.optimizer_in_store or self.stage < 2):
            offload = dataclasses.replace(offload, grad_spill="auto")  # a plan that cannot spill keeps its shards
        planned = dataclasses.replace(config, zero=zero, offload=offload)
        if not spills_gradients(planned):  # nor does it store spilled shards in any dtype
            planned = dataclasses.replace(planned, offload=dataclasses.replace(offload, grad_spill_dtype="fp32"))
        return planned

    @property
    def tiers(self) -> OffloadConfig:
        """The plan's tiers as an ``[offload]`` section, which says where each kind of state lives."""
        return OffloadConfig(optimizer=self.optimizer, param=self.param)

    def __str__(self) -> str:
        return f"stage {self.stage}, optimizer {self.optimizer}, param {self.param}"


def all_plans() -> list[Plan]:
    """Every valid plan, in ``TIER_ORDER`` and then by stage (parameter tiers need stage 3)."""
    plans = [Plan(stage, optimizer, param) for optimizer, param in TIER_ORDER for stage in (1, 2, 3)]
    return [plan for plan in plans if plan.tiers.params_on_device or plan.stage == 3]


def plan_of(config: Config) -> Plan:
    return Plan(config.zero.stage, config.offload.optimizer, config.offload.param)


@dataclass(frozen=True)
class ModelShape:
    """What the activation estimate knows of a transformer: its depth, width, heads, vocabulary,
    sequence length and feed-forward width; 0 where a module does not say (no estimate)."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    ffn: int
    """The feed-forward layer's inner width a token passes through (4 x d_model in the built-in
    GPT; the routed experts' and any shared expert's together in a mixture of experts)."""

    @classmethod
    def of_gpt(cls, gpt: GPTConfig) -> ModelShape:
        return cls("GPT", gpt.n_layer, gpt.d_model, gpt.n_head, gpt.vocab_size, gpt.seq_len, 4 * gpt.d_model)


SHAPE_NAMES = {
    "n_layer": ("num_hidden_layers", "n_layer", "num_layers"),
    "d_model": ("hidden_size", "n_embd", "d_model"),
    "n_head": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
}
"""Where a Hugging Face config keeps each of ``ModelShape``'s numbers, by model family."""


def module_shape(model: nn.Module, seq_len: int, blocks: int) -> ModelShape:
    """The shape of ``model``: from its Hugging Face ``config`` where it has one, else guessed
    from its largest embedding (vocabulary and width) and its ``blocks`` units."""
    settings = getattr(model, "config", None)
    found: dict[str, int] = {}
    for key, names in SHAPE_NAMES.items():
        value = next((getattr(settings, n) for n in names if isinstance(getattr(settings, n, None), int)), 0)
        found[key] = value
    if not found["d_model"] or not found["vocab_size"]:
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        if embeddings:
            largest = max(embeddings, key=lambda m: m.weight.numel())
            found["vocab_size"], found["d_model"] = largest.num_embeddings, largest.embedding_dim
    d_model = found["d_model"]
    return ModelShape(
        name=type(model).__name__,
        n_layer=found["n_layer"] or blocks,
        d_model=d_model,
        n_head=found["n_head"] or max(1, d_model // HEAD_DIM),
        vocab_size=found["vocab_size"],
        seq_len=seq_len,
        ffn=_active_ffn(settings, found["ffn"]) or 4 * d_model,
    )


def _active_ffn(settings: Any, ffn: int) -> int:
    """The feed-forward width a token passes through: in a mixture of experts, that of the
    experts it is routed to (``num_experts_per_tok``) and of any shared expert; else ``ffn``."""
    routed = getattr(settings, "num_experts_per_tok", None)
    if not isinstance(routed, int):
        return ffn
    expert = getattr(settings, "moe_intermediate_size", None) or ffn
    shared = getattr(settings, "shared_expert_intermediate_size", None) or 0
    return routed * expert + shared


@dataclass(frozen=True)
class RunShape:
    """What the terms need to know of a run: the model, its layout and the config."""

    model: ModelShape
    layout: ModelLayout
    config: Config
    io: str = ""
    """The I/O settings the run would use, and why (``engine.tiers.store_io.settle_io``)."""

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: of the parameters, gathered units and activations."""
        return compute_dtype(self.config.precision.compute_dtype)

    @property
    def form(self) -> StateForm:
        """The optimizer state's form (``optim.state_dtype``, ``optim.master_dtype``)."""
        return StateForm.of(self.config.optim)

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
        """Of every unit the parameters hold, frozen ones too."""
        return self.layout.largest_unit_numel

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


def run_shape(
    config: Config, world_size: int, gpt: GPTConfig | None = None, *, model: nn.Module | None = None
) -> RunShape:
    """The engine's layout on ``world_size`` ranks of ``model``, of the built-in GPT ``gpt``, or
    (neither given) of the config's model: ``model.hf``'s (with its ``[lora]`` adapters, which
    alone train) or the built-in GPT. Each is built on the meta device (no memory, any size)
    unless ``model`` comes built."""
    if world_size < 1:
        raise ConfigError(f"world size = {world_size}: must be >= 1 (the number of ranks on this node)")
    if model is None and gpt is None and config.model.hf:
        from engine.run.pretrained import meta_model

        model = meta_model(config.model.hf)
        if config.lora.r:  # the adapters train, the base is frozen: as ``train`` builds it
            from engine.run.lora import with_lora

            model = with_lora(model, config.lora)
    if model is None:
        gpt = gpt or gpt_of(config)
        with torch.device("meta"):
            model = GPT(gpt)
    config, io = settle_io(config, resume=True, measure=False)  # `train` resumes a store that is there
    config = settle_compute_dtype(config)
    units = find_units(model, config.zero.unit_classes)
    _, layout = units_layout(model, units, config, world_size)
    blocks = sum(1 for name, _ in units if name != ROOT_UNIT)
    shape = ModelShape.of_gpt(gpt) if gpt is not None else module_shape(model, config.data.seq_len, blocks)
    return RunShape(shape, layout, config, io)
