"""One writer per store: a second run on a store in use is refused at once, naming the
holder, and the first trains on undisturbed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.config import Config
from engine.engine import Engine
from engine.run.data import load_tokens
from engine.run.train import build_model
from engine.tools.inspect import format_report, inspect_store
from offload.lock import StoreLock, StoreLockedError
from tests.caches import fresh_cache
from tests.engine.test_crash import batches_for, fingerprint, train
from tests.engine.test_resume import nvme, run
from tests.training import tiny_gpt

OVERRIDES = [
    "preset=tiny",
    "compute_dtype=fp32",
    "seq_len=64",
    "micro_batch=4",
    "log_every=1",
    "optim.decay_steps=1000",
]
STEPS = 40


@pytest.mark.slow  # kept out of the default run's 10 minutes; CI runs it with the slow ones
def test_a_second_writer_is_refused_while_the_first_trains_on(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    store = tmp_path / "store"
    env = os.environ | {"OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": fresh_cache(tmp_path / "cache")}
    command = [sys.executable, "-m", "engine", "train", "--nvme_path", str(store), "--steps", str(STEPS)]
    command += [part for o in OVERRIDES for part in (f"--{o.split('=')[0]}", o.split("=")[1])]
    first = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    for line in first.stderr:  # once it trains
        if "loss" in line:
            break
    config = Config.from_dict({}, [*OVERRIDES, f"nvme_path={store}"])
    _, vocab = load_tokens(config.data.source)
    with pytest.raises(StoreLockedError, match=rf"is being written by pid {first.pid} on host"):
        Engine.resume(build_model(config, vocab), config)
    first.stderr.read()
    assert first.wait(timeout=300) == 0

    reference_config = Config.from_dict({}, [*OVERRIDES, "offload.optimizer=cpu"])
    reference = Engine(build_model(reference_config, vocab), reference_config)
    train(reference, batches_for(reference_config, reference), STEPS)
    resumed = Engine.resume(build_model(config, vocab), config)
    assert resumed.global_step == STEPS and fingerprint(resumed) == fingerprint(reference), (
        "the first run was disturbed"
    )
    resumed.close()
    reference.close()


def test_inspect_names_the_writer_without_disturbing_it(tmp_path) -> None:
    eng = Engine(tiny_gpt(), nvme(tmp_path), total_steps=2)
    run(eng, 1)
    report = inspect_store(tmp_path / "store")
    assert report["writer"]["pid"] == os.getpid()
    assert f"writer:      pid {os.getpid()} on host" in format_report(report)
    run(eng, 1)  # the writer never noticed
    eng.close()
    assert inspect_store(tmp_path / "store")["writer"] is None
    StoreLock.acquire(tmp_path / "store").release()


@pytest.mark.slow  # two console commands, about 9 s; the engine's refusal is tested above in the default run
def test_the_cli_refuses_a_store_in_use_in_one_line_and_leaves_it_as_it_was(tmp_path) -> None:
    eng = Engine(tiny_gpt(), nvme(tmp_path), total_steps=2)
    run(eng, 1)
    eng.flush()
    before = {p: p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()}
    env = os.environ | {"OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": fresh_cache(tmp_path / "cache")}
    second = subprocess.run(
        [sys.executable, "-m", "engine", "train", "--preset", "tiny", "--nvme_path", str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in second.stderr.splitlines() if "ERROR" in line]
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert len(errors) == 1 and f"is being written by pid {os.getpid()}" in errors[0]
    assert {p: p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()} == before
    eng.close()
