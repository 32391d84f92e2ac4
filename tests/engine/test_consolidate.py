"""``consolidate``: the store's masters as a safetensors file that a fresh model loads,
bit for bit the weights the engine trained (fp32 compute: parameters are the masters)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.tools.consolidate import consolidate
from offload.chunks import ChecksumError, FileOps
from tests.engine.test_inspect import (
    CHUNK_ELEMS,
    STEPS,
    flip_byte,
    record_read_sizes,
    train_store,
    wide_gpt,
)
from tests.training import tiny_gpt


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("untied") / "store"
    return path, train_store(path, tiny_gpt())[1]


def assert_equal_weights(weights: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == params.keys()
    for name, param in params.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], param), name


def test_weights_are_the_trained_parameters_and_load_strictly(untied, tmp_path) -> None:
    store, params = untied
    out = tmp_path / "model.safetensors"
    assert consolidate(store, out) == len(params)
    weights = load_file(out)
    assert_equal_weights(weights, params)
    model = tiny_gpt(seed=1)
    model.load_state_dict(weights, strict=True)
    assert_equal_weights({n: p.detach() for n, p in model.named_parameters()}, params)
    with safe_open(out, "pt") as f:
        assert f.metadata()["step"] == str(STEPS) and f.metadata()["generation"] == str(STEPS)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"], "the temporary file must be gone"
    assert out.stat().st_mode & 0o777 == 0o644, "readable by the other users who load it"


def test_units_spanning_several_chunks_stream_one_chunk_at_a_time(tmp_path, monkeypatch) -> None:
    _, params = train_store(tmp_path / "store", wide_gpt())
    read_sizes = record_read_sizes(monkeypatch)
    consolidate(tmp_path / "store", tmp_path / "wide.safetensors")
    assert_equal_weights(load_file(tmp_path / "wide.safetensors"), params)
    # blocks.0 has 789,760 elements: four chunks of 198,656 (the fewest within 1 MiB); root is one chunk.
    assert len(read_sizes) == 5 and max(read_sizes) == 198_656 <= CHUNK_ELEMS


def test_tied_weight_is_written_once_and_loads_with_strict_false(tmp_path) -> None:
    _, params = train_store(tmp_path / "store", tiny_gpt(tie=True))
    out = tmp_path / "tied.safetensors"
    consolidate(tmp_path / "store", out)
    weights = load_file(out)
    assert_equal_weights(weights, params)
    assert "tok_emb.weight" in weights and "head.weight" not in weights
    model = tiny_gpt(seed=1, tie=True)
    result = model.load_state_dict(weights, strict=False)
    assert result.missing_keys == ["head.weight"] and result.unexpected_keys == []
    assert model.head.weight is model.tok_emb.weight
    assert torch.equal(model.head.weight, params["tok_emb.weight"])


def test_a_chosen_generation_and_one_not_on_disk(untied, tmp_path) -> None:
    store, params = untied
    consolidate(store, tmp_path / "chosen.safetensors", generation=STEPS)
    assert_equal_weights(load_file(tmp_path / "chosen.safetensors"), params)
    with pytest.raises(FileNotFoundError, match=rf"generation 99 is not on disk .* \[{STEPS}, {STEPS + 1}\]"):
        consolidate(store, tmp_path / "none.safetensors", generation=99)


def test_store_without_commit_needs_a_generation(untied, tmp_path) -> None:
    store = Path(shutil.copytree(untied[0], tmp_path / "store"))
    (store / "COMMITTED").unlink()
    with pytest.raises(ValueError, match=r"no committed generation .* pass --generation N"):
        consolidate(store, tmp_path / "model.safetensors")


def test_damaged_chunk_fails_and_leaves_no_file(untied, tmp_path) -> None:
    store = Path(shutil.copytree(untied[0], tmp_path / "store"))
    flip_byte(store / f"gen-{STEPS}" / "blocks.2" / "master" / "c" / "0")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ChecksumError, match=rf"array 'gen-{STEPS}/blocks.2/master' chunk 0: .* CRC-32C"):
        consolidate(store, out_dir / "model.safetensors")
    assert list(out_dir.iterdir()) == []


def test_missing_output_folder_is_named(untied, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=f"its folder {tmp_path / 'nowhere'} does not exist"):
        consolidate(untied[0], tmp_path / "nowhere" / "model.safetensors")


def test_a_full_disk_fails_and_leaves_no_file(untied, tmp_path, monkeypatch) -> None:
    def full(self, fd, buf, offset) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileOps, "pwrite", full)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(OSError, match="No space left on device"):
        consolidate(untied[0], out_dir / "model.safetensors")
    assert list(out_dir.iterdir()) == []
