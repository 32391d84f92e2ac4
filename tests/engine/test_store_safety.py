"""A trained store is never replaced unasked, a refused start leaves it as it was, uncommitted
generations are scratch, and every run leaves a state that ``consolidate`` and ``export`` read.

Each case is built from a real store, changed as a bad copy, a crash or a second run would
change it; a refusal must leave every file byte-identical (the writer lock's file aside).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import Config, OptimConfig
from engine.engine import Engine
from engine.run import train as train_module
from engine.run.models.gpt import GPT, GPTConfig
from engine.tools.consolidate import consolidate
from engine.tools.inspect import format_report, inspect_store
from engine.zero.optim import lr_factor, schedule_change
from offload.generations import NEW
from offload.manifest import read_committed
from tests.caches import fresh_cache
from tests.engine.test_crafted_stores import snapshot
from tests.engine.test_resume import nvme, params, run
from tests.training import SEQ_LEN, tiny_gpt


def trained(root: Path, steps: int = 3, **sections: dict) -> Path:
    """A store at ``root/store`` committed at step ``steps`` (of 6)."""
    eng = Engine(tiny_gpt(), nvme(root, **sections), total_steps=6)
    run(eng, steps)
    eng.close()
    return root / "store"


def refused(start, error: type[Exception], match: str, one_line: bool = True) -> str:
    """The message of ``start()``'s refusal; the refused engine (held by the traceback, with its
    store's lock) is let go before the next start. ``one_line=False``: an I/O error, which adds
    the task it failed in on a line of its own (the command line joins them)."""
    with pytest.raises(error, match=match) as caught:
        start()
    message = str(caught.value)
    del caught
    gc.collect()
    assert not one_line or "\n" not in message
    return message


def test_a_store_that_lost_its_committed_file_is_refused_untouched_until_overwrite(tmp_path) -> None:
    store = trained(tmp_path)
    (store / "COMMITTED").unlink()
    before = snapshot(store)
    message = refused(
        lambda: Engine(tiny_gpt(), nvme(tmp_path), total_steps=6),
        FileExistsError,
        r"no COMMITTED record but was trained into \(it holds gen-3, gen-4\)",
    )
    assert "restore COMMITTED from a backup" in message and "--overwrite" in message
    assert "its COMMITTED file was lost" in format_report(inspect_store(store))
    refused(
        lambda: Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=6),
        FileNotFoundError,
        "no committed step to resume: it has no COMMITTED record",
    )
    assert snapshot(store) == before, "a refused start changes nothing"

    eng = Engine(tiny_gpt(), nvme(tmp_path), total_steps=6, overwrite=True)
    assert eng.global_step == 0
    eng.close()
    assert read_committed(store)["step"] == 0 and not (store / NEW).exists()


def test_a_lost_committed_file_names_the_newest_checkpoint(tmp_path) -> None:
    eng = Engine(tiny_gpt(), nvme(tmp_path), total_steps=6)
    run(eng, 1)
    eng.save("early")
    run(eng, 2)
    eng.close()
    (tmp_path / "store" / "COMMITTED").unlink()
    message = refused(lambda: Engine(tiny_gpt(), nvme(tmp_path), total_steps=6), FileExistsError, "no COMMITTED")
    assert "`python -m engine train --from-checkpoint early`" in message
    resumed = Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=6, checkpoint="early")
    assert resumed.global_step == 1
    resumed.close()


def crashed_while_building(root: Path) -> Path:
    """A store whose run was stopped while building the model, before its first commit."""

    class Stop(Exception):
        pass

    built = []

    def init(params: dict[str, torch.Tensor]) -> None:
        if built:
            raise Stop
        built.append(params)
        for p in params.values():
            torch.nn.init.normal_(p)

    with torch.device("meta"):
        model = GPT(GPTConfig.preset("tiny", seq_len=SEQ_LEN))
    with pytest.raises(Stop) as caught:
        Engine(model, nvme(root), total_steps=6, init_unit=init)
    del caught
    gc.collect()
    return root / "store"


def test_a_store_whose_first_commit_never_happened_is_replaced_and_reads_as_empty(tmp_path, caplog) -> None:
    store = crashed_while_building(tmp_path)
    assert (store / NEW).is_file() and not (store / "COMMITTED").exists() and (store / "gen-0").is_dir()
    assert "stopped before its first commit" in format_report(inspect_store(store))
    refused(
        lambda: consolidate(store, tmp_path / "weights.safetensors"),
        ValueError,
        "holds nothing to read: the run that made it committed no step and kept no checkpoint",
    )
    with caplog.at_level(logging.WARNING):
        eng = Engine(tiny_gpt(), nvme(tmp_path), total_steps=6)
    assert "never committed its first step" in caplog.text
    run(eng, 1)
    eng.close()
    assert read_committed(store)["step"] == 1 and not (store / NEW).exists()


def test_a_damaged_uncommitted_generation_is_rebuilt_on_resume(tmp_path) -> None:
    store = trained(tmp_path / "a")
    shutil.copytree(store, tmp_path / "b" / "store")
    for chunks in (tmp_path / "b" / "store" / "gen-4").rglob("c"):
        shutil.rmtree(chunks)  # gen-4 is the next step's target, uncommitted
    runs = []
    for root in ("a", "b"):
        eng = Engine.resume(tiny_gpt(), nvme(tmp_path / root), total_steps=6)
        run(eng, 2)
        runs.append(params(eng))
        eng.close()
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])
    assert read_committed(tmp_path / "b" / "store")["step"] == 5


def test_a_refused_resume_leaves_no_scratch_folder(tmp_path) -> None:
    """With clipping the run spills gradients to the store's scratch folder: not made before a
    damaged chunk is found."""
    clipped = {"optim": {"grad_clip": 1.0}}
    store = trained(tmp_path, **clipped)
    chunk = next((store / "gen-3").rglob("master/c/0"))
    data = bytearray(chunk.read_bytes())
    data[8] ^= 0xFF
    chunk.write_bytes(bytes(data))
    before = snapshot(store)
    start = lambda: Engine.resume(tiny_gpt(), nvme(tmp_path, **clipped), total_steps=6)  # noqa: E731
    refused(start, ValueError, "blocks.0/master/c/0 fails its CRC-32C check", one_line=False)
    assert snapshot(store) == before and not (store / "scratch").exists()


def test_a_run_with_the_state_in_memory_keeps_its_last_step_also_when_stopped(tmp_path, monkeypatch) -> None:
    config = tiny_run(tmp_path, "offload.optimizer=cpu", "train.steps=4")
    store = tmp_path / "store"
    real_step = train_module.train_step
    taken = []

    def stopped_after_two(*args, **kwargs) -> float:
        taken.append(real_step(*args, **kwargs))
        if len(taken) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a user's kill: the loop ends after this step
        return taken[-1]

    monkeypatch.setattr(train_module, "train_step", stopped_after_two)
    result = train_module.train(config)
    assert result.stopped_early and result.steps_done == 2
    assert sorted(p.name for p in (store / "checkpoints").iterdir() if p.is_dir()) == ["step-2"]
    monkeypatch.undo()
    resumed = train_module.train(config, checkpoint="step-2")
    assert resumed.steps_done == 4
    assert consolidate(store, tmp_path / "weights.safetensors") > 0  # the last checkpoint, step-4
    assert sorted(p.name for p in (store / "checkpoints").iterdir() if p.is_dir()) == ["step-2", "step-4"]


def tiny_run(root: Path, *overrides: str) -> Config:
    """``python -m engine train``'s config of the tiny preset, its store in ``root/store``."""
    base = ["model.preset=tiny", "data.seq_len=32", "data.micro_batch=2", f"offload.nvme_path={root / 'store'}"]
    return Config.from_dict({}, [*base, *overrides])


def test_a_finished_run_says_there_is_nothing_to_do(tmp_path, caplog) -> None:
    config = tiny_run(tmp_path, "train.steps=3")
    train_module.train(config)
    before = snapshot(tmp_path / "store")
    with caplog.at_level(logging.INFO):
        again = train_module.train(config)
    assert again.losses == [] and again.steps_done == 3
    assert "already at step 3 of 3: nothing to do; raise train.steps to continue" in caplog.text
    assert snapshot(tmp_path / "store") == before, "nothing to do changes nothing"
    in_memory = tiny_run(tmp_path / "cpu", "train.steps=3", "offload.optimizer=cpu")
    train_module.train(in_memory)  # keeps step-3
    caplog.clear()
    with caplog.at_level(logging.INFO):  # a checkpoint's step is known once the engine reads it
        assert train_module.train(in_memory, checkpoint="step-3").losses == []
    assert "already at step 3 of 3: nothing to do" in caplog.text


def test_raising_steps_under_a_decaying_schedule_says_how_to_keep_it(tmp_path, caplog) -> None:
    train_module.train(tiny_run(tmp_path, "train.steps=3", "optim.warmup_steps=1"))
    with caplog.at_level(logging.WARNING):
        train_module.train(tiny_run(tmp_path, "train.steps=5", "optim.warmup_steps=1"))
    assert "train.steps is 5 where the run was planned for 3" in caplog.text
    assert "set optim.decay_steps = 2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train_module.train(tiny_run(tmp_path, "train.steps=7", "optim.warmup_steps=1", "optim.decay_steps=2"))
    assert "train.steps is" not in caplog.text, "a fixed decay does not follow train.steps"


def test_the_schedule_change_names_the_learning_rates_before_and_after() -> None:
    optim = OptimConfig(lr=1.0, warmup_steps=0)
    message = schedule_change(optim, 50, 100, 200)
    assert message is not None
    assert f"({lr_factor(50, optim, 100):.3g} -> {lr_factor(50, optim, 200):.3g} now)" in message
    assert "optim.decay_steps = 100" in message
    assert schedule_change(optim, 50, 100, 100) is None
    assert schedule_change(optim, 50, None, 200) is None, "a record without the plan (an older store)"
    assert schedule_change(OptimConfig(schedule="constant"), 50, 100, 200) is None


@pytest.mark.slow  # three runs of the console command; the refusal itself is tested in process above
def test_the_cli_refuses_a_store_without_committed_in_one_line_and_overwrites_on_request(tmp_path) -> None:
    args = ["--preset", "tiny", "--steps", "2", "--seq_len", "32", "--micro_batch", "2", "--nvme_path", "store"]
    env = os.environ | {"XDG_CACHE_HOME": fresh_cache(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}

    def train(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "engine", "train", *args, *extra]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert train().returncode == 0
    store = tmp_path / "store"
    (store / "COMMITTED").unlink()
    before = snapshot(store)
    proc = train()
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr
    assert "no COMMITTED record" in errors[0] and "--overwrite" in errors[0]
    assert snapshot(store) == before
    assert train("--overwrite").returncode == 0 and read_committed(store)["step"] == 2
