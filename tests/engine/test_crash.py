"""kill -9 at random instants: the store always resumes, to exactly the committed step.

A real ``python -m engine train`` is killed at random moments (forward, backward,
write-back, fsync, commit, resume); after each kill the store is resumed in this process
and its parameters must be bit-identical to an uninterrupted run's after the step that
``COMMITTED`` names, and two more steps must stay on that run's trajectory (so the
moments and counters were committed with them).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

from engine.config import Config
from engine.data import TokenBatches, load_tokens
from engine.engine import Engine
from engine.train import build_model

KILLS = 10
OVERRIDES = ["preset=tiny", "compute_dtype=fp32", "seq_len=64", "micro_batch=4", "steps=100000", "log_every=1"]


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


def test_kill_nine_at_random_instants_always_resumes_to_the_committed_step(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = tmp_path / "store"
    config = Config.from_dict({}, OVERRIDES + [f"nvme_path={store}"])
    _, vocab = load_tokens(config.data.source)
    reference_config = Config.from_dict({}, OVERRIDES + ["offload.optimizer=cpu"])
    reference = Engine(build_model(reference_config, vocab), reference_config)
    reference_data = batches_for(reference_config, reference)
    trajectory = [fingerprint(reference)]

    rng = random.Random(0)
    env = os.environ | {"OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "engine", "train", *(f"--{o.replace('=', ' ', 1)}" for o in OVERRIDES)]
    command = [part for arg in command for part in arg.split(" ", 1)] + ["--nvme_path", str(store)]
    committed_steps = []
    for kill in range(KILLS):
        child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        for line in child.stderr:  # wait until it trains: a kill before that only tests start-up
            if "train:" in line or "loss" in line:
                break
        time.sleep(rng.uniform(0.0, 1.0))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stderr.close()

        record = json.loads((store / "COMMITTED").read_text())
        step = record["step"]
        committed_steps.append(step)
        while len(trajectory) < step + 3:
            trajectory += train(reference, reference_data, 1)
        resumed = Engine.resume(build_model(config, vocab), config)
        assert resumed.global_step == step
        assert fingerprint(resumed) == trajectory[step], f"kill {kill}: state differs from step {step}"
        after = train(resumed, batches_for(config, resumed), 2)
        assert after == trajectory[step + 1 : step + 3], f"kill {kill}: diverged after resuming at step {step}"
        resumed.close()
    assert len(set(committed_steps)) > KILLS // 2, f"the kills did not land at varied steps: {committed_steps}"
    reference.close()
