"""A run whose store is striped across several folders (``offload.nvme_path`` a list): it trains
and resumes bit for bit as with one folder, each folder holds a share of the chunks, another
list of folders is refused naming the folder with the store untouched, a full folder is named,
and the tools read the store."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import offload.chunks
import offload.generations
from engine.config import Config
from engine.engine import Engine
from engine.run.train import train
from engine.tools.consolidate import consolidate
from engine.tools.estimate.machine import striped_free
from engine.tools.gather import gather
from engine.tools.inspect import format_report, inspect_store
from tests.caches import fresh_cache
from tests.engine.test_hosts import train_span
from tests.engine.test_inspect import wide_gpt
from tests.engine.test_resume import params, run
from tests.ranks import run_ranks
from tests.training import config, tiny_gpt


def drives(tmp_path: Path, count: int = 2) -> list[Path]:
    """A store folder on each of ``count`` "drives" (folders here)."""
    paths = [tmp_path / f"drive-{i}" / "store" for i in range(count)]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    return paths


def striped(paths: list[Path], stage: int = 2, clip: float = 0.0, store: dict | None = None, **offload) -> Config:
    """The nvme tier in ``paths`` (the parameters too at stage 3); a ``clip`` spills gradients there."""
    nvme_path = [str(p) for p in paths] if len(paths) > 1 else str(paths[0])
    sections = {"optimizer": "nvme", "nvme_path": nvme_path, **offload}
    if stage == 3:
        sections["param"] = "nvme"
    return config(zero={"stage": stage}, offload=sections, optim={"grad_clip": clip}, store=store or {})


def chunk_bytes(folder: Path) -> int:
    """Bytes of chunk files under ``folder`` (a store's or a share's), nested stores included."""
    return sum(p.stat().st_size for p in folder.rglob("c/*") if p.is_file())


def snapshot(paths: list[Path]) -> dict[str, bytes]:
    """Every file of the folders but the writer lock (its holder record is rewritten by whoever takes it)."""
    return {str(p): p.read_bytes() for f in paths for p in sorted(f.rglob("*")) if p.is_file() and p.name != "LOCK"}


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # the default run keeps stage 3
def test_two_folders_train_and_resume_bit_identically_to_one(tmp_path, stage: int) -> None:
    clip = 1.0 if stage == 2 else 0.0  # at stage 2 with gradients spilled to disk
    one = Engine(tiny_gpt(), striped([tmp_path / "one"], stage, clip), total_steps=6)
    expected_losses, expected = run(one, 6), params(one)
    one.close()

    paths = drives(tmp_path)
    first = Engine(tiny_gpt(), striped(paths, stage, clip), total_steps=6)
    losses = run(first, 3)
    if clip:
        assert all(chunk_bytes(p / "scratch") > 0 for p in paths), "spilled gradients are striped too"
    first.close()
    shares = [chunk_bytes(p) for p in paths]
    assert min(shares) > 0.3 * sum(shares), f"each folder holds a share of the chunks: {shares}"
    if stage == 3:
        assert all(chunk_bytes(p / "params") > 0 for p in paths), "the parameter store is striped too"
    resumed = Engine.resume(tiny_gpt(seed=99), striped(paths, stage, clip), total_steps=6)
    assert resumed.global_step == 3
    losses += run(resumed, 3)
    got = params(resumed)
    resumed.close()
    assert losses == expected_losses
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_another_list_of_folders_is_refused_by_name_and_changes_nothing(tmp_path) -> None:
    paths = drives(tmp_path, 3)
    eng = Engine(tiny_gpt(), striped(paths), total_steps=4)
    run(eng, 2)
    eng.close()
    before = snapshot(paths)
    first, second, third = paths
    with pytest.raises(ValueError, match=rf"keeps path 2 of its chunks at {second}, not {third}.*in that order"):
        Engine.resume(tiny_gpt(), striped([first, third, second]), total_steps=4)
    with pytest.raises(ValueError, match=rf"made with 3 path\(s\) and this list of 2 lacks {third}"):
        Engine.resume(tiny_gpt(), striped([first, second]), total_steps=4)
    with pytest.raises(ValueError, match=rf"{second} holds a share of the chunks of offload store {first}"):
        Engine.resume(tiny_gpt(), striped([second, first, third]), total_steps=4)
    assert not (second / "LOCK").exists(), "a share is never locked as if it were a store"
    shutil.move(third, tmp_path / "unmounted")
    with pytest.raises(FileNotFoundError, match=rf"path 3 of offload store {first}, {third}, is missing.*mount"):
        Engine.resume(tiny_gpt(), striped(paths), total_steps=4)
    shutil.move(tmp_path / "unmounted", third)
    assert snapshot(paths) == before
    resumed = Engine.resume(tiny_gpt(), striped(paths), total_steps=4)
    assert resumed.global_step == 2
    resumed.close()


def test_a_full_folder_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    first, second = drives(tmp_path)
    overrides = ["preset=tiny", "compute_dtype=fp32", "seq_len=32", "micro_batch=2", "log_every=1", "steps=6"]
    cfg = Config.from_dict({}, [*overrides, f"nvme_path={first},{second}"])  # the command line's form
    assert cfg.offload.nvme_paths == [str(first), str(second)]
    commit, write = offload.generations.commit, offload.chunks.ChunkFiles.write
    commits = []

    def counting_commit(path, record, name="COMMITTED"):
        if name == "COMMITTED":  # not the store's NEW mark
            commits.append(record.get("step"))
        commit(path, record, name)

    def write_until_full(files, name, index, path, *args, **kwargs):
        if len(commits) >= 3 and path.startswith(str(second)):  # generation 0, steps 1 and 2, then full
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(files, name, index, path, *args, **kwargs)

    monkeypatch.setattr(offload.generations, "commit", counting_commit)
    monkeypatch.setattr(offload.chunks.ChunkFiles, "write", write_until_full)
    with pytest.raises(OSError, match=rf"the disk of {second} \(folder 2 of store {first}\) is full .*step 2") as full:
        train(cfg)
    assert full.value.errno == errno.ENOSPC and "\n" not in str(full.value)
    del full  # its traceback holds the engine, and with it the store's lock
    monkeypatch.setattr(offload.chunks.ChunkFiles, "write", write)
    result = train(cfg)
    assert result.steps_done == 6 and len(result.losses) == 4, "continued from step 2"


def test_inspect_and_consolidate_read_a_striped_store(tmp_path) -> None:
    paths = drives(tmp_path)
    eng = Engine(wide_gpt(), striped(paths, chunk_mb=1), total_steps=2)
    run(eng, 2)
    trained = params(eng)
    eng.close()
    assert all(chunk_bytes(p) > 0 for p in paths)
    report = inspect_store(paths[0], verify=True)
    assert report["committed"]["step"] == 2 and report["verify"]["failures"] == []
    assert report["paths"] == [str(p) for p in paths] and str(paths[1]) in format_report(report)
    consolidate(paths[0], tmp_path / "weights.safetensors")
    weights = load_file(tmp_path / "weights.safetensors")
    assert all(torch.equal(weights[name], trained[name]) for name in trained)


def test_the_config_takes_a_list_or_commas_and_checks_every_folder() -> None:
    listed = Config.from_dict({"offload": {"nvme_path": ["/a/node-{node}", "/b/node-{node}"]}})
    assert listed.offload.node_local and listed.offload.on_node(1).nvme_paths == ["/a/node-1", "/b/node-1"]
    assert listed.offload.store_path == "/a/node-{node}" and listed.offload.stripe_paths == ("/b/node-{node}",)
    assert Config.from_dict({}, ["nvme_path=/a,/b"]).offload.nvme_paths == ["/a", "/b"]
    assert Config.from_dict({}, ['nvme_path=["/a", "/b"]']).offload.nvme_paths == ["/a", "/b"]
    assert Config.from_dict({}, ["nvme_path=/a"]).offload.on_node(0).nvme_path == "/a"
    with pytest.raises(ValueError, match=r"offload.nvme_path = .*\{node\} in some folders only: put it in every one"):
        Config.from_dict({"offload": {"nvme_path": ["/a/{node}", "/b"]}}).validate()
    with pytest.raises(ValueError, match="names a folder twice"):
        Config.from_dict({}, ["nvme_path=/a,/a"]).validate()
    with pytest.raises(ValueError, match="names an empty folder"):
        Config.from_dict({}, ["nvme_path=/a,"]).validate()


@pytest.mark.slow  # two processes: about 25 s
def test_hosts_stripe_their_own_stores_and_gather_into_one(tmp_path) -> None:
    per_host = [str(tmp_path / drive / "node-{node}") for drive in ("drive-0", "drive-1")]
    for drive in ("drive-0", "drive-1"):
        (tmp_path / drive).mkdir()
    cfg = config(zero={"stage": 2}, offload={"optimizer": "nvme", "nvme_path": per_host})
    hosts = run_ranks(2, train_span, cfg, 0, 2, 2, nodes=2)
    for node in range(2):  # {node} in every folder: each host stripes its store across its own
        assert all(chunk_bytes(tmp_path / drive / f"node-{node}") > 0 for drive in ("drive-0", "drive-1"))
    assert gather(tmp_path / "one", [tmp_path / "drive-0" / "node-0", tmp_path / "drive-0" / "node-1"]) == 2
    assert inspect_store(tmp_path / "one")["paths"] == [str(tmp_path / "one")]
    consolidate(tmp_path / "one", tmp_path / "weights.safetensors")
    weights = load_file(tmp_path / "weights.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in hosts[0]["params"].items())


def test_the_estimate_counts_the_room_of_each_disk_once(tmp_path, monkeypatch) -> None:
    first, second = drives(tmp_path)
    first.mkdir()
    second.mkdir()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**9))
    assert striped_free([first]) == striped_free([first, second]) == 10**9  # one disk: no more room
    devices = {str(first): 1, str(second): 2}
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda path: SimpleNamespace(st_dev=devices.get(str(path), real_stat(path).st_dev)))
    assert striped_free([first, second]) == 2 * 10**9  # two disks: each holds half


def test_the_disk_check_names_the_folder_without_room_for_its_share(tmp_path, monkeypatch) -> None:
    first, second = drives(tmp_path)
    usage, free = namedtuple("usage", "total used free"), shutil.disk_usage
    room = {str(second.parent): 10**3}  # the second drive is all but full
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, room.get(str(path), free(path).free)))
    with pytest.raises(OSError, match=rf"nvme_path = '{second}': the store needs .* there \(its share \(1 of 2"):
        Engine(tiny_gpt(), striped([first, second]), total_steps=1)
    assert not first.exists() and not second.exists(), "a refused run leaves no folder behind"


def test_in_place_a_checkpoint_copied_across_folders_resumes_as_with_one(tmp_path) -> None:
    results = []
    for paths in ([tmp_path / "one"], drives(tmp_path)):
        cfg = striped(paths, store={"mode": "in-place"})
        eng = Engine(tiny_gpt(), cfg, total_steps=5)
        losses = run(eng, 2)
        eng.save("step-2")  # nothing supersedes an in-place generation: copied chunk by chunk
        losses += run(eng, 1)
        eng.close()
        resumed = Engine.resume(tiny_gpt(seed=99), cfg, checkpoint="step-2", total_steps=5)
        losses += run(resumed, 3)
        results.append((losses, params(resumed)))
        resumed.close()
        assert all((p / "checkpoints" / "step-2").is_dir() and chunk_bytes(p / "checkpoints") > 0 for p in paths)
    (expected_losses, expected), (losses, got) = results
    assert losses == expected_losses and all(torch.equal(got[k], expected[k]) for k in expected)
