"""kill -9 at random instants: the store always resumes, unaided, to exactly the committed step.

A real ``python -m engine train`` with a checkpoint every 3 steps (so fresh generations are
created every few steps) is killed at random moments (forward, backward, write-back, fsync,
commit, generation creation, checkpoint copies, resume); after each kill the store is resumed
in this process from where the same command would resume it (the committed step; in place, a
store killed mid-step from its last checkpoint, or afresh with ``overwrite`` when it keeps none) and its parameters must be bit-identical to an
uninterrupted run's after that step, and two more steps must stay on that run's trajectory
(so the moments and counters were committed with them). No kill needs a hand repair, and the
last run, left to finish, ends on the uninterrupted run's trajectory.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from engine.config import Config
from engine.engine import Engine
from engine.run.data import TokenBatches, load_tokens
from engine.run.train import build_model, meta_model
from engine.tiers.store_checks import resume_point
from offload.manifest import read_committed
from tests.caches import fresh_cache

# decay_steps fixes the schedule, so the last run may stop at any step and stay on the trajectory.
OVERRIDES = [
    "preset=tiny",
    "compute_dtype=fp32",
    "seq_len=64",
    "micro_batch=4",
    "log_every=1",
    "checkpoint.interval=3",
    "optim.decay_steps=100000",
]


def fingerprint(eng: Engine) -> str:
    digest = hashlib.sha256()
    for _, p in sorted(eng.module.named_parameters()):
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()


def batches_for(config: Config, eng: Engine) -> TokenBatches:
    tokens, _ = load_tokens(config.data.source)
    data = TokenBatches(tokens, seq_len=config.data.seq_len, micro_batch=config.data.micro_batch, seed=config.data.seed)
    if "data" in eng.client_state:
        data.load_state_dict(eng.client_state["data"])
    return data


def train(eng: Engine, data: TokenBatches, steps: int) -> list[str]:
    prints = []
    for _ in range(steps):
        eng.backward(eng(*data.next()))
        eng.client_state = {"data": data.state_dict()}
        eng.step()
        prints.append(fingerprint(eng))
    return prints


@pytest.mark.parametrize(
    "mode,kills,folders",
    [
        ("generations", 2, 1),  # a few kills in the default run; the slow ones below make 50
        pytest.param("in-place", 2, 1, marks=pytest.mark.slow),  # the default run keeps the generations case
        pytest.param("generations", 6, 2, marks=pytest.mark.slow),  # the store striped across two folders: 100 s
        pytest.param("generations", 50, 1, marks=pytest.mark.slow),
        pytest.param("in-place", 50, 1, marks=pytest.mark.slow),
        pytest.param("in-place", 50, 2, marks=pytest.mark.slow),
    ],
)
def test_kill_nine_at_random_instants_always_resumes_unaided(
    tmp_path, monkeypatch, mode: str, kills: int, folders: int
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    store = tmp_path / "store"
    for drive in range(1, folders):
        (tmp_path / f"drive-{drive}").mkdir()
    nvme_path = ",".join([str(store), *(str(tmp_path / f"drive-{d}" / "store") for d in range(1, folders))])
    overrides = [*OVERRIDES, f"store.mode={mode}"]
    config = Config.from_dict({}, [*overrides, f"nvme_path={nvme_path}"])
    _, vocab = load_tokens(config.data.source)
    reference_config = Config.from_dict({}, [*overrides, "offload.optimizer=cpu"])
    reference = Engine(build_model(reference_config, vocab), reference_config)
    reference_data = batches_for(reference_config, reference)
    trajectory = [fingerprint(reference)]

    def after(step: int) -> str:
        while len(trajectory) <= step:
            trajectory.extend(train(reference, reference_data, 1))
        return trajectory[step]

    rng = random.Random(0)
    env = os.environ | {"OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": fresh_cache(tmp_path / "cache")}
    command = [sys.executable, "-m", "engine", "train", "--nvme_path", nvme_path]
    command += [part for o in overrides for part in (f"--{o.split('=')[0]}", o.split("=")[1])]
    resumed_steps = []
    for kill in range(kills):
        child = subprocess.Popen([*command, "--steps", "100000"], env=env, stderr=subprocess.PIPE, text=True)
        for line in child.stderr:  # wait until it trains: a kill before that only tests start-up
            if "train:" in line or "loss" in line:
                break
        time.sleep(rng.uniform(0.0, 1.0))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stderr.close()

        resume, checkpoint = resume_point(store)  # as `python -m engine train` continues it
        model, init = meta_model(config, vocab)
        # Nothing to resume from: an in-place store killed mid-step before its first checkpoint,
        # whose state is lost; a user starts it afresh over the store with --overwrite.
        resumed = (
            Engine.resume(model, config, checkpoint=checkpoint)
            if resume
            else Engine(model, config, init_unit=init, overwrite=True)
        )
        step = resumed.global_step
        resumed_steps.append(step)
        assert fingerprint(resumed) == after(step), f"kill {kill}: state differs from step {step}"
        assert train(resumed, batches_for(config, resumed), 2) == [after(step + 1), after(step + 2)], (
            f"kill {kill}: diverged after resuming at step {step}"
        )
        resumed.close()
    assert len(set(resumed_steps)) > kills // 2, f"the kills did not land at varied steps: {resumed_steps}"
    final = read_committed(store)["step"] + 4
    done = subprocess.run([*command, "--steps", str(final)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = Engine.resume(build_model(config, vocab), config)
    assert resumed.global_step == final and fingerprint(resumed) == after(final)
    resumed.close()
    reference.close()
