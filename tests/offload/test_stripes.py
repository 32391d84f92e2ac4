"""A store striped across several folders: chunks spread over every folder, the store's nodes
kept alike in each, durability in each, and the list of folders checked on every open."""

import os
import shutil
from pathlib import Path

import pytest
import torch
import zarr

from offload.generations import Generations
from offload.io import IORunner
from offload.store import ShardStore
from tests.offload.test_store import CHUNK, NCHUNKS, NUMEL, RecordingOps, aligned_empty, random_bits, same_bits

NAME = "gen-0/blocks.0/master"


@pytest.fixture
def runner():
    with IORunner(threads=4, queue_depth=8) as r:
        yield r


def folders(tmp_path: Path, count: int) -> list[Path]:
    return [tmp_path / f"drive-{i}" / "store" for i in range(count)]


def striped(tmp_path: Path, runner: IORunner, count: int = 3, **kwargs) -> ShardStore:
    paths = folders(tmp_path, count)
    for path in paths:
        path.parent.mkdir(exist_ok=True)
    return ShardStore.create(paths[0], {"layout": {}}, runner=runner, stripes=paths[1:], **kwargs)


def chunk_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("c/*") if p.is_file()}


def snapshot(paths: list[Path]) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for folder in paths for p in sorted(folder.rglob("*")) if p.is_file()}


def test_chunks_are_spread_over_every_folder_and_read_back(tmp_path, runner) -> None:
    ops = RecordingOps()
    store = striped(tmp_path, runner, file_ops=ops)
    store.create_array(NAME, NUMEL, CHUNK, torch.float32)
    store.create_array("gen-0/blocks.0/exp_avg", CHUNK, CHUNK, torch.float32)  # one chunk: starts one folder on
    src = aligned_empty(NUMEL, torch.float32)
    src.copy_(random_bits(NUMEL, torch.float32))
    store.write_from(NAME, 0, src)
    store.write_from("gen-0/blocks.0/exp_avg", 0, src[:CHUNK])
    store.sync()
    paths = folders(tmp_path, 3)
    for position, folder in enumerate(paths):
        held = {f"{NAME}/c/{k}" for k in range(NCHUNKS) if k % 3 == position}
        assert {f for f in chunk_files(folder) if f.startswith(NAME)} == held
        assert (folder / NAME / "zarr.json").is_file()
    assert chunk_files(paths[1]) >= {"gen-0/blocks.0/exp_avg/c/0"}
    # every chunk file, on each folder, was fsynced by the sync
    assert {str(store.chunk_path(NAME, k)) for k in range(NCHUNKS)} <= set(ops.fsynced)
    reopened = ShardStore.open(paths[0], runner=runner)  # a reader: the folders the store recorded
    out = aligned_empty(NUMEL, torch.float32)
    reopened.read_into(NAME, 0, out)
    assert same_bits(out, src)
    part = torch.empty(CHUNK + 10)
    reopened.read_range(NAME, CHUNK - 5, part)
    assert same_bits(part, src[CHUNK - 5 : 2 * CHUNK + 5])


def test_a_single_folder_store_records_no_list_and_stays_plain_zarr(tmp_path, runner) -> None:
    store = ShardStore.create(tmp_path / "one", {}, runner=runner)
    store.create_array(NAME, NUMEL, CHUNK, torch.float32)
    store.write_from(NAME, 0, torch.arange(NUMEL, dtype=torch.float32))
    store.sync()
    meta = (tmp_path / "one" / "zarr.json").read_text()
    assert "paths" not in meta and "stripe" not in (tmp_path / "one" / NAME / "zarr.json").read_text()
    assert torch.equal(
        torch.from_numpy(zarr.open_array(tmp_path / "one" / NAME, mode="r")[:]),
        torch.arange(NUMEL, dtype=torch.float32),
    )


def test_moves_deletes_and_generations_act_on_every_folder(tmp_path, runner) -> None:
    store = striped(tmp_path, runner)
    generations = Generations(store)
    store.nodes.build("gen-1", lambda staging: store.create_array(f"{staging}/u/master", NUMEL, CHUNK, torch.float32))
    store.write_from("gen-1/u/master", 0, random_bits(NUMEL, torch.float32))
    store.sync()
    generations.commit(1, {"step": 1})
    generations.keep_generation("step-1", {"generation": 1, "step": 1}, retain=0)
    for folder in folders(tmp_path, 3):
        assert not (folder / "gen-1").exists() and (folder / "checkpoints/step-1/u/master/zarr.json").is_file()
        assert not [p for p in folder.iterdir() if p.name.startswith(".")], "no staging or trash left"
    store.nodes.delete("checkpoints/step-1")
    store.sync()
    assert all(not (folder / "checkpoints/step-1").exists() for folder in folders(tmp_path, 3))


def test_a_move_a_crash_left_done_on_the_other_folders_is_finished(tmp_path, runner) -> None:
    store = striped(tmp_path, runner, count=2)
    store.nodes.build("gen-2", lambda staging: store.create_array(f"{staging}/u/master", NUMEL, CHUNK, torch.float32))
    store.sync()
    second = folders(tmp_path, 2)[1]
    os.rename(second / "gen-2", second / "gen-3")  # the second folder renamed, the first not yet
    store.nodes.move("gen-2", "gen-3")
    assert (folders(tmp_path, 2)[0] / "gen-3").is_dir() and not (second / "gen-2").exists()
    # and a node the first folder no longer holds is an orphan elsewhere, replaced when made again
    shutil.copytree(second / "gen-3", second / "gen-4")
    store.nodes.build("gen-4", lambda staging: store.create_array(f"{staging}/v/master", NUMEL, CHUNK, torch.float32))
    assert sorted(p.name for p in (second / "gen-4").iterdir()) == ["v", "zarr.json"]


def test_another_order_a_missing_folder_or_another_count_is_refused_by_name(tmp_path, runner) -> None:
    store = striped(tmp_path, runner)
    store.create_array(NAME, NUMEL, CHUNK, torch.float32)
    store.write_from(NAME, 0, random_bits(NUMEL, torch.float32))
    store.sync()
    first, second, third = folders(tmp_path, 3)
    before = snapshot([first, second, third])
    with pytest.raises(ValueError, match=rf"keeps path 2 of its chunks at {second}, not {third}.*in that order"):
        ShardStore.open(first, runner=runner, stripes=[third, second])
    with pytest.raises(ValueError, match=rf"made with 3 path\(s\) and this list of 2 lacks {third}"):
        ShardStore.open(first, runner=runner, stripes=[second])
    with pytest.raises(ValueError, match=r"made with 3 path\(s\) and this list of 4 adds"):
        ShardStore.open(first, runner=runner, stripes=[second, third, tmp_path / "x"])
    with pytest.raises(ValueError, match=rf"holds a share of the chunks of offload store {first}"):
        ShardStore.open(second, runner=runner)
    shutil.move(third, tmp_path / "unmounted")
    with pytest.raises(FileNotFoundError, match=rf"path 3 of offload store {first}, {third}, is missing.*mount"):
        ShardStore.open(first, runner=runner, stripes=[second, third])
    shutil.move(tmp_path / "unmounted", third)
    assert snapshot([first, second, third]) == before


def test_creating_is_refused_before_any_folder_changes(tmp_path, runner) -> None:
    first, second = folders(tmp_path, 2)
    first.mkdir(parents=True)
    (first / "mine.txt").write_text("keep")
    with pytest.raises(FileNotFoundError, match=rf"cannot stripe offload store {first} across {second}.*mount"):
        ShardStore.create(first, {}, runner=runner, stripes=[second], overwrite=True)
    second.parent.mkdir()
    with pytest.raises(ValueError, match="overlap"):
        ShardStore.create(first, {}, runner=runner, stripes=[first / "inner"])
    second.mkdir()
    (second / "other.txt").write_text("theirs")
    with pytest.raises(FileExistsError, match=rf"cannot create an offload store at {first}"):
        ShardStore.create(first, {}, runner=runner, stripes=[second])
    assert (first / "mine.txt").read_text() == "keep" and (second / "other.txt").read_text() == "theirs"


def test_a_store_placing_chunks_by_another_rule_is_refused(tmp_path, runner) -> None:
    store = striped(tmp_path, runner, count=2)
    meta = store.path / "zarr.json"
    text = meta.read_text()
    assert "stripe_start + k" in text
    meta.write_text(text.replace("stripe_start + k", "k"))
    with pytest.raises(
        ValueError, match=r"places its chunks by the rule 'chunk k of an array on path \(k\) mod paths'"
    ):
        ShardStore.open(store.path, runner=runner)


def test_another_stores_share_is_never_overwritten(tmp_path, runner) -> None:
    theirs = striped(tmp_path, runner, count=2)
    mine = tmp_path / "mine"
    ShardStore.create(mine, {}, runner=runner)  # a store to replace, striped across their share
    before = snapshot(list(theirs.paths))
    share = theirs.paths[1]
    with pytest.raises(FileExistsError, match=rf"refusing to overwrite {share}: it holds a share of offload store"):
        ShardStore.create(mine, {}, runner=runner, stripes=[share], overwrite=True)
    assert snapshot(list(theirs.paths)) == before and (mine / "zarr.json").is_file()
    again = ShardStore.create(
        theirs.path, {}, runner=runner, stripes=[share], overwrite=True
    )  # its own share: replaced
    assert again.paths == theirs.paths
