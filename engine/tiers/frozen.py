"""The frozen units' values in a store: written once, outside the generations.

A frozen unit (``UnitLayout.trainable`` False) never changes, so a store keeps one copy of its
values, in the compute dtype the model computes with, at ``frozen/<unit>/param``: every
generation and checkpoint of the store shares it, and no step writes it. The ``nvme``
optimizer tier writes it as the units are added (``FrozenAdder``); the memory tiers with their
first checkpoint (from the parameters, which hold the only copy in memory), or, when the
parameters are on disk (``offload.param = "nvme"``), as the units are added too. That tier keeps
no copy of its own in ``params/``: it reads a frozen unit's shard from here each time the unit
is gathered, so a frozen base is on disk once. A resume reads it back into the parameters, and
``consolidate``/``export`` read it beside the masters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

import torch

from engine.state.partition import UnitLayout
from engine.tiers.parameters import PARAM_KIND
from engine.tiers.store_io import StoreIO
from offload import (
    ShardStore,
    array_in_layout,
    array_name,
    create_arrays,
    read_shard,
    read_shard_async,
    write_shard,
)

FROZEN = "frozen"
"""The group at a store's top holding the frozen units' values."""


def frozen_array(unit: UnitLayout) -> str:
    """The store array holding a frozen unit's values."""
    return array_name(FROZEN, unit.name, PARAM_KIND)


def create_frozen(store: ShardStore, units: Iterable[UnitLayout], dtype: torch.dtype) -> None:
    """The arrays of the frozen ``units`` (the leader's part), replacing any an earlier run left."""
    units = tuple(units)
    if (store.path / FROZEN).is_dir():
        store.nodes.delete(FROZEN)
    store.nodes.build(FROZEN, lambda staging: create_arrays(store, staging, units, (PARAM_KIND,), dtype))


def write_frozen(store: ShardStore, unit: UnitLayout, rank: int, values: torch.Tensor) -> None:
    """Rank ``rank``'s shard of a frozen unit's values (blocks; durable at the store's next sync).
    Written from a copy: writing pins the memory it reads, which must not be a parameter's."""
    write_shard(store, FROZEN, unit, rank, [(PARAM_KIND, values.detach().to("cpu", copy=True))])


def read_frozen_async(store: ShardStore, unit: UnitLayout, rank: int, values: torch.Tensor) -> Future | None:
    """Start reading rank ``rank``'s shard of a frozen unit's values into ``values``, in place;
    None when it is read already: arrays cut for another world size (a run resumed on more or
    fewer ranks than wrote them) or stored in another dtype are read at once, range by range."""
    name = frozen_array(unit)
    if array_in_layout(store, name, unit) and store.array_info(name).dtype == values.dtype:
        [future] = read_shard_async(store, FROZEN, unit, rank, [(PARAM_KIND, values)])
        return future
    stored = torch.empty(unit.shard_numel, dtype=store.array_info(name).dtype)
    read_shard(store, FROZEN, unit, rank, [(PARAM_KIND, stored)])
    values.copy_(stored)
    return None


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


class FrozenAdder:
    """Writes each frozen unit's values as a new run adds its units, the arrays made (by the
    store's leader (``StoreIO.leader``: of each host's store, on several), all ranks waiting)
    before the first; ``store`` opens the store on first use."""

    def __init__(self, store: Callable[[], ShardStore], units: Iterable[UnitLayout], rank: int, io: StoreIO):
        self._store, self._units, self._rank = store, tuple(units), rank
        self._leader, self._barrier = io.leader, io.barrier
        self._ready = False  # the arrays exist (made with the first unit added)

    def add(self, unit: UnitLayout, values: torch.Tensor) -> None:
        """Store the unit's values on this rank (durable at the store's next sync)."""
        store = self._store()
        if not self._ready:
            if self._leader:
                create_frozen(store, self._units, values.dtype)
            self._barrier()
            self._ready = True
        write_frozen(store, unit, self._rank, values)
