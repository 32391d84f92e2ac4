"""Shards in a store: how one unit's kinds of state are named, cut and moved, by rank.

A unit's state of each kind (an fp32 master, a moment, a compute-dtype parameter...) is one
1-D array of ``padded_numel`` elements in chunks of ``chunk_numel``, named
``<prefix>/<unit>/<kind>`` under a generation or checkpoint ``prefix``; rank ``r`` owns the
elements ``shard_slice(r)``, whole chunks of it. The trainer's unit layout only has to say
those few numbers (``ShardedUnit``): this module, and so the on-disk format, needs nothing
else from it.

A store written for another cutting (another world size or chunk size) stays readable: a
unit's content is the first ``numel`` elements of its arrays whatever their padding, so a
shard is read range by range from the chunks that cover it, its padding zeroed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from offload.store import ShardStore


class ShardedUnit(Protocol):
    """What the store needs to know of a unit's layout."""

    @property
    def name(self) -> str: ...
    @property
    def numel(self) -> int: ...
    @property
    def padded_numel(self) -> int: ...
    @property
    def chunk_numel(self) -> int: ...
    @property
    def shard_numel(self) -> int: ...
    def shard_slice(self, rank: int) -> slice: ...


def array_name(prefix: str, unit: str, kind: str) -> str:
    """The store array holding one kind of state of one unit under ``prefix`` (a generation
    or a checkpoint)."""
    return f"{prefix}/{unit}/{kind}"


def create_arrays(
    store: ShardStore, prefix: str, units: Iterable[ShardedUnit], kinds: Sequence[str], dtype: torch.dtype
) -> None:
    """Every unit's arrays of ``kinds`` under ``prefix``, cut for the units' shards."""
    for unit in units:
        for kind in kinds:
            store.create_array(array_name(prefix, unit.name, kind), unit.padded_numel, unit.chunk_numel, dtype)


def array_in_layout(store: ShardStore, name: str, unit: ShardedUnit) -> bool:
    """Whether array ``name`` exists cut as ``unit`` is: then a rank's shard is whole chunks
    of it, read and written in place."""
    if not store.has_array(name):
        return False
    info = store.array_info(name)
    return info.numel == unit.padded_numel and info.chunk_elems == unit.chunk_numel


def read_shard(
    store: ShardStore, prefix: str, unit: ShardedUnit, rank: int, views: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """Rank ``rank``'s shard of each ``(kind, view)`` of ``unit`` under ``prefix`` into the view
    (a host tensor), from chunks cut for another layout too (see the module's note)."""
    start = unit.shard_slice(rank).start
    count = min(max(unit.numel - start, 0), unit.shard_numel)
    for kind, view in views:
        name = array_name(prefix, unit.name, kind)
        if array_in_layout(store, name, unit):
            store.read_into(name, start, view)
            continue
        if count:
            store.read_range(name, start, view[:count])
        view[count:].zero_()


def write_shard_async(
    store: ShardStore, prefix: str, unit: ShardedUnit, rank: int, views: Sequence[tuple[str, torch.Tensor]]
) -> list[Future]:
    """Start writing rank ``rank``'s shard of each ``(kind, view)`` of ``unit`` under ``prefix``;
    the views must not change until the futures complete."""
    start = unit.shard_slice(rank).start
    return [store.write_async(array_name(prefix, unit.name, kind), start, view) for kind, view in views]


def write_shard(
    store: ShardStore, prefix: str, unit: ShardedUnit, rank: int, views: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """Write rank ``rank``'s shard of each ``(kind, view)`` of ``unit`` under ``prefix``; blocks."""
    start = unit.shard_slice(rank).start
    for kind, view in views:
        store.write_from(array_name(prefix, unit.name, kind), start, view)
