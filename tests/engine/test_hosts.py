"""Several hosts, each with its own store (``offload.nvme_path`` holding ``{node}``), simulated
by ranks told they run on different nodes: they train as the same ranks on one host do, bit for
bit, commit each step together and resume from the newest step every host holds."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine.build import model_units
from engine.config import ConfigError
from engine.engine import Engine
from engine.runtime.comm import node_of_env
from engine.tiers.hosts import HostStore, common_step
from engine.tiers.optimizer_store import StoreOptimizerState
from engine.tiers.store_io import StoreIO
from engine.tools.consolidate import consolidate
from engine.tools.gather import gather
from engine.tools.inspect import format_report, inspect_store
from offload import IORunner
from tests.ranks import run_ranks
from tests.training import batches, config, tiny_gpt


def host_config(path: str, **offload):
    """Stage 3 with the optimizer state and the parameters on nvme, in the store(s) at ``path``."""
    return config(zero={"stage": 3}, offload={"optimizer": "nvme", "param": "nvme", "nvme_path": path} | offload)


@pytest.mark.slow  # kept out of the default run's 10 minutes; CI runs it with the slow ones
def test_two_hosts_train_as_one_host_does_and_resume_on_one_host_from_their_gathered_stores(tmp_path) -> None:
    straight = run_ranks(2, train_span, host_config(str(tmp_path / "one")), 0, 5, 5, 3)  # after step 3: midway
    per_host, at_2 = host_config(str(tmp_path / "node-{node}")), str(tmp_path / "node-{node}-at-2")
    two = run_ranks(2, train_span, per_host, 0, 3, 5, 2, at_2, nodes=2)
    for rank in range(2):  # bit for bit as the same ranks on one host
        assert two[rank]["losses"] == straight[rank]["losses"][:3]
        assert all(torch.equal(v, straight[rank]["midway"][k]) for k, v in two[rank]["params"].items())
    chunks = []
    for node in range(2):
        store = tmp_path / f"node-{node}"
        assert json.loads((store / "COMMITTED").read_text())["step"] == 3
        assert json.loads((store / "zarr.json").read_text())["attributes"]["hosts"] == {"node": node, "nodes": 2}
        assert f"host {node} of 2" in format_report(inspect_store(store))
        chunks.append(chunk_files(store))
    # Each host's store holds its own rank's chunks, and the two hold what one host's holds.
    assert chunks[0] and chunks[1] and not chunks[0] & chunks[1]
    assert chunks[0] | chunks[1] == chunk_files(tmp_path / "one")

    before = sorted(p.name for p in (tmp_path / "node-0").iterdir())
    with pytest.raises(ValueError, match="python -m engine gather"):  # one host's part alone is refused
        Engine.resume(tiny_gpt(), host_config(str(tmp_path / "node-0")))
    assert sorted(p.name for p in (tmp_path / "node-0").iterdir()) == before
    gathered = tmp_path / "gathered"
    assert gather(gathered, [tmp_path / "node-1", tmp_path / "node-0"]) == 3  # in any order
    consolidate([tmp_path / "node-0", tmp_path / "node-1"], tmp_path / "hosts.safetensors")
    weights = load_file(tmp_path / "hosts.safetensors")
    assert weights.keys() == two[0]["params"].keys()
    assert all(torch.equal(weights[k], v) for k, v in two[0]["params"].items())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "its gather of links is gone"
    with pytest.raises(ValueError, match="holds host 0's part of a run on 2 hosts: pass the stores of all"):
        consolidate(tmp_path / "node-0", tmp_path / "part.safetensors")
    resumed = run_ranks(2, train_span, host_config(str(gathered)), 3, 5, 5)
    for rank in range(2):
        assert resumed[rank]["losses"] == straight[rank]["losses"][3:]
        assert all(torch.equal(resumed[rank]["params"][k], v) for k, v in straight[rank]["params"].items())

    # Host 0 stopped before committing step 3; host 1 committed it, and stopped before it heard
    # that host 0 had (so it still holds step 2): both go on from step 2.
    shutil.rmtree(tmp_path / "node-0")
    shutil.move(tmp_path / "node-0-at-2", tmp_path / "node-0")
    ahead = tmp_path / "node-1-at-2"
    shutil.rmtree(ahead / "gen-3")
    shutil.copytree(tmp_path / "node-1" / "gen-3", ahead / "gen-3")
    shutil.copy(tmp_path / "node-1" / "COMMITTED", ahead / "COMMITTED")
    shutil.rmtree(tmp_path / "node-1")
    shutil.move(ahead, tmp_path / "node-1")
    again = run_ranks(2, train_span, per_host, 2, 3, 5, nodes=2)
    for rank in range(2):
        assert again[rank]["losses"] == straight[rank]["losses"][2:3]
        assert all(torch.equal(v, straight[rank]["midway"][k]) for k, v in again[rank]["params"].items())

    shutil.rmtree(tmp_path / "node-1")
    with pytest.raises(FileNotFoundError, match=r"the store of host 1 \(.*node-1\) is missing"):
        gather(tmp_path / "again", [tmp_path / "node-0", tmp_path / "node-1"])
    assert not (tmp_path / "again").exists()


def chunk_files(store) -> set[str]:
    """The chunk files of the committed generation's masters, relative to it."""
    generation = json.loads((store / "COMMITTED").read_text())["generation"]
    root = store / f"gen-{generation}"
    return {str(p.relative_to(root)) for p in root.glob("*/master/c/*")}


def train_span(cfg, first: int, last: int, total: int, midway: int = 0, copy_to: str = "") -> dict:
    """Steps ``first`` to ``last`` of a ``total``-step run on this rank: afresh from step 0, or
    resumed from the store at ``first``; the losses, the final parameters and those after step
    ``midway``, once committed, when each host also copies its store to ``copy_to`` if given."""
    model = tiny_gpt()
    eng = Engine.resume(model, cfg, total_steps=total) if first else Engine(model, cfg, total_steps=total)
    assert eng.global_step == first
    data = batches(2, eng.comm.rank, eng.comm.world_size)
    for _ in range(first):  # the data position the first steps reached
        data.next()
    losses, midway_params = [], {}
    for step in range(first, last):
        loss = eng(*data.next())
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        if step + 1 == midway:
            midway_params = snapshot(eng)
            eng.flush()  # every host commits the step
            if copy_to and eng.io.leader:
                shutil.copytree(eng.config.offload.nvme_path, copy_to.format(node=eng.comm.node))
            eng.comm.barrier()
    params = snapshot(eng)
    eng.close()
    return {"losses": losses, "params": params, "midway": midway_params}


def snapshot(eng: Engine) -> dict[str, torch.Tensor]:
    with eng.gathered():
        return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def test_hosts_further_apart_than_a_crash_leaves_them_are_refused_naming_each() -> None:
    def host(node: int, step: int, previous: int | None = None) -> HostStore:
        return HostStore(node, f"host{node}", f"/nvme/node-{node}", step, previous, nodes=2, holds=node)

    assert common_step([host(0, 4), host(1, 5, previous=4)], 2) == 4
    with pytest.raises(ValueError, match=r"host 0 \(host0, /nvme/node-0\): step 3; host 1 .*: step 5"):
        common_step([host(0, 3), host(1, 5, previous=4)], 2)
    with pytest.raises(ValueError, match="no step in common"):  # one step ahead, but its step 4 is gone
        common_step([host(0, 4), host(1, 5)], 2)
    with pytest.raises(ValueError, match="holds the part of host 0"):
        common_step([host(0, 4), dataclasses.replace(host(1, 4), holds=0)], 2)
    with pytest.raises(ValueError, match="written by a run on 2 host"):
        common_step([host(0, 4), host(1, 4), dataclasses.replace(host(1, 4), node=2)], 3)


def test_a_store_rewritten_in_place_is_refused_on_several_hosts(tmp_path) -> None:
    io = StoreIO(IORunner(threads=1), checksum=True, direct_io=False, barrier=lambda: None, hosts=2)
    _, _, layout = model_units(tiny_gpt(), config(offload={"chunk_mb": 1}), 2)
    with pytest.raises(ValueError, match='"in-place" keeps one generation'):
        StoreOptimizerState(tmp_path / "s", layout, 0, io, buffer_bytes=1 << 24, mode="in-place")
    assert not (tmp_path / "s").exists()
    io.close()


@pytest.mark.slow
def test_two_hosts_of_two_ranks_train_as_one_host_of_four(tmp_path) -> None:
    """Each host's second rank writes its shards into the store its first rank leads."""
    one = run_ranks(4, train_span, host_config(str(tmp_path / "one")), 0, 2, 2)
    two = run_ranks(4, train_span, host_config(str(tmp_path / "node-{node}")), 0, 2, 2, nodes=2)
    for rank in range(4):
        assert two[rank]["losses"] == one[rank]["losses"]
        assert all(torch.equal(v, one[rank]["params"][k]) for k, v in two[rank]["params"].items())
    assert chunk_files(tmp_path / "node-0") | chunk_files(tmp_path / "node-1") == chunk_files(tmp_path / "one")


def test_the_node_of_a_rank_is_torchruns_group_rank_else_its_rank_over_the_ranks_per_host(monkeypatch) -> None:
    for name in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert node_of_env() == 0
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_of_env() == 2
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_of_env() == 1
    assert config(offload={"nvme_path": "/nvme/node-{node}/run"}).offload.on_node(3).nvme_path == "/nvme/node-3/run"
    with pytest.raises(ConfigError, match=r"the only placeholder it may hold is \{node\}"):
        config(offload={"nvme_path": "/nvme/{host}"}).validate()
