"""Checkpoints kept from the nvme store by rename: saved, kept through crashes, retained,
resumed from (bit-identically, and without ever being modified)."""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from offload.generations import CheckpointExistsError
from offload.manifest import read_committed
from offload.nodes import NodeOps
from tests.engine.test_cli import losses as cli_losses
from tests.engine.test_cli import run as cli
from tests.engine.test_resume import nvme, params, run
from tests.training import tiny_gpt


def kept(root: Path) -> list[str]:
    """The checkpoints a store holds, by name."""
    folder = root / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def file_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def assert_resumes_identically(cfg, expected_losses: list[float], expected: dict[str, torch.Tensor]) -> None:
    torch.manual_seed(1234)  # resume must not depend on the new process's random state
    resumed = Engine.resume(tiny_gpt(seed=99), cfg, total_steps=6, checkpoint="step-3")
    assert resumed.global_step == 3
    assert run(resumed, 3) == expected_losses[3:]
    got = params(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    resumed.close()


def test_resume_from_a_checkpoint_is_bit_identical_and_never_modifies_it(tmp_path) -> None:
    cfg, store = nvme(tmp_path), tmp_path / "store"
    original = Engine(tiny_gpt(), cfg, total_steps=6)
    expected_losses = run(original, 3)
    original.save("step-3")
    assert kept(store) == [], "the step is the live state until the next step supersedes it"
    expected_losses += run(original, 3)
    expected = params(original)
    original.close()
    assert kept(store) == ["step-3"]
    assert read_committed(store / "checkpoints" / "step-3")["step"] == 3
    before = file_hashes(store / "checkpoints" / "step-3")

    for _ in range(2):  # resumable again and again: its first step writes a new live generation
        assert_resumes_identically(cfg, expected_losses, expected)
        assert read_committed(store)["step"] == 6
        assert file_hashes(store / "checkpoints" / "step-3") == before


@pytest.mark.parametrize("from_tag", [None, "step-3"], ids=["resume", "resume-from-the-pending-tag"])
def test_a_pending_checkpoint_survives_a_crash_and_the_next_step_keeps_it(tmp_path, from_tag: str | None) -> None:
    cfg, store = nvme(tmp_path), tmp_path / "store"
    eng = Engine(tiny_gpt(), cfg, total_steps=6)
    run(eng, 3)
    eng.save("step-3")
    eng.close()  # a crash: no step supersedes the generation
    resumed = Engine.resume(tiny_gpt(), cfg, total_steps=6, checkpoint=from_tag)
    assert resumed.global_step == 3 and kept(store) == []
    run(resumed, 1)
    resumed.close()
    assert kept(store) == ["step-3"]
    assert read_committed(store / "checkpoints" / "step-3")["step"] == 3
    assert read_committed(store)["step"] == 4


def test_a_crash_between_the_commit_and_the_rename_loses_nothing(tmp_path, monkeypatch) -> None:
    cfg, store = nvme(tmp_path, store={"defer_commit": False}), tmp_path / "store"  # the commit inside step()
    eng = Engine(tiny_gpt(), cfg, total_steps=6)
    run(eng, 2)
    eng.save("step-2")
    move = NodeOps.move

    def crash_before_keeping(self: NodeOps, src: str, dst: str) -> None:
        if dst.startswith("checkpoints/"):
            raise OSError(errno.EIO, "simulated crash")
        move(self, src, dst)

    monkeypatch.setattr(NodeOps, "move", crash_before_keeping)
    with pytest.raises(OSError, match="simulated crash"):
        run(eng, 1)
    eng.close()
    monkeypatch.undo()
    assert read_committed(store)["step"] == 3 and kept(store) == []
    resumed = Engine.resume(tiny_gpt(), cfg, total_steps=6)  # opening the store completes the keeping
    assert kept(store) == ["step-2"] and resumed.global_step == 3
    resumed.close()


def test_retention_deletes_the_oldest_whatever_their_names(tmp_path) -> None:
    store = tmp_path / "store"
    eng = Engine(tiny_gpt(), nvme(tmp_path, checkpoint={"keep": 2}), total_steps=6)
    for tag in ("z-first", "m-second", "a-third"):
        run(eng, 1)
        eng.save(tag)
    run(eng, 1)  # its commit keeps a-third: z-first is the oldest beyond 2
    eng.flush()
    assert kept(store) == ["a-third", "m-second"]
    eng.save("b-fourth")
    run(eng, 1)
    eng.flush()
    assert kept(store) == ["a-third", "b-fourth"]
    eng.close()


def test_errors_name_the_tag_and_the_fix(tmp_path) -> None:
    cfg = nvme(tmp_path)
    eng = Engine(tiny_gpt(), cfg, total_steps=6)
    run(eng, 1)
    eng.save("first")
    with pytest.raises(CheckpointExistsError, match="checkpoint 'first' is already asked for"):
        eng.save("first")
    with pytest.raises(ValueError, match="step 1 is already to be kept as checkpoint 'first'"):
        eng.save("other")
    with pytest.raises(ValueError, match=r"invalid checkpoint tag '\.\./up'"):
        eng.save("../up")
    run(eng, 1)
    with pytest.raises(CheckpointExistsError, match=r"checkpoint 'first' already exists \(.*checkpoints/first\)"):
        eng.save("first")
    eng.save("second")
    eng.close()
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint 'third' in store .*: it holds first, second \(pending\)"
    ):
        Engine.resume(tiny_gpt(), cfg, total_steps=6, checkpoint="third")
    resumed = Engine.resume(tiny_gpt(), cfg, total_steps=6, checkpoint="first")
    with pytest.raises(ValueError, match="resumed from checkpoints/first and has not stepped since"):
        resumed.save("again")
    resumed.close()


@pytest.mark.slow  # two runs of the console command; retention and resume are tested in process above
def test_cli_keeps_every_interval_retains_and_resumes_from_a_checkpoint(tmp_path) -> None:
    store = tmp_path / "offload_store"
    args = ["--steps", "7", "--seq_len", "64", "--checkpoint.interval", "2", "--checkpoint.keep", "2"]
    steps, _, last = cli_losses(cli(args, tmp_path))
    assert steps == 7
    assert kept(store) == ["step-4", "step-6"], "step-2 is deleted once step-6 is kept"
    again = cli([*args, "--from-checkpoint", "step-4"], tmp_path)
    assert "resumed at step 4" in again.stderr
    steps, _, resumed_last = cli_losses(again)
    assert (steps, resumed_last) == (7, last), "steps 5..7 again, on the same data, to the same loss"
    assert "checkpoint 'step-6' already exists" in again.stderr, "an earlier run's checkpoint is left as it is"
