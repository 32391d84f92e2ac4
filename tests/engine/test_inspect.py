"""``inspect_store`` on a store the engine trained: what it reports (mode and dirt included),
what ``verify`` catches, and how it fails on paths that are not healthy stores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.run.models.gpt import GPT, GPTConfig
from engine.state.forms import STATE_KINDS
from engine.state.partition import ModelLayout
from engine.tiers.store_checks import DirtyStoreError
from engine.tools.inspect import committed_record, format_report, inspect_store
from offload.generations import Generations
from offload.io import IORunner
from offload.manifest import ManifestError, commit
from offload.store import ShardStore
from tests.training import SEQ_LEN, batches, config

STEPS = 3
CHUNK_ELEMS = 2**20 // 4  # offload.chunk_mb = 1


def wide_gpt() -> GPT:
    """One block wide enough to span several 1 MiB chunks, its last chunk partly padding."""
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, d_model=256, n_head=4, seq_len=SEQ_LEN))


def train_store(
    path: Path, model: torch.nn.Module, steps: int = STEPS, mode: str = "generations", save_at: int = 0
) -> tuple[ModelLayout, dict[str, torch.Tensor]]:
    """Train ``model`` into an nvme store at ``path`` in ``mode`` (keeping step ``save_at`` as
    ``step-<n>`` if it is not 0); return its layout and final parameters."""
    offload = {"optimizer": "nvme", "nvme_path": str(path), "chunk_mb": 1}
    eng = Engine(model, config(offload=offload, store={"mode": mode}), total_steps=steps)
    data = batches(4)
    for step in range(1, steps + 1):
        eng.backward(eng(*data.next()))
        eng.step()
        if step == save_at:
            eng.save(f"step-{step}")
    params = {name: p.detach().clone() for name, p in eng.module.named_parameters()}
    eng.close()
    return eng.layout, params


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, ModelLayout]:
    path = tmp_path_factory.mktemp("inspect") / "store"
    layout, _ = train_store(path, wide_gpt())
    return path, layout


@pytest.fixture
def store_copy(trained, tmp_path) -> Path:
    """A private copy of the trained store, for tests that damage it."""
    return Path(shutil.copytree(trained[0], tmp_path / "store"))


def test_report_describes_the_trained_store(trained) -> None:
    path, layout = trained
    report = inspect_store(path)
    assert report["committed"]["generation"] == STEPS and report["committed"]["step"] == STEPS
    assert report["world_size"] == 1
    assert report["mode"] == "generations" and report["dirty"] is None
    assert report["num_units"] == 2 and report["num_params"] == len(list(wide_gpt().parameters()))
    assert [(u["name"], u["numel"], u["shard_numel"], u["chunk_numel"]) for u in report["units"]] == [
        (u.name, u.numel, u.shard_numel, u.chunk_numel) for u in layout.units
    ]
    block = report["units"][0]
    assert block["chunk_numel"] <= CHUNK_ELEMS < block["shard_numel"]  # the block spans several chunks
    one_kind = 4 * sum(u.padded_numel for u in layout.units)
    assert report["bytes_per_kind"] == {kind: one_kind for kind in STATE_KINDS}
    assert report["generations"] == [STEPS, STEPS + 1]  # the committed one and the next write target
    assert report["checkpoints"] == []
    # Two generations of three kinds, plus a 4-byte CRC per chunk and small metadata files.
    assert 2 * len(STATE_KINDS) * one_kind < report["disk_bytes"] < 2 * len(STATE_KINDS) * one_kind + 2**16
    assert report["verify"] is None
    text = format_report(report)
    assert f"step {STEPS}, generation {STEPS}" in text
    assert "\nmode:        generations\n" in text
    assert all(u.name in text for u in layout.units)
    assert "checksum" not in text


def test_an_in_place_store_reports_its_mode_and_whether_it_is_dirty(tmp_path) -> None:
    path = tmp_path / "store"
    layout, _ = train_store(path, wide_gpt(), mode="in-place", save_at=2)
    report = inspect_store(path)
    assert report["mode"] == "in-place" and report["dirty"] is None
    assert report["generations"] == [0] and report["checkpoints"] == ["step-2"]
    assert "store_mode" not in report["attributes"]
    one_kind = 4 * sum(u.padded_numel for u in layout.units)
    # One live generation and one checkpoint, each of three kinds, plus CRCs and metadata.
    assert 2 * len(STATE_KINDS) * one_kind < report["disk_bytes"] < 2 * len(STATE_KINDS) * one_kind + 2**17
    assert "mode:        in-place, clean" in format_report(report)
    with IORunner(threads=1) as runner:
        store = ShardStore.open(path, runner=runner)
        Generations(store).mark_dirty()  # what a run killed while rewriting the generation leaves
        report = inspect_store(path, verify=True)
        assert "is dirty" in report["dirty"] and "checkpoint='step-2'" in report["dirty"]
        assert report["verify"]["failures"] == [], "every chunk is whole: only their mix of steps is wrong"
        assert "mode:        in-place, DIRTY: store" in format_report(report)
        with pytest.raises(DirtyStoreError, match="--from-checkpoint step-2"):
            committed_record(store)  # what consolidate reads: a mix of two steps is no model


def test_checkpoints_are_listed(store_copy) -> None:
    shutil.copytree(store_copy / f"gen-{STEPS}", store_copy / "checkpoints" / "step-3")
    report = inspect_store(store_copy)
    assert report["checkpoints"] == ["step-3"]
    assert "checkpoints: step-3" in format_report(report)


def test_checkpoints_are_listed_by_step(store_copy) -> None:
    root = store_copy / "checkpoints"
    for tag, record in {
        "step-1000": {"generation": 9, "step": 1000},
        "step-990": {"generation": 8, "step": 990},
        "best": {"generation": 7, "step": 990},
        "step-5": {"generation": 1, "step": 5},
        "manual": None,
    }.items():
        (root / tag).mkdir(parents=True)
        if record is not None:
            commit(root / tag, record)
    (root / "garbled").mkdir()
    (root / "garbled" / "COMMITTED").write_text("{not json")
    report = inspect_store(store_copy)
    assert report["checkpoints"] == ["step-5", "best", "step-990", "step-1000", "garbled", "manual"]
    assert "checkpoints: step-5, best, step-990, step-1000, garbled, manual" in format_report(report)


def record_read_sizes(monkeypatch) -> list[int]:
    """Make every ``ShardStore.read_async`` (which ``read_into`` calls) note how many elements it reads."""
    read_sizes: list[int] = []
    read_async = ShardStore.read_async

    def recording(self, name, start, out):
        read_sizes.append(out.numel())
        return read_async(self, name, start, out)

    monkeypatch.setattr(ShardStore, "read_async", recording)
    return read_sizes


def test_verify_reads_every_chunk_one_at_a_time(trained, monkeypatch) -> None:
    read_sizes = record_read_sizes(monkeypatch)
    report = inspect_store(trained[0], verify=True)
    chunks = len(STATE_KINDS) * sum(u.padded_numel // u.chunk_numel for u in trained[1].units)
    assert report["verify"] == {"chunks": chunks, "failures": []}
    assert len(read_sizes) == chunks and max(read_sizes) == max(u.chunk_numel for u in trained[1].units)
    assert f"checksum:    ok ({chunks} chunks read)" in format_report(report)


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_reports_every_damaged_chunk(store_copy) -> None:
    generation = store_copy / f"gen-{STEPS}"
    flip_byte(generation / "blocks.0" / "master" / "c" / "1")
    flip_byte(generation / "root" / "exp_avg" / "c" / "0")
    (generation / "root" / "exp_avg_sq" / "c" / "0").unlink()
    failures = inspect_store(store_copy, verify=True)["verify"]["failures"]
    found = {(f["unit"], f["kind"], f["chunk"]): f for f in failures}
    assert set(found) == {("blocks.0", "master", 1), ("root", "exp_avg", 0), ("root", "exp_avg_sq", 0)}
    assert found[("blocks.0", "master", 1)]["file"] == str(generation / "blocks.0" / "master" / "c" / "1")
    assert "CRC-32C" in found[("root", "exp_avg", 0)]["error"]
    text = format_report(inspect_store(store_copy, verify=True))
    assert "FAILED: 3 problem(s)" in text
    assert f"unit blocks.0 master chunk 1: {generation / 'blocks.0' / 'master' / 'c' / '1'}" in text


def test_verify_reports_a_missing_array(store_copy) -> None:
    shutil.rmtree(store_copy / f"gen-{STEPS}" / "root" / "master")
    failures = inspect_store(store_copy, verify=True)["verify"]["failures"]
    assert [(f["unit"], f["kind"], f["chunk"]) for f in failures] == [("root", "master", None)]
    assert "missing" in failures[0]["error"]


def test_missing_store_names_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=f"no store at {tmp_path / 'nowhere'}: the path does not exist"):
        inspect_store(tmp_path / "nowhere")


def test_a_folder_or_a_file_that_is_not_a_store_is_refused(tmp_path) -> None:
    fix = r"pass the folder the engine trained into \(its offload.nvme_path\)"
    with pytest.raises(ValueError, match=f"is not an offload store: it is a folder without a zarr.json; {fix}"):
        inspect_store(tmp_path)
    (tmp_path / "weights.pt").write_bytes(b"not a store")
    with pytest.raises(ValueError, match=f"is not an offload store: it is a file, not a folder; {fix}"):
        inspect_store(tmp_path / "weights.pt")


def test_a_damaged_layout_is_named(store_copy) -> None:
    meta = json.loads((store_copy / "zarr.json").read_text())
    del meta["attributes"]["layout"]["units"][0]["params"]
    (store_copy / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"damaged 'layout' attribute in its zarr.json \(KeyError: 'params'\)"):
        inspect_store(store_copy)


def test_store_without_commit_is_reported_not_refused(store_copy) -> None:
    (store_copy / "COMMITTED").unlink()
    report = inspect_store(store_copy, verify=True)
    assert report["committed"] is None and report["bytes_per_kind"] == {}
    assert report["verify"] == {"chunks": 0, "failures": []}
    text = format_report(report)
    assert "no committed generation" in text
    assert "nothing to verify" in text


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "step": 3}'])
def test_garbled_commit_is_an_error(store_copy, content: str) -> None:
    (store_copy / "COMMITTED").write_text(content)
    with pytest.raises(ManifestError, match=str(store_copy / "COMMITTED")):
        inspect_store(store_copy)
