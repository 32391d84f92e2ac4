"""The frozen units' values in a store: written once, outside the generations.

A frozen unit (``UnitLayout.trainable`` False) never changes, so a store keeps one copy of its
values, in the compute dtype the model computes with, at ``frozen/<unit>/param``: every
generation and checkpoint of the store shares it, and no step reads or writes it. The ``nvme``
optimizer tier writes it as the units are added; the memory tiers with their first checkpoint
(from the parameters, which hold the only copy in memory). A resume reads it back into the
parameters, and ``consolidate``/``export`` read it beside the masters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.tiers.parameters import PARAM_KIND
from engine.zero.partition import UnitLayout
from offload import ShardStore, array_name, create_arrays, read_shard, write_shard

FROZEN = "frozen"
"""The group at a store's top holding the frozen units' values."""


def frozen_array(unit: UnitLayout) -> str:
    """The store array holding a frozen unit's values."""
    return array_name(FROZEN, unit.name, PARAM_KIND)


def create_frozen(store: ShardStore, units: Iterable[UnitLayout], dtype: torch.dtype) -> None:
    """The arrays of the frozen ``units`` (the leader's part), replacing any an earlier run left."""
    units = tuple(units)
    if (store.path / FROZEN).is_dir():
        store.delete(FROZEN)
    store.build(FROZEN, lambda staging: create_arrays(store, staging, units, (PARAM_KIND,), dtype))


def write_frozen(store: ShardStore, unit: UnitLayout, rank: int, values: torch.Tensor) -> None:
    """Rank ``rank``'s shard of a frozen unit's values (blocks; durable at the store's next sync).
    Written from a copy: writing pins the memory it reads, which must not be a parameter's."""
    write_shard(store, FROZEN, unit, rank, [(PARAM_KIND, values.detach().to("cpu", copy=True))])


def read_frozen(store: ShardStore, units: Iterable[UnitLayout], rank: int) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
    """Rank ``rank``'s shard of each frozen unit's values, in the dtype they were stored in (cut
    for this layout whatever world size wrote them); one unit's shard in memory at a time."""
    for unit in units:
        name = frozen_array(unit)
        if not store.has_array(name):
            raise FileNotFoundError(
                f"store {store.path} holds no values of frozen unit {unit.name!r} ({name}): it was written before its "
                f"first step or checkpoint completed; train afresh, or resume from a store that holds them"
            )
        values = torch.empty(unit.shard_numel, dtype=store.array_info(name).dtype)
        read_shard(store, FROZEN, unit, rank, [(PARAM_KIND, values)])
        yield unit, values
