"""Shards in a store: how one unit's kinds of state are named, cut and moved, by rank.

A unit's state of each kind (an fp32 master, a moment, a compute-dtype parameter...) is one
1-D array of ``padded_numel`` elements in chunks of ``chunk_numel``, named
``<prefix>/<unit>/<kind>`` under a generation or checkpoint ``prefix`` (or ``<unit>/<kind>``
at the top of a store that keeps one copy, ``TOP``); rank ``r`` owns the
elements ``shard_slice(r)``, whole chunks of it. The trainer's unit layout only has to say
those few numbers (``ShardedUnit``): this module, and so the on-disk format, needs nothing
else from it.

A store written for another cutting (another world size or chunk size) stays readable: a
unit's content is the first ``numel`` elements of its arrays whatever their padding, so a
shard is read range by range from the chunks that cover it, its padding zeroed.

Tools that read a whole array without a model (verifying a store, consolidating its weights)
go chunk by chunk through a ``ChunkReader``, so their memory is a few chunks whatever the
model's size.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from offload.host_memory import host_bytes
from offload.io import IORunner
from offload.metadata import ArrayInfo
from offload.store import ShardStore

TOP = ""
"""The prefix of arrays at a store's top: a store that keeps one copy of each unit's state,
outside any generation."""


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
    or a checkpoint; empty in a store that keeps one copy of each, at its top)."""
    return f"{prefix}/{unit}/{kind}" if prefix else f"{unit}/{kind}"


def unit_arrays(store: ShardStore, prefix: str) -> dict[str, tuple[str, str]]:
    """Every array under ``prefix``, each with the ``(unit, kind)`` its name says (the inverse
    of ``array_name``)."""
    lead = f"{prefix}/" if prefix else ""
    arrays = {}
    for name in store.array_names():
        if name.startswith(lead):
            unit, _, kind = name[len(lead) :].rpartition("/")
            arrays[name] = (unit, kind)
    return arrays


def shard_bytes(unit: ShardedUnit, dtype: torch.dtype) -> int:
    """Bytes of one rank's shard of one kind of ``unit``'s state, stored as ``dtype``."""
    return unit.shard_numel * dtype.itemsize


def array_bytes(unit: ShardedUnit, dtype: torch.dtype) -> int:
    """Bytes of one kind of ``unit``'s state on disk for all ranks (padding included, CRC
    trailers not), stored as ``dtype``."""
    return unit.padded_numel * dtype.itemsize


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
    (a host tensor), from chunks cut for another layout too (see the module's note); blocks.
    Every chunk of every kind is in flight at once, each on its own I/O thread."""
    start = unit.shard_slice(rank).start
    count = min(max(unit.numel - start, 0), unit.shard_numel)
    in_layout = []
    # Another layout's ranges first: were one to fail, no read of this call would be left
    # writing into the views, which the caller may then reuse.
    for kind, view in views:
        name = array_name(prefix, unit.name, kind)
        if array_in_layout(store, name, unit):
            in_layout.append((name, view))
            continue
        if count:
            store.read_range(name, start, view[:count])
        view[count:].zero_()
    IORunner.gather([store.read_async(name, start, view) for name, view in in_layout]).result()


def read_shard_async(
    store: ShardStore, prefix: str, unit: ShardedUnit, rank: int, views: Sequence[tuple[str, torch.Tensor]]
) -> list[Future]:
    """Start reading rank ``rank``'s shard of each ``(kind, view)`` of ``unit`` under ``prefix``
    from arrays cut as ``unit`` is (whole chunks, in place); the views must not be touched
    until the futures complete."""
    start = unit.shard_slice(rank).start
    return [store.read_async(array_name(prefix, unit.name, kind), start, view) for kind, view in views]


def write_shard_async(
    store: ShardStore, prefix: str, unit: ShardedUnit, rank: int, views: Sequence[tuple[str, torch.Tensor]]
) -> list[Future]:
    """Start writing rank ``rank``'s shard of each ``(kind, view)`` of ``unit`` under ``prefix``;
    the views must not change until the futures complete."""
    start = unit.shard_slice(rank).start
    return [store.write_async(array_name(prefix, unit.name, kind), start, view) for kind, view in views]


def zero_shard_async(
    store: ShardStore, prefix: str, unit: ShardedUnit, rank: int, kinds: Sequence[str]
) -> list[Future]:
    """Start making rank ``rank``'s shard of each of ``kinds`` of ``unit`` under ``prefix`` zeros,
    with nothing written but each chunk's checksum (``ShardStore.write_zeros_async``)."""
    start = unit.shard_slice(rank).start
    return [store.write_zeros_async(array_name(prefix, unit.name, kind), start, unit.shard_numel) for kind in kinds]


def write_shard(
    store: ShardStore, prefix: str, unit: ShardedUnit, rank: int, views: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """Write rank ``rank``'s shard of each ``(kind, view)`` of ``unit`` under ``prefix``; blocks.
    Every chunk of every kind is in flight at once, each on its own I/O thread."""
    IORunner.gather(write_shard_async(store, prefix, unit, rank, views)).result()


READ_AHEAD = 2
"""Chunks a ``ChunkReader`` has in flight beyond the one it hands out: the disk keeps reading
while the caller casts and writes that one (an export waited on each read in turn and moved
0.34 of the disk's raw speed), for two chunks of memory more."""


class ChunkReader:
    """Reads chunks into a few reused page-aligned buffers (read with O_DIRECT), each grown to
    the largest chunk it has held, so memory stays a few chunks whatever the size of the arrays
    or the model. A chunk's file is checked against its metadata before a buffer grows for it:
    metadata claiming a huge chunk allocates nothing."""

    def __init__(self, store: ShardStore, names: Iterable[str], read_ahead: int = READ_AHEAD):
        self.store = store
        self.infos: dict[str, ArrayInfo] = {name: store.array_info(name) for name in names}
        self._buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(read_ahead + 1)]

    def read(self, name: str, index: int) -> torch.Tensor:
        """Chunk ``index`` of array ``name``, checksum verified; valid until the next read or piece."""
        out, future = self._start(0, name, index)
        future.result()
        return out

    def contents(self, arrays: Iterable[tuple[str, int]]) -> Iterator[tuple[str, int, torch.Tensor]]:
        """The first ``numel`` elements of each ``(name, numel)`` (a unit's content, its padding
        left out), chunk by chunk in order, as ``(name, start, values)``: elements ``[start,
        start + len(values))`` of array ``name``, valid until the next piece. The next chunks,
        across arrays, are read meanwhile."""
        pieces = (
            (name, index, index * size, min(size, numel - index * size))
            for name, numel in arrays
            for size in (self.infos[name].chunk_elems,)
            for index in range(-(-numel // size))
        )
        in_flight: collections.deque[tuple[str, int, torch.Tensor, Future]] = collections.deque()
        try:
            for slot, (name, index, start, count) in enumerate(pieces):
                out, future = self._start(slot % len(self._buffers), name, index)
                in_flight.append((name, start, out[:count], future))
                if len(in_flight) == len(self._buffers):
                    yield _ready(in_flight.popleft())
            while in_flight:
                yield _ready(in_flight.popleft())
        finally:  # a caller that stops early: no read may still be filling a buffer
            for *_, future in in_flight:
                future.exception()

    def _start(self, slot: int, name: str, index: int) -> tuple[torch.Tensor, Future]:
        """Start reading chunk ``index`` of ``name`` into buffer ``slot``: its values, and the read."""
        info = self.infos[name]
        if info.chunk_bytes > self._buffers[slot].numel():
            self.store.check_chunk_file(name, index)
            self._buffers[slot] = host_bytes(info.chunk_bytes, huge_pages=True)
        out = self._buffers[slot][: info.chunk_bytes].view(info.dtype)
        return out, self.store.read_async(name, index * info.chunk_elems, out)


def _ready(piece: tuple[str, int, torch.Tensor, Future]) -> tuple[str, int, torch.Tensor]:
    name, start, values, future = piece
    future.result()
    return name, start, values
