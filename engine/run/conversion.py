"""A checkpoint's tensors to the model's parameters and back, by transformers' own conversion rules.

transformers 5 stores some models under names and in layouts that differ from their modules':
Mixtral keeps ``block_sparse_moe.experts.3.w1.weight`` on disk for each expert, where the model
holds one stacked ``mlp.experts.gate_up_proj`` per layer; GPT-NeoX keeps ``embed_out`` for its
``lm_head``; older checkpoints keep ``LayerNorm.gamma``. ``from_pretrained`` applies an ordered
list of renamings and converters (``transformers.conversion_mapping.get_model_conversion_mapping``)
and ``save_pretrained`` applies them reversed. The engine reads and writes through the same rules,
so that every folder ``from_pretrained`` loads imports, and every export is what ``save_pretrained``
writes: no table per architecture is kept here.

Loading is grouped into ``Conversion`` s: the checkpoint tensors that together make some of the
model's parameters (one tensor renamed, or every expert of one layer stacked). A group is run on
``meta`` tensors first, from the files' headers alone, which gives the shapes it makes, so a
checkpoint is checked whole before any byte is read; it is run on real tensors when the engine
builds the unit that holds its parameters, so no process holds more than that unit's tensors.

Saving asks the reversed rules what each of a unit's parameters becomes on disk, again on
``meta`` tensors: a stored tensor that is a contiguous slice of one parameter (a split expert,
a renamed weight) is streamed from the masters piece by piece; any other (a concatenation of
several parameters) is computed from the unit, read whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.state.partition import ModelLayout

SOURCE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
"""The dtypes a parameter is imported from."""
BUFFER_DTYPES = SOURCE_DTYPES | {"F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16}
BUFFER_DTYPES |= {"I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""The dtypes a persistent buffer may be stored in as well (DeepSeek-V4's expert index table)."""
SHOWN = 3  # names listed in an error before "and N more"


@dataclass
class Conversion:
    """The checkpoint tensors that make some of the model's parameters, and how."""

    transform: Any
    """A ``WeightRenaming`` or ``WeightConverter`` that holds no tensors: each run copies it."""
    first: str
    """The model name of its first target (transformers' name for the group)."""
    sources: list[tuple[str, str]] = field(default_factory=list)
    """``(source pattern, checkpoint name)`` of each tensor it reads, in transformers' order."""

    def run(self, read: Any, model: nn.Module) -> dict[str, torch.Tensor]:
        """The tensors it makes, by model name, from ``read(checkpoint name)``."""
        transform = deepcopy(self.transform)
        for pattern, name in self.sources:
            transform.add_tensor(self.first, name, pattern, read(name))
        made = transform.convert(self.first, model=model, config=getattr(model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}

    @property
    def names(self) -> list[str]:
        """The checkpoint names it reads."""
        return [name for _, name in self.sources]


def _rules(model: nn.Module | None, saving: bool) -> list[Any]:
    """The model's ordered conversion rules; for saving, those ``save_pretrained`` reverses for a
    model it did not load (no legacy renamings, no prefix changes)."""
    if model is None:  # a model transformers does not know converts nothing
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    hf: Any = model  # a PreTrainedModel, which nn.Module's typing does not know
    rules = get_model_conversion_mapping(hf, add_legacy=not saving)
    return [rule for rule in rules if not (saving and isinstance(rule, PrefixChange))]


def group_checkpoint(model: nn.Module, names: list[str]) -> tuple[dict[str, Conversion], list[str]]:
    """The conversions that load the checkpoint tensors ``names`` into ``model``, by their first
    target, as ``from_pretrained`` groups them; and the names that load into nothing."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    rules = _rules(model, saving=False)
    renamings = [rule for rule in rules if isinstance(rule, WeightRenaming)]
    converters = [rule for rule in rules if isinstance(rule, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    groups: dict[str, Conversion] = {}
    unplaced = []
    for name in sorted(names, key=dot_natural_key):
        target, pattern = rename_source_key(name, renamings, converters, prefix, state)
        if target not in state and name in state:
            target, pattern = rename_source_key(name, [], [], prefix, state)
        if target not in state:
            unplaced.append(name)
            continue
        if pattern is None:
            pattern = name
            group = groups.setdefault(target, Conversion(WeightRenaming(name, target), target))
            if group.sources:
                raise ValueError(
                    f"checkpoint tensors {group.sources[0][1]!r} and {name!r} both load into the model's {target!r}: "
                    f"the checkpoint is corrupt; write it again with save_pretrained"
                )
        else:
            group = groups.setdefault(target, Conversion(deepcopy(by_pattern[pattern]), target))
        group.sources.append((pattern, name))
    return groups, unplaced


@dataclass
class CheckpointMatch:
    """How a checkpoint loads into a model: the conversion that makes each parameter."""

    conversions: dict[str, Conversion]
    """By the first target's model name."""
    made_by: dict[str, str]
    """For each parameter (by its first name), the first target of the conversion that makes it."""
    param_of: dict[str, str]
    """For each model name a conversion makes, the first name of its parameter."""
    buffers: dict[str, str]
    """The persistent buffers the checkpoint holds (DeepSeek-V3's router bias), by model name:
    the first target of the conversion that makes each."""


def match_checkpoint(model: nn.Module, tensors: dict[str, Any], folder: Path) -> CheckpointMatch:
    """How the checkpoint tensors ``tensors`` (name: ``CheckpointTensor`` from the headers) load
    into ``model``, checked from the headers alone: refuses a checkpoint that lacks a parameter,
    holds a tensor the model has no place for, or makes a tensor of another shape, each named by
    its name on disk and the model's."""
    aliases = _aliases(model)
    param_of = {alias: names[0] for names in aliases.values() for alias in names}
    shapes = {names[0]: tuple(param.shape) for param, names in ((p, aliases[id(p)]) for p in _params(model))}
    groups, unplaced = group_checkpoint(model, list(tensors))
    kept = {name: tuple(b.shape) for name, b in model.state_dict().items() if name not in param_of}
    made_by: dict[str, str] = {}
    buffers: dict[str, str] = {}
    misshaped: list[str] = []
    for first, group in groups.items():
        try:
            made = group.run(lambda name: _meta(tensors[name]), model)
        except (RuntimeError, ValueError, IndexError) as err:
            misshaped.append(f"{_listing(group.names)} do not make the model's {first!r} ({err})")
            made_by.setdefault(param_of.get(first, first), first)  # refused below, as misshaped
            continue
        for target, tensor in made.items():
            if target in kept:
                buffers[target] = first
            elif target in param_of:
                _check_float(group, tensors)
                made_by.setdefault(param_of[target], first)
            else:
                unplaced += group.names
                continue
            wanted = kept[target] if target in kept else shapes[param_of[target]]
            if tuple(tensor.shape) != wanted:
                misshaped.append(_misshaped(group.names, target, list(tensor.shape), list(wanted)))
    missing = [name for name in shapes if name not in made_by]
    unexpected = sorted({n for n in unplaced if not _ignored(model, n)})
    _refuse(model, folder, missing, unexpected, misshaped)
    return CheckpointMatch(groups, made_by, param_of, buffers)


def _misshaped(names: list[str], target: str, made: list[int], wanted: list[int]) -> str:
    if names == [target]:
        return f"{target!r} is {made}, the model's is {wanted}"
    if len(names) == 1:
        return f"{names[0]!r} (the model's {target!r}) is {made}, the model's is {wanted}"
    return f"{_listing(names)} make the model's {target!r} of {made}, the model's is {wanted}"


def _params(model: nn.Module) -> list[nn.Parameter]:
    return list(dict.fromkeys(model.parameters()))


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (tied weights have several), by ``id``."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    return aliases


def _meta(tensor: Any) -> torch.Tensor:
    if tensor.dtype not in BUFFER_DTYPES:
        raise ValueError(f"of dtype {tensor.dtype}, which the engine does not read")
    return torch.empty(tensor.shape, dtype=BUFFER_DTYPES[tensor.dtype], device="meta")


def _check_float(group: Conversion, tensors: dict[str, Any]) -> None:
    for name in group.names:
        if tensors[name].dtype not in SOURCE_DTYPES:
            raise ValueError(
                f"checkpoint tensor {name!r} in {tensors[name].file} is {tensors[name].dtype}, not a float the engine "
                f"imports ({', '.join(SOURCE_DTYPES)}): save the model in fp32, bf16 or fp16"
            )


def _refuse(model: nn.Module, folder: Path, missing: list[str], unexpected: list[str], misshaped: list[str]) -> None:
    what = f"the model {type(model).__name__} that {folder / 'config.json'} describes"
    fix = "the weights and config.json do not match; use a folder that save_pretrained wrote whole"
    if missing:
        raise ValueError(f"checkpoint {folder} lacks tensor {_listing(missing)} of {what}: {fix}")
    if unexpected:
        raise ValueError(
            f"checkpoint {folder} holds tensor {_listing(unexpected)} that {what} has no parameter for: {fix}"
        )
    if misshaped:
        more = f" (and {len(misshaped) - SHOWN} more)" if len(misshaped) > SHOWN else ""
        raise ValueError(f"checkpoint {folder}: tensor {'; '.join(misshaped[:SHOWN])}{more}: {fix}")


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _ignored(model: nn.Module, name: str) -> bool:
    """A checkpoint tensor the model's own loader ignores (e.g. old checkpoints' rotary buffers)."""
    patterns: Iterable[str] = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(p, name) for p in [*patterns, r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$"])


def converts(model: nn.Module | None) -> bool:
    """Whether ``save_pretrained`` of ``model`` stores any tensor under another name or layout
    than the model's: if not, its parameters' names are its checkpoint's."""
    return bool(_rules(model, saving=True))


def stored_tensors(model: nn.Module | None, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` of ``model`` writes for the parameters ``tensors`` (by
    model name), by their names on disk; on ``meta`` tensors, their shapes and which are views."""
    if not converts(model):
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    hf: Any = model
    return revert_weight_conversion(hf, dict(tensors))


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of an export, as ``save_pretrained`` writes it, and where its values come from."""

    name: str
    shape: tuple[int, ...]
    unit: str
    offset: int | None
    """Where its values start in its unit's flat values, which it slices contiguously; ``None``
    when it is computed from the unit read whole (a concatenation of parameters)."""
    dtype: torch.dtype | None = None
    """Its own dtype (an integer buffer's); ``None``: the export's."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def stored_plan(model: nn.Module | None, layout: ModelLayout) -> list[StoredTensor]:
    """Every tensor ``save_pretrained`` of ``model`` writes for the parameters of ``layout``,
    unit by unit: a unit's slices in the order of its flat values, or, when any of its tensors
    is not a slice, all of them in the order the reversed rules make them."""
    plan = []
    for unit in layout.all_units:
        inputs = {slot.name: torch.empty(slot.shape, device="meta") for slot in unit.params}
        start = {id(inputs[slot.name]): slot.offset for slot in unit.params}
        stored = stored_tensors(model, inputs)
        slices = {name: _slice_start(tensor, start) for name, tensor in stored.items()}
        if None in slices.values():
            plan += [StoredTensor(name, tuple(t.shape), unit.name, None) for name, t in stored.items()]
        else:
            ordered = sorted(stored, key=lambda name: slices[name] or 0)
            plan += [StoredTensor(name, tuple(stored[name].shape), unit.name, slices[name]) for name in ordered]
    return plan


def _slice_start(tensor: torch.Tensor, start: dict[int, int]) -> int | None:
    """Where ``tensor`` starts in its unit's flat values if it is a contiguous slice of one of
    the unit's parameters (``start``: each parameter's offset, by ``id``), else ``None``."""
    base = tensor if id(tensor) in start else tensor._base
    if base is None or id(base) not in start or not tensor.is_contiguous():
        return None
    return start[id(base)] + int(tensor.storage_offset())
