"""A checkpoint's tensors read ahead of the import: each taken equal to what safetensors loads,
in or out of the order given; never more than ``AHEAD`` largest tensors read ahead of what
is taken; a file that fails under it raises at the take that needs it, naming the file."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.run import read_ahead
from engine.run.pretrained import read_header
from engine.run.read_ahead import CheckpointReadAhead, read_tensor


def saved(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, read_ahead.CheckpointTensor]:
    save_file(tensors, str(path))
    return read_header(path)


def mixed(path: Path) -> dict[str, read_ahead.CheckpointTensor]:
    """Tensors of several dtypes and odd sizes, so that most start and end off any alignment."""
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(1000, 37).bfloat16(),
        "b": torch.randn(3, 5).half(),
        "c": torch.randn(4099),
        "d": torch.arange(7, dtype=torch.int64),
        "e": torch.randn(2, 3, 5).bfloat16(),
    }
    return saved(path, tensors)


def test_tensors_taken_in_and_out_of_order_equal_what_safetensors_loads(tmp_path) -> None:
    tensors = mixed(tmp_path / "model.safetensors")
    expected = load_file(tmp_path / "model.safetensors")
    ahead = CheckpointReadAhead(tensors, ["a", "b", "c", "d"])  # "e" is not in the order
    try:
        for name in ["a", "c", "b", "e", "d"]:  # "c" before "b": out of order
            got = ahead.take(name)
            assert got.dtype == expected[name].dtype and torch.equal(got, expected[name]), name
    finally:
        ahead.close()
    for name, tensor in tensors.items():
        assert torch.equal(read_tensor(tensor), expected[name]), name


def test_a_tensor_larger_than_a_read_piece_is_read_whole(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(read_ahead, "PIECE_BYTES", 8192)
    tensors = saved(tmp_path / "model.safetensors", {"big": torch.randn(50_001)})
    ahead = CheckpointReadAhead(tensors, ["big"])
    try:
        assert torch.equal(ahead.take("big"), load_file(tmp_path / "model.safetensors")["big"])
    finally:
        ahead.close()


def test_reading_stays_a_few_largest_tensors_ahead_of_what_is_taken(tmp_path, monkeypatch) -> None:
    tensors = saved(tmp_path / "model.safetensors", {f"t{i}": torch.full((1024,), float(i)) for i in range(8)})
    started: list[str] = []
    start = read_ahead._Reading.__init__

    def counted(self, tensor, pool) -> None:
        started.append(next(name for name, t in tensors.items() if t == tensor))
        start(self, tensor, pool)

    monkeypatch.setattr(read_ahead._Reading, "__init__", counted)

    def settled() -> list[str]:
        time.sleep(0.2)  # the thread had every chance to read further ahead
        return list(started)

    order, ahead = list(tensors), CheckpointReadAhead(tensors, list(tensors))
    try:
        assert settled() == order[: read_ahead.AHEAD]
        assert torch.equal(ahead.take("t0"), torch.zeros(1024))
        assert settled() == order[: read_ahead.AHEAD + 1]
        ahead.take("t1")
        ahead.take("t2")
        assert settled() == order[: read_ahead.AHEAD + 3]
    finally:
        ahead.close()
    assert not any(t.name == "checkpoint-read-ahead" for t in threading.enumerate() if t.is_alive())


@pytest.mark.parametrize("how", ["truncated", "removed"])
def test_a_file_that_fails_under_the_reads_raises_at_the_take_naming_it(how: str, tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    tensors = saved(path, {"a": torch.randn(4096), "b": torch.randn(4096)})
    if how == "truncated":
        with path.open("r+b") as file:
            file.truncate(tensors["b"].offset + 10)
    else:
        path.unlink()
    ahead = CheckpointReadAhead(tensors, ["a", "b"])
    try:
        with pytest.raises((ValueError, FileNotFoundError), match=r"model\.safetensors"):
            ahead.take("a" if how == "removed" else "b")
    finally:
        ahead.close()
