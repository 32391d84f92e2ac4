"""A LoRA run's merged model: each adapted linear layer's weight plus its trained adapters
(``weight + scaling * B @ A``, as peft's ``merge_and_unload`` computes it), under the base
model's own names, for ``export --merged`` to write as a plain Hugging Face folder.

The base may be larger than memory, so it is merged as it is exported: one frozen unit at a
time is read whole (its adapted weights need their full matrices), merged, and handed on. The
adapters are small and read whole first.

In fp32 the result is peft's bit for bit (the same operations in the same order). A base held
in bf16 or fp16 is merged in fp32 and rounded once when written, where peft on a half-precision
model rounds the delta to the half dtype before adding it: the two can differ in the last bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.config import LoraConfig
from engine.run.lora import merges, with_lora_named
from engine.run.pretrained import SOURCE_RECORD, meta_model
from engine.state.partition import ModelLayout, UnitLayout
from engine.tools.consolidate import Masters, unit_values


def merged_pieces(
    masters: Masters, adapters: dict[str, torch.Tensor], source: Path, record: dict
) -> tuple[ModelLayout, Iterator[tuple[UnitLayout, int, torch.Tensor]]]:
    """The merged model's layout (the frozen units, under the base model's names) and its
    values, one whole unit at a time as ``(unit, 0, values)``. ``adapters``: the trained
    adapters by name; ``source``, ``record``: the model the store's run trained."""
    wrapped, base_names = with_lora_named(meta_model(source), LoraConfig(**record["lora"]))
    plan = merges(wrapped)
    expected = {name for m in plan.values() for name in (m.lora_a, m.lora_b)}
    if expected != adapters.keys():
        name = sorted(expected ^ adapters.keys())[0]
        raise ValueError(
            f"store {masters.metadata['source']} and the LoRA model its {SOURCE_RECORD} describes disagree on "
            f"{name!r}: the store and its record do not match"
        )
    renamed = tuple(
        dataclasses.replace(u, params=tuple(dataclasses.replace(s, name=base_names[s.name]) for s in u.params))
        for u in masters.layout.frozen
    )
    layout = ModelLayout(units=(), world_size=masters.layout.world_size, frozen=renamed)

    def pieces() -> Iterator[tuple[UnitLayout, int, torch.Tensor]]:
        for unit, out in zip(masters.layout.frozen, renamed, strict=True):
            values = unit_values(masters, unit)
            for slot in unit.params:
                if slot.name in plan:
                    values[slot.offset : slot.offset + slot.numel].view(slot.shape).add_(
                        plan[slot.name].delta(adapters)
                    )
            yield out, 0, values

    return layout, pieces()
