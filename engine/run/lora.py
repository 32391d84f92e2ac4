"""LoRA on a ``model.hf`` run (the ``[lora]`` section), through the ``peft`` library.

The pretrained model is built on the ``meta`` device as for a full fine-tune, then wrapped by
``peft.get_peft_model`` there too: the base is frozen (no optimizer state, no master, and at
stage 3 on ``offload.param`` like any unit) and the adapters are the only trainable parameters.
When the engine materialises a unit, ``LoraInit`` reads its base tensors from the checkpoint
under the base model's own names (peft keeps the base's parameters, under names of its own) and
initialises its adapters as peft does (``lora_A`` Kaiming-uniform, ``lora_B`` zero, so the
first forward is the pretrained model's), each from a generator of ``(train.seed, name)``: the
same seed gives the same adapters on any tier and at any world size.

``python -m engine export`` writes the trained adapter alone, in peft's format, or with
``--merged`` the base with its adapters merged in (``merges``), as a plain model
(``engine.tools.export``, ``engine.tools.merge``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.config import LoraConfig
from engine.run.models.gpt import param_generator
from engine.run.pretrained import Pretrained, RecordedSource

ADAPTERS = ("lora_A", "lora_B")


def _peft() -> ModuleType:
    try:
        import peft
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("lora.r > 0 needs the peft library: pip install peft") from err
    return peft


def peft_config(lora: LoraConfig) -> Any:
    """peft's ``LoraConfig`` of the ``[lora]`` section, for a causal LM."""
    return _peft().LoraConfig(
        task_type="CAUSAL_LM",
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules or None,  # None: peft's choice for the architecture
    )


def with_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """The meta model ``model`` wrapped with LoRA adapters (also on the meta device), base frozen.
    Refuses target modules whose adapters the engine cannot initialise (only linear layers)."""
    config = peft_config(lora)
    try:
        with torch.device("meta"):
            wrapped = _peft().get_peft_model(model, config)
    except ValueError as err:  # peft names the modules it did not find
        raise ValueError(f"lora.target_modules = {lora.target_modules}: {err}") from err
    others = [n for n, p in wrapped.named_parameters() if p.requires_grad and adapter_kind(n) is None]
    if others:
        raise ValueError(
            f"lora.target_modules = {lora.target_modules} puts adapters on {others[0]!r}, not a linear layer's: "
            f"target the model's linear layers (e.g. q_proj, v_proj)"
        )
    return wrapped


def adapter_kind(name: str) -> str | None:
    """``lora_A`` or ``lora_B`` for a linear layer's adapter parameter, else None."""
    parts = name.split(".")
    return next((p for p in parts if p in ADAPTERS), None)


def init_adapters_(params: dict[str, torch.Tensor], seed: int) -> None:
    """Initialise LoRA adapters in place as peft does (``lora_A`` Kaiming-uniform with
    ``a = sqrt(5)``, ``lora_B`` zero), each from the generator of ``(seed, name)``."""
    with torch.no_grad():
        for name, tensor in params.items():
            if adapter_kind(name) == "lora_B":
                tensor.zero_()
            else:
                values = torch.empty(tensor.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=param_generator(seed, name))
                tensor.copy_(values)


class LoraInit:
    """The ``init_unit`` of a LoRA-wrapped meta model: base tensors from the checkpoint (through
    ``pretrained``, made for the unwrapped model), adapters by ``init_adapters_``."""

    def __init__(self, pretrained: Pretrained | RecordedSource, base_names: dict[str, str], seed: int):
        self.pretrained, self.base_names, self.seed = pretrained, base_names, seed

    def __call__(self, params: dict[str, torch.Tensor]) -> None:
        base = {self.base_names[n]: t for n, t in params.items() if n in self.base_names}
        if base:
            self.pretrained(base)
        init_adapters_({n: t for n, t in params.items() if n not in self.base_names}, self.seed)

    @property
    def dtype(self) -> str:
        return self.pretrained.dtype


def with_lora_named(model: nn.Module, lora: LoraConfig) -> tuple[nn.Module, dict[str, str]]:
    """``with_lora(model, lora)`` and the base model's name of each of its base parameters
    (peft keeps them, under names of its own)."""
    first_names = {id(p): n for n, p in model.named_parameters()}
    wrapped = with_lora(model, lora)
    return wrapped, {n: first_names[id(p)] for n, p in wrapped.named_parameters() if id(p) in first_names}


def lora_model(
    model: nn.Module, pretrained: Pretrained | RecordedSource, lora: LoraConfig, seed: int
) -> tuple[nn.Module, LoraInit]:
    """``model`` (meta, checked against its checkpoint by ``pretrained``) with LoRA adapters, and
    the ``init_unit`` that fills it."""
    wrapped, base_names = with_lora_named(model, lora)
    return wrapped, LoraInit(pretrained, base_names, seed)


@dataclass(frozen=True)
class Merge:
    """How one adapted linear layer's weight merges with its adapters, as peft's
    ``merge_and_unload`` computes it: ``weight + transpose(B @ A) * scaling``, the transpose
    for layers that store ``fan_in_fan_out`` (GPT-2's ``Conv1D``)."""

    lora_a: str
    lora_b: str
    scaling: float
    fan_in_fan_out: bool

    def delta(self, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
        """peft's ``get_delta_weight`` in the same order of operations (fp32 adapters)."""
        delta = adapters[self.lora_b] @ adapters[self.lora_a]
        return (delta.T if self.fan_in_fan_out else delta) * self.scaling


def merges(wrapped: nn.Module) -> dict[str, Merge]:
    """Each adapted layer's base weight (by its name in ``wrapped``, a peft model) and its ``Merge``."""
    layer_type = _peft().tuners.lora.LoraLayer
    names = {id(p): n for n, p in wrapped.named_parameters()}
    out = {}
    for module in wrapped.modules():
        if isinstance(module, layer_type):
            (adapter,) = module.lora_A.keys()  # with_lora adds one
            out[names[id(module.get_base_layer().weight)]] = Merge(
                names[id(module.lora_A[adapter].weight)],
                names[id(module.lora_B[adapter].weight)],
                module.scaling[adapter],
                module.fan_in_fan_out,
            )
    return out
