"""Units -> flat buffers -> per-rank shards, and the layout metadata that describes them.

A unit is the grain of sharding, communication and I/O: by default each entry of each
``nn.ModuleList`` (a transformer block), plus a root unit holding every parameter no
other unit owns. Each unit's parameters are laid end to end in one flat buffer, padded
so that it splits into ``world_size`` equal shards; a shard is a whole number of store
chunks and of 4 KiB, so no two ranks ever touch one chunk and direct I/O stays aligned.

The layout is plain data (``to_dict``/``from_dict``): it is saved with the store and
drives resume, resharding and consolidation without the model class.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from engine.runtime.sizes import FP32, MIB
from offload import DIRECT_ALIGN

ROOT_UNIT = "root"
FROZEN_SUFFIX = ".frozen"
"""A unit's frozen parameters (``requires_grad=False``) form a unit of their own, named after it
with this suffix: it is gathered like any unit, but has no gradient and no optimizer state."""
# Shards are aligned, for O_DIRECT, for the narrowest dtype a shard is stored in (2-byte bf16/fp16).
ALIGN_ELEMS = DIRECT_ALIGN // 2
COARSE_PADDING = 8
"""A chunk is rounded to a coarser ``align`` (``build_layout``) only where it holds at least this
many times ``align`` elements: the zeros added stay under 1/8th of it (1/16th on average), and
every kind's bytes grow by as much. What the alignment saves is larger: without it, the page
cache made a step half again as long (``engine.state.forms.StateForm.chunk_align``)."""


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in its unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class UnitLayout:
    """One unit's flat buffer: its parameters, its padded size, its shard and chunk size."""

    name: str
    params: tuple[ParamSlot, ...]
    numel: int
    shard_numel: int
    chunk_numel: int
    padded_numel: int
    trainable: bool = True
    """False for a frozen unit: its values never change, so it has no gradient, master or moments."""

    def shard_slice(self, rank: int) -> slice:
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)


@dataclass(frozen=True)
class ModelLayout:
    """Every unit of a model for one world size: the trainable ``units``, which the optimizer and
    the gradients see, and the ``frozen`` ones, which only the parameters hold."""

    units: tuple[UnitLayout, ...]
    world_size: int
    frozen: tuple[UnitLayout, ...] = ()

    @property
    def all_units(self) -> tuple[UnitLayout, ...]:
        """The units whose parameters the model holds: the trainable ones, then the frozen."""
        return self.units + self.frozen

    def unit(self, name: str) -> UnitLayout:
        for unit in self.all_units:
            if unit.name == name:
                return unit
        raise KeyError(f"no unit named {name!r} (units: {', '.join(u.name for u in self.all_units)})")

    @property
    def largest_unit_numel(self) -> int:
        """Elements of the largest unit's full buffer (padding included, frozen units too): what
        every buffer a unit passes through is sized by."""
        return max(u.padded_numel for u in self.all_units)

    @property
    def numel(self) -> int:
        """Elements of the trainable parameters."""
        return sum(u.numel for u in self.units)

    @property
    def frozen_numel(self) -> int:
        return sum(u.numel for u in self.frozen)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelLayout:
        """The layout ``to_dict`` gave (a store written before frozen units has none)."""

        def unit(u: dict) -> UnitLayout:
            return UnitLayout(
                name=u["name"],
                params=tuple(ParamSlot(p["name"], tuple(p["shape"]), p["offset"], p["numel"]) for p in u["params"]),
                numel=u["numel"],
                shard_numel=u["shard_numel"],
                chunk_numel=u["chunk_numel"],
                padded_numel=u["padded_numel"],
                trainable=u.get("trainable", True),
            )

        frozen = tuple(unit(u) for u in data.get("frozen", ()))
        return cls(tuple(unit(u) for u in data["units"]), data["world_size"], frozen)


def find_units(model: nn.Module, unit_classes: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The unit modules in execution-friendly (definition) order, root last.

    ``unit_classes`` names module classes that form units; without it every entry of
    every ``nn.ModuleList`` does (the outermost ones). Named classes nest: a mixture-of-experts
    layer whose experts' class is named too is two units, the experts' and the rest of the
    layer's, listed inner first so that each parameter belongs to the innermost unit. A name no
    module of the model has is refused (``check_unit_classes``). A transformers causal LM's
    output head (``get_output_embeddings``) stays in the root whatever its class: the chunked
    loss reads its weight outside the head's forward, where a unit of its own is released.
    """
    check_unit_classes(model, unit_classes or [])
    units: list[tuple[str, nn.Module]] = []
    output_head = getattr(model, "get_output_embeddings", lambda: None)()

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            is_unit = (
                type(child).__name__ in unit_classes and child is not output_head
                if unit_classes
                else isinstance(module, nn.ModuleList) and any(True for _ in child.parameters())
            )
            if is_unit and unit_classes:
                visit(f"{path}.", child)
            if is_unit:
                units.append((path, child))
            else:
                visit(f"{path}.", child)

    visit("", model)
    units.append((ROOT_UNIT, model))
    return units


def nested_in(inner: str, outer: str) -> bool:
    """Whether the unit named ``inner`` is a module inside the unit named ``outer`` (a unit's name
    is its module's path; the root's is no path)."""
    return inner.startswith(f"{outer}.")


def check_unit_classes(model: nn.Module, unit_classes: list[str], shown: int = 12) -> None:
    """Refuse a name in ``unit_classes`` that no module holding parameters is: it would make
    no unit, silently, and a later resume would blame the store for the layout it changes."""
    if not unit_classes:
        return
    with_params = sorted({type(m).__name__ for m in model.modules() if any(True for _ in m.parameters())})
    every = {type(m).__name__ for m in model.modules()}
    for name in unit_classes:
        if name in with_params:
            continue
        what = "whose modules hold no parameters" if name in every else "which no module of this model is"
        listed = ", ".join(with_params[:shown]) + (", ..." if len(with_params) > shown else "")
        raise ValueError(
            f"zero.unit_classes names {name!r}, {what}: its module classes are {listed} (choose among them, "
            f"or leave zero.unit_classes empty for every entry of every nn.ModuleList)"
        )


def unit_parameters(
    model: nn.Module, units: list[tuple[str, nn.Module]], trainable: bool = True
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Each unit's own trainable parameters by qualified name (with ``trainable=False``, its
    frozen ones, under its frozen unit's name); a shared (tied) parameter belongs to the first
    unit that reaches it, the root unit owns what no other unit does."""
    owner: dict[int, str] = {}
    suffix = "" if trainable else FROZEN_SUFFIX
    owned: dict[str, list[tuple[str, nn.Parameter]]] = {name + suffix: [] for name, _ in units}
    qualified = {id(p): n for n, p in model.named_parameters()}
    for unit_name, module in units:
        for param in module.parameters():
            if id(param) not in owner and param.requires_grad == trainable:
                owner[id(param)] = unit_name
                owned[unit_name + suffix].append((qualified[id(param)], param))
    return owned


def unit_needs(
    model: nn.Module, units: list[tuple[str, nn.Module]], owned: dict[str, list[tuple[str, nn.Parameter]]]
) -> dict[str, list[str]]:
    """For each unit module, the units whose parameters it uses when it runs: its own (the
    trainable and the frozen one) and any it borrows (a weight tied to one another unit owns). The root's module is the whole
    model, so for it only what lies outside every other unit counts."""
    owner = {id(p): unit for unit, params in owned.items() for _, p in params}
    unit_modules = {id(m) for name, m in units if name != ROOT_UNIT}

    def reachable(module: nn.Module, top: bool) -> Iterator[nn.Parameter]:
        if not top and id(module) in unit_modules:
            return
        yield from module.parameters(recurse=False)
        for child in module.children():
            yield from reachable(child, top=False)

    needs: dict[str, list[str]] = {}
    for name, module in units:
        used = [owner[id(p)] for p in reachable(module, top=True) if id(p) in owner]
        needs[name] = list(dict.fromkeys([name, *used] if owned.get(name) else used))
    return needs


def max_chunk_numel(chunk_mb: int | str) -> int:
    """Elements in a store chunk of at most ``chunk_mb`` MiB (``offload.chunk_mb``), counted
    in fp32, the widest dtype a shard is stored in."""
    if not isinstance(chunk_mb, int):
        raise ValueError(f"offload.chunk_mb = {chunk_mb!r} must be settled to a number first (engine.tiers.store_io)")
    return chunk_mb * MIB // FP32


def build_layout(
    params_by_unit: dict[str, list[tuple[str, nn.Parameter]]],
    world_size: int,
    max_chunk_numel: int,
    frozen: dict[str, list[tuple[str, nn.Parameter]]] | None = None,
    align: int = ALIGN_ELEMS,
) -> ModelLayout:
    """Flat-buffer offsets, padded shard sizes and chunk sizes for ``world_size`` ranks, of the
    trainable units ``params_by_unit`` and the ``frozen`` ones (``unit_parameters``).

    A shard is cut into the fewest chunks of at most ``max_chunk_numel`` elements, all of one
    size, a multiple of ``ALIGN_ELEMS``: padding stays under ``ALIGN_ELEMS`` per chunk (chunks
    of exactly the maximum would pad a shard just over it to twice its size, and every step
    would read and write the zeros). A chunk of at least ``COARSE_PADDING`` times ``align``
    elements is a multiple of ``align``: state stored in another geometry than the elements'
    (``engine.state.forms.StateForm.chunk_align``) needs that many for its chunk files to be
    read and written with O_DIRECT, where a smaller multiple would send every byte of them
    through the page cache.
    """
    if max_chunk_numel % ALIGN_ELEMS or align % ALIGN_ELEMS:
        raise ValueError(f"chunk size {max_chunk_numel} and alignment {align} must be multiples of {ALIGN_ELEMS}")
    if max_chunk_numel % align:
        align = ALIGN_ELEMS  # a chunk rounded to it could exceed the maximum
    units = _unit_layouts(params_by_unit, world_size, max_chunk_numel, align, trainable=True)
    frozen_units = _unit_layouts(frozen or {}, world_size, max_chunk_numel, align, trainable=False)
    names = [u.name for u in units + frozen_units]
    if len(set(names)) != len(names):
        clash = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"two units are named {clash!r}: rename the module, or name unit classes in zero.unit_classes")
    return ModelLayout(tuple(units), world_size, tuple(frozen_units))


def _unit_layouts(
    params_by_unit: dict[str, list[tuple[str, nn.Parameter]]],
    world_size: int,
    max_chunk_numel: int,
    align: int,
    trainable: bool,
) -> list[UnitLayout]:
    units = []
    for unit_name, params in params_by_unit.items():
        slots, offset = [], 0
        for name, param in params:
            slots.append(ParamSlot(name, tuple(param.shape), offset, param.numel()))
            offset += param.numel()
        if offset == 0:
            continue
        shard = math.ceil(offset / world_size)
        chunks = math.ceil(shard / max_chunk_numel)
        chunk = math.ceil(shard / chunks)
        chunk = _round_up(chunk, align if chunk >= COARSE_PADDING * align else ALIGN_ELEMS)
        shard = chunk * chunks
        units.append(UnitLayout(unit_name, tuple(slots), offset, shard, chunk, shard * world_size, trainable))
    return units


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def flatten_into(flat: torch.Tensor, unit: UnitLayout, tensors: dict[str, torch.Tensor]) -> None:
    """Copy each parameter's values into its slot of ``flat`` (casting to ``flat``'s dtype)."""
    for slot in unit.params:
        flat[slot.offset : slot.offset + slot.numel].copy_(tensors[slot.name].reshape(-1))


def materialize_(params: list[tuple[str, nn.Parameter]], places: dict[str, torch.Tensor]) -> None:
    """Give parameters built on the ``meta`` device their ``places`` (fp32 memory, each the
    parameter's shape) as memory, in place: the same Python objects, so ties and references to
    them stay valid. One that has memory already is copied into its place and moved there."""
    for name, param in params:
        place = places[name]
        if not param.is_meta:
            place.copy_(param.detach())
        # ``.data``: its own version counter, not the flat's, which every other slot's writes bump.
        torch.utils.swap_tensors(param, nn.Parameter(place.data, param.requires_grad))


def param_views(flat: torch.Tensor, unit: UnitLayout) -> dict[str, torch.Tensor]:
    """Views of ``flat`` shaped like each parameter of the unit (no copy)."""
    return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in unit.params}
