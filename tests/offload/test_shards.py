"""Shards in a store, against any unit layout that says its sizes: named, cut, moved by rank,
and read back from another cutting."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import pytest
import torch

from offload.chunks import FileOps
from offload.io import IORunner
from offload.shards import (
    TOP,
    ChunkReader,
    array_bytes,
    array_in_layout,
    array_name,
    create_arrays,
    read_shard,
    read_shard_async,
    shard_bytes,
    unit_arrays,
    write_shard,
    write_shard_async,
)
from offload.store import ShardStore

KINDS = ("master", "exp_avg")


@dataclass(frozen=True)
class Unit:
    """A unit of ``numel`` elements cut into ``ranks`` shards of whole ``chunk_numel`` chunks."""

    name: str
    numel: int
    chunk_numel: int
    ranks: int

    @property
    def shard_numel(self) -> int:
        chunks = -(-self.numel // (self.chunk_numel * self.ranks))
        return chunks * self.chunk_numel

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.ranks

    def shard_slice(self, rank: int) -> slice:
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)


def values(unit: Unit, kind: str) -> torch.Tensor:
    """The unit's content of ``kind``, padding zero."""
    full = torch.zeros(unit.padded_numel)
    full[: unit.numel] = torch.arange(unit.numel, dtype=torch.float32) + (1000.0 if kind == "exp_avg" else 0.0)
    return full


def test_each_rank_writes_its_shard_and_another_cutting_reads_it_back(tmp_path) -> None:
    with IORunner(threads=2) as runner:
        store = ShardStore.create(tmp_path / "store", {}, runner=runner)
        two = Unit("blocks.0", numel=5000, chunk_numel=1024, ranks=2)
        create_arrays(store, "gen-0", [two], KINDS, torch.float32)
        for rank in range(2):
            views = [(kind, values(two, kind)[two.shard_slice(rank)].clone()) for kind in KINDS]
            if rank == 0:
                write_shard(store, "gen-0", two, rank, views)
            else:  # the asynchronous form, waited for
                for future in write_shard_async(store, "gen-0", two, rank, views):
                    future.result()
        store.sync()
        assert array_in_layout(store, array_name("gen-0", "blocks.0", "master"), two)

        three = Unit("blocks.0", numel=5000, chunk_numel=512, ranks=3)  # another world size and chunk size
        assert not array_in_layout(store, array_name("gen-0", "blocks.0", "master"), three)
        for rank in range(3):
            views = [(kind, torch.full((three.shard_numel,), -1.0)) for kind in KINDS]
            read_shard(store, "gen-0", three, rank, views)
            for kind, view in views:
                assert torch.equal(view, values(three, kind)[three.shard_slice(rank)]), (rank, kind)


def test_arrays_at_the_top_are_read_ahead_and_named_back(tmp_path) -> None:
    with IORunner(threads=2) as runner:
        store = ShardStore.create(tmp_path / "store", {}, runner=runner)
        unit = Unit("blocks.0", numel=3000, chunk_numel=1024, ranks=2)
        create_arrays(store, TOP, [unit], ("param",), torch.float32)
        create_arrays(store, "gen-1", [unit], KINDS, torch.float32)
        assert array_name(TOP, "blocks.0", "param") == "blocks.0/param"
        assert unit_arrays(store, "gen-1") == {f"gen-1/blocks.0/{kind}": ("blocks.0", kind) for kind in KINDS}
        assert unit_arrays(store, TOP)["blocks.0/param"] == ("blocks.0", "param")
        full = values(unit, "master")
        for rank in range(2):
            write_shard(store, TOP, unit, rank, [("param", full[unit.shard_slice(rank)].clone())])
        out = torch.empty(unit.shard_numel)
        [future] = read_shard_async(store, TOP, unit, 1, [("param", out)])
        future.result()
        assert torch.equal(out, full[unit.shard_slice(1)])
        assert shard_bytes(unit, torch.bfloat16) == 2 * unit.shard_numel
        assert array_bytes(unit, torch.float32) == 4 * unit.padded_numel == store.array_info("blocks.0/param").nbytes


def test_a_chunk_reader_gives_units_content_chunk_by_chunk(tmp_path) -> None:
    with IORunner(threads=2) as runner:
        store = ShardStore.create(tmp_path / "store", {}, runner=runner)
        units = [Unit("root", numel=2500, chunk_numel=1024, ranks=2), Unit("head", numel=700, chunk_numel=512, ranks=1)]
        names = [written(store, unit) for unit in units]
        reader = ChunkReader(store, names)
        pieces = [
            (name, start, piece.clone())
            for name, start, piece in reader.contents((n, u.numel) for n, u in zip(names, units, strict=True))
        ]
        assert [(n, start, p.numel()) for n, start, p in pieces] == [
            (names[0], 0, 1024),
            (names[0], 1024, 1024),
            (names[0], 2048, 452),  # the content ends in the third chunk of four
            (names[1], 0, 512),
            (names[1], 512, 188),
        ]
        for name, unit in zip(names, units, strict=True):
            content = torch.cat([p for n, _, p in pieces if n == name])
            assert torch.equal(content, values(unit, "master")[: unit.numel])
        assert torch.equal(reader.read(names[0], 3), torch.zeros(1024)), "padding reads as zeros"


def written(store: ShardStore, unit: Unit) -> str:
    """The name of ``unit``'s master array in generation 0, written by each rank in turn."""
    create_arrays(store, "gen-0", [unit], ("master",), torch.float32)
    for rank in range(unit.ranks):
        write_shard(store, "gen-0", unit, rank, [("master", values(unit, "master")[unit.shard_slice(rank)].clone())])
    return array_name("gen-0", unit.name, "master")


class SlowReads(FileOps):
    """Reads that take a while, so that a read ahead is still running when a piece is handed out."""

    def preadv(self, fd, buf, offset):
        time.sleep(0.01)
        return super().preadv(fd, buf, offset)


def recorded_reads(store: ShardStore) -> list[Future]:
    """Every read ``store`` is asked for from now on, as its future."""
    started: list[Future] = []
    read_async = store.read_async

    def recording(*args) -> Future:
        started.append(read_async(*args))
        return started[-1]

    store.read_async = recording  # type: ignore[method-assign]
    return started


@pytest.fixture
def slow_chunks(tmp_path) -> Iterator[tuple[ShardStore, Unit, str, list[Future]]]:
    """A one-rank array of ten chunks in a store whose reads take a while: the store, the unit,
    the array's name, and every read asked for from then on."""
    with IORunner(threads=4) as runner:
        store = ShardStore.create(tmp_path / "store", {}, runner=runner, file_ops=SlowReads())
        unit = Unit("root", numel=10 * 1024, chunk_numel=1024, ranks=1)
        name = written(store, unit)
        yield store, unit, name, recorded_reads(store)


def test_a_chunk_reader_reads_ahead_without_touching_the_piece_handed_out(slow_chunks) -> None:
    store, unit, name, started = slow_chunks
    reader = ChunkReader(store, [name], read_ahead=2)
    for k, (_, start, piece) in enumerate(reader.contents([(name, unit.numel)])):
        assert len(started) == min(k + 3, 10), "the piece and the two chunks after it are asked for, no more"
        time.sleep(0.05)  # the reads ahead finish meanwhile, into other buffers
        assert torch.equal(piece, values(unit, "master")[start : start + 1024]), f"piece {k} was overwritten"


def test_a_chunk_reader_left_early_waits_for_its_reads(slow_chunks) -> None:
    store, unit, name, started = slow_chunks
    pieces = ChunkReader(store, [name], read_ahead=3).contents([(name, unit.numel)])
    next(pieces)
    pieces.close()
    assert len(started) == 4 and all(f.done() for f in started), "no read is left filling a buffer"
