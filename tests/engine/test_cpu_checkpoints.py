"""Checkpoints of the cpu tier: written to a store at ``offload.nvme_path`` in the nvme tier's
layout, resumed from bit-identically on the cpu tier and on the nvme tier."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from offload.generations import CheckpointExistsError
from offload.manifest import read_committed
from tests.engine.test_checkpoints import assert_resumes_identically, kept
from tests.engine.test_cli import losses as cli_losses
from tests.engine.test_cli import run as cli
from tests.engine.test_resume import nvme, params, run
from tests.training import config, tiny_gpt


def cpu(tmp_path, stage: int = 2, **sections):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return config(zero={"stage": stage}, offload={"optimizer": "cpu", "nvme_path": str(tmp_path / "store")}, **sections)


def saved_midway(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Six uninterrupted steps, checkpoint ``step-3`` saved after the third: the losses and
    final parameters a resume from it must reproduce."""
    eng = Engine(tiny_gpt(), cfg, total_steps=6)
    losses = run(eng, 3)
    eng.save("step-3")
    losses += run(eng, 3)
    expected = params(eng)
    eng.close()
    return losses, expected


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_checkpoint_resumes_bit_identically(tmp_path, stage: int) -> None:
    cfg, store = cpu(tmp_path, stage), tmp_path / "store"
    expected_losses, expected = saved_midway(cfg)
    assert kept(store) == ["step-3"]
    assert read_committed(store / "checkpoints" / "step-3")["step"] == 3
    assert not (store / "COMMITTED").exists(), "the cpu tier commits no live state"
    names = {
        p.relative_to(store / "checkpoints" / "step-3").as_posix()
        for p in (store / "checkpoints" / "step-3").glob("*/*")
    }
    assert {"blocks.0/master", "blocks.0/exp_avg", "blocks.0/exp_avg_sq"} <= names
    assert_resumes_identically(cfg, expected_losses, expected)


def test_cpu_checkpoint_resumes_on_the_nvme_tier(tmp_path) -> None:
    expected_losses, expected = saved_midway(cpu(tmp_path))
    assert_resumes_identically(nvme(tmp_path), expected_losses, expected)
    assert read_committed(tmp_path / "store")["step"] == 6, "the nvme tier continues as a live store"


def test_nvme_checkpoint_resumes_on_the_cpu_tier(tmp_path) -> None:
    expected_losses, expected = saved_midway(nvme(tmp_path))
    assert_resumes_identically(cpu(tmp_path), expected_losses, expected)


def test_retention_and_errors_name_the_tags(tmp_path) -> None:
    cfg, store = cpu(tmp_path, checkpoint={"keep": 2}), tmp_path / "store"
    eng = Engine(tiny_gpt(), cfg, total_steps=6)
    for tag in ("z-first", "m-second", "a-third"):
        run(eng, 1)
        eng.save(tag)
    assert kept(store) == ["m-second", "z-first"], "a-third is written in the background, kept by the next step"
    run(eng, 1)
    assert kept(store) == ["a-third", "m-second"]
    with pytest.raises(CheckpointExistsError, match=r"checkpoint 'a-third' already exists"):
        eng.save("a-third")
    with pytest.raises(ValueError, match=r"invalid checkpoint tag '\.\./up'"):
        eng.save("../up")
    eng.close()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 'nope' in store .*: it holds a-third, m-second"):
        Engine.resume(tiny_gpt(), cfg, total_steps=6, checkpoint="nope")
    with pytest.raises(ValueError, match=r"resuming needs the state on disk.*checkpoint=tag"):
        Engine.resume(tiny_gpt(), cfg, total_steps=6)
    with pytest.raises(FileNotFoundError, match="holds only checkpoints written from memory"):
        Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=6)


@pytest.mark.slow  # three runs of the command (test_checkpoints runs it on nvme): about 75 s
def test_cli_keeps_every_interval_and_resumes_on_the_cpu_tier(tmp_path) -> None:
    store = tmp_path / "offload_store"
    args = ["--steps", "5", "--seq_len", "64", "--offload.optimizer", "cpu", "--checkpoint.interval", "2"]
    steps, _, last = cli_losses(cli(args, tmp_path))
    assert steps == 5 and kept(store) == ["step-2", "step-4", "step-5"], "the last step is kept too"
    again = cli([*args, "--from-checkpoint", "step-2"], tmp_path)
    assert "resumed at step 2" in again.stderr
    steps, _, resumed_last = cli_losses(again)
    assert (steps, resumed_last) == (5, last), "steps 3..5 again, on the same data, to the same loss"
    assert kept(store) == ["step-2", "step-4", "step-5", "step-5.1"], "an earlier run's step-5 is never replaced"


def test_a_checkpoint_saved_last_is_kept_by_close(tmp_path) -> None:
    cfg, store = cpu(tmp_path), tmp_path / "store"
    eng = Engine(tiny_gpt(), cfg, total_steps=6)
    run(eng, 2)
    eng.save("last")
    assert "last" not in kept(store), "written in the background until the next step or close"
    eng.close()
    assert kept(store) == ["last"] and read_committed(store / "checkpoints" / "last")["step"] == 2


def test_cpu_checkpoint_beside_parameters_on_nvme_resumes_bit_identically(tmp_path) -> None:
    """The parameter tier's store is in offload.nvme_path before the first checkpoint is."""
    cfg = cpu(tmp_path, stage=3)
    cfg.offload.param = "nvme"
    expected_losses, expected = saved_midway(cfg)
    assert kept(tmp_path / "store") == ["step-3"]
    assert_resumes_identically(cfg, expected_losses, expected)
