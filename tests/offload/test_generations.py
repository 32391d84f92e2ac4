"""Generations: the next write target is recycled by rename, never the committed one; a
generation rewritten in place is marked dirty until the next commit, and copied chunk by chunk."""

from __future__ import annotations

import pytest
import torch

import offload.chunks
from offload.chunks import ChecksumError
from offload.generations import DIRTY, KEEP, Generations
from offload.io import IORunner
from offload.store import ShardStore


def make(tmp_path):
    runner = IORunner(threads=2)
    store = ShardStore.create(tmp_path / "s", {}, runner=runner)
    return store, Generations(store), [], runner


def make_creator(store, created: list[str]):
    def create(prefix: str) -> None:
        created.append(prefix)
        store.create_array(f"{prefix}/u/master", 4096, 4096, torch.float32)

    return create


def test_prepare_creates_then_recycles_the_superseded_generation(tmp_path) -> None:
    store, gens, created, runner = make(tmp_path)
    create = make_creator(store, created)
    assert gens.committed() is None
    gens.prepare(0, create)
    store.write_from("gen-0/u/master", 0, torch.full((4096,), 1.0))
    store.sync()
    gens.commit(0, {"step": 0})
    gens.prepare(1, create)
    assert len(created) == 2 and gens.on_disk() == [0, 1], "each generation was created (under a staging name)"
    store.write_from("gen-1/u/master", 0, torch.full((4096,), 2.0))
    store.sync()
    gens.commit(1, {"step": 1})
    gens.prepare(2, create)  # gen-0 is superseded: renamed, not created
    assert len(created) == 2
    assert gens.on_disk() == [1, 2]
    assert gens.committed() == {"generation": 1, "step": 1, "serial": 2}
    out = torch.empty(4096)
    store.read_into("gen-1/u/master", 0, out)
    assert torch.equal(out, torch.full((4096,), 2.0)), "the committed generation is never touched"
    gens.prepare(2, create)  # idempotent: a crash between commit and prepare is harmless
    assert gens.on_disk() == [1, 2]
    runner.close()


def test_uncommitted_leftover_is_recycled_after_a_crash(tmp_path) -> None:
    store, gens, _, runner = make(tmp_path)
    create = make_creator(store, [])
    gens.prepare(0, create)
    store.sync()
    gens.commit(0, {"step": 0})
    gens.prepare(1, create)
    # a crash mid-step left gen-1 half written and uncommitted; the next run targets gen-1 again
    gens.prepare(1, lambda p: (_ for _ in ()).throw(AssertionError("must not create")))
    assert gens.on_disk() == [0, 1]
    runner.close()


def committed_generation(tmp_path):
    """A store whose generation 0 (two arrays of different chunk sizes, random data) is committed."""
    store, gens, _, runner = make(tmp_path)
    store.create_array("gen-0/u/master", 8 * 1024, 1024, torch.float32)
    store.create_array("gen-0/v/exp_avg", 3 * 2048, 2048, torch.float32)
    data = {"u/master": torch.randn(8 * 1024), "v/exp_avg": torch.randn(3 * 2048)}
    for name, values in data.items():
        store.write_from(f"gen-0/{name}", 0, values)
    store.sync()
    gens.commit(0, {"step": 0})
    return store, gens, data, runner


def test_a_dirty_mark_holds_until_the_next_commit_voids_it(tmp_path) -> None:
    store, gens, _, runner = committed_generation(tmp_path)
    assert gens.committed()["serial"] == 1 and gens.dirty() is None
    gens.mark_dirty()
    gens.mark_dirty()  # every writer marks before its own first write: idempotent
    assert gens.dirty() == {"generation": 0, "step": 0, "over": 1}
    mark = (store.path / DIRTY).read_bytes()
    gens.commit(0, {"step": 1})
    assert gens.dirty() is None and not (store.path / DIRTY).exists()
    # A crash between the commit and the removal of the mark: the new serial already voids it.
    (store.path / DIRTY).write_bytes(mark)
    assert gens.dirty() is None
    with pytest.raises(ValueError, match="'serial' of a committed record is reserved"):
        gens.commit(0, {"step": 2, "serial": 9})
    runner.close()


def test_copy_moves_every_chunk_through_a_small_buffer_with_its_checksum(tmp_path, monkeypatch) -> None:
    store, gens, data, runner = committed_generation(tmp_path)
    read_bytes: list[int] = []
    read_async = ShardStore.read_async
    crcs_computed = []
    crc32c_of = offload.chunks.crc32c_of

    def recording(self, name, start, out):
        read_bytes.append(out.numel() * out.element_size())
        return read_async(self, name, start, out)

    def counting(buf):
        crcs_computed.append(buf.size)
        return crc32c_of(buf)

    monkeypatch.setattr(ShardStore, "read_async", recording)
    monkeypatch.setattr(offload.chunks, "crc32c_of", counting)
    gens.create_like("gen-0", "gen-7")
    buffer = torch.empty(4 * 8192, dtype=torch.uint8)  # two halves of two 4 KiB or one 8 KiB chunk
    for part in range(3):  # three processes sharing the copy, each its own chunks
        gens.copy("gen-0", "gen-7", buffer, part=(part, 3))
    store.sync()
    assert max(read_bytes) <= buffer.numel() // 2
    assert sum(crcs_computed) == sum(v.numel() * 4 for v in data.values()), (
        "each chunk's CRC computed once: verified on read, reused for the write"
    )
    for name, values in data.items():
        out = torch.empty_like(values)
        store.read_into(f"gen-7/{name}", 0, out)
        assert torch.equal(out, values)
        chunks = sorted((store.path / "gen-0" / name / "c").iterdir())
        assert [c.read_bytes() for c in chunks] == [
            (store.path / "gen-7" / name / "c" / c.name).read_bytes() for c in chunks
        ]
    with pytest.raises(ValueError, match="cannot hold two 8192-byte chunks of array 'gen-0/v/exp_avg'"):
        gens.copy("gen-0", "gen-7", torch.empty(8192, dtype=torch.uint8))
    runner.close()


def test_copy_reports_a_damaged_source_chunk(tmp_path) -> None:
    store, gens, _, runner = committed_generation(tmp_path)
    chunk = store.path / "gen-0" / "u" / "master" / "c" / "3"
    damaged = bytearray(chunk.read_bytes())
    damaged[5] ^= 0x01
    chunk.write_bytes(bytes(damaged))
    gens.create_like("gen-0", "gen-1")
    with pytest.raises(ChecksumError, match="'gen-0/u/master' chunk 3"):
        gens.copy("gen-0", "gen-1", torch.empty(4 * 8192, dtype=torch.uint8))
    runner.close()


def test_a_pending_keep_is_withdrawn_and_the_latest_checkpoint_found(tmp_path) -> None:
    store, gens, _, runner = committed_generation(tmp_path)
    assert gens.latest_checkpoint() is None
    gens.keep("first", retain=0)
    gens.drop_keep_request()
    assert KEEP not in gens.committed() and gens.committed()["serial"] == 1
    for tag in ("b-older", "a-newer"):
        generation = gens.next_free()
        gens.create_like("gen-0", f"gen-{generation}")
        gens.copy("gen-0", f"gen-{generation}", torch.empty(4 * 8192, dtype=torch.uint8))
        store.sync()
        gens.keep_generation(tag, {**gens.own_record(), "generation": generation}, retain=0)
    assert gens.latest_checkpoint() == "a-newer", "by the order they were kept, not by name"
    assert "serial" not in gens.checkpoints()["a-newer"]
    runner.close()


def test_a_store_committed_together_with_others_can_go_back_one_commit(tmp_path) -> None:
    """One of several hosts' stores: a commit keeps the record it replaces, and leaves the
    superseded generation (and its pending keep) until every host has committed, so a store
    that committed a step the others did not goes back to the step they hold."""
    store, gens, _, runner = make(tmp_path)
    create = make_creator(store, [])
    gens.prepare(0, create)
    gens.commit(0, {"step": 0}, together=True)
    assert gens.previous() is None, "the first commit replaces nothing"
    gens.prepare(1, create)
    gens.keep("step-0", retain=0)
    gens.commit(1, {"step": 1}, together=True)
    assert gens.on_disk() == [0, 1] and not gens.checkpoints(), "gen-0 stays until every host has committed"
    assert gens.previous() == {"generation": 0, "step": 0, "serial": 1, KEEP: {"tag": "step-0", "retain": 0}}
    gens.roll_back()
    assert gens.committed() == {"generation": 0, "step": 0, "serial": 3, KEEP: {"tag": "step-0", "retain": 0}}
    gens.commit(1, {"step": 1}, together=True)  # the step taken again
    gens.prepare(2, create)  # every host has committed: the superseded generation is kept, then a fresh one made
    assert list(gens.checkpoints()) == ["step-0"] and gens.previous() is None
    with pytest.raises(ValueError, match="no longer holds it"):
        gens.roll_back()
    runner.close()
