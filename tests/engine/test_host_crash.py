"""kill -9 one host at random instants: a run on two hosts, each with its own store, always
resumes from a step both committed, on the trajectory of a run that was never stopped.

Each "host" is one ``python -m engine train`` process in its own process group, told by the
environment torchrun would set that it is node 0 or 1 of 2 (both on 127.0.0.1), writing
``node-{node}``. A seeded draw picks the instant and the host to kill; the other host is
killed a moment later (a real one would fail at its next collective). The next launch resumes
the pair; every step either ever logs must have the loss the uninterrupted run logged at that
step (bit for bit: JSON round-trips a float exactly), and the last launch, left to finish, must
end with the same masters. A deleted host store is then refused, naming that host.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload.manifest import read_committed
from tests.ranks import free_port

OVERRIDES = ["preset=tiny", "compute_dtype=fp32", "seq_len=64", "micro_batch=4", "log_every=1",
             "checkpoint.interval=3", "optim.decay_steps=100000", "chunk_mb=1", "io_threads=2"]  # fmt: skip


def train_args(store: str, steps: int, metrics: Path) -> list[str]:
    """The arguments of ``python -m engine`` for the test's run."""
    args = ["train", "--nvme_path", store, "--steps", str(steps), "--train.metrics", str(metrics)]
    return args + [part for o in OVERRIDES for part in (f"--{o.split('=')[0]}", o.split("=")[1])]


def launch(
    store: str, hosts: int, steps: int, metrics: Path, logs: Path, share_cores: bool = True
) -> list[subprocess.Popen]:
    """Two ranks of ``python -m engine train`` on ``hosts`` simulated hosts, each rank its own
    process group; rank 0's stderr is piped, the other's goes to a file in ``logs``."""
    port, per_host = free_port(), 2 // hosts  # the node is GROUP_RANK, as torchrun sets it
    command = [sys.executable, "-m", "engine", *train_args(store, steps, metrics)]
    procs = []
    for rank in range(2):
        env = os.environ | {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_host), "GROUP_RANK": str(rank // per_host), "OMP_NUM_THREADS": "1",
            # Both "hosts" share this machine's cores: each takes half, as the ranks of one host do,
            # so the arithmetic (its thread count included) is the same however the ranks are spread
            # (``share_cores``; else each takes them all, as torchrun tells a rank alone on its host).
            "LOCAL_WORLD_SIZE": "2" if share_cores else str(per_host),
        }  # fmt: skip
        err = subprocess.PIPE if rank == 0 else open(logs / f"rank-{rank}.log", "a")  # noqa: SIM115
        procs.append(subprocess.Popen(command, env=env, stderr=err, text=True, start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str]]:
    """Wait for both ranks; their exit codes and rank 0's stderr."""
    out = procs[0].communicate(timeout=timeout)[1]
    procs[1].wait(timeout=timeout)
    return [(procs[0].returncode, out), (procs[1].returncode, "")]


def losses(metrics: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, metrics.read_text().splitlines())]


def masters(store: Path) -> dict[str, bytes]:
    """The committed generation's master chunk files, by path within it."""
    root = store / f"gen-{read_committed(store)['generation']}"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("*/master/c/*"))}


@pytest.mark.slow  # kept out of the default run's 10 minutes; CI runs it with the slow ones
@pytest.mark.parametrize("kills", [2, 10])
def test_killing_one_host_at_random_instants_resumes_from_a_step_both_committed(tmp_path, kills: int) -> None:
    rng = random.Random(kills)
    metrics, stores = tmp_path / "metrics.jsonl", str(tmp_path / "node-{node}")
    for _ in range(kills):
        procs = launch(stores, 2, 100000, metrics, tmp_path)
        for line in procs[0].stderr:  # wait until it trains: a kill before that only tests start-up
            if "train:" in line or "loss" in line:
                break
        time.sleep(rng.uniform(0.0, 1.0))
        victim = rng.randrange(2)
        os.killpg(procs[victim].pid, signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.2))  # the other host lives on a moment: it may commit alone
        os.killpg(procs[1 - victim].pid, signal.SIGKILL)
        for proc in procs:
            proc.wait(timeout=60)
        procs[0].stderr.close()
    steps = [read_committed(tmp_path / f"node-{node}")["step"] for node in range(2)]
    final = max(steps) + 3
    (code, err), (code1, _) = finish(launch(stores, 2, final, metrics, tmp_path))
    assert code == 0 and code1 == 0, err[-3000:] + (tmp_path / "rank-1.log").read_text()[-3000:]

    reference = tmp_path / "reference.jsonl"
    (code, err), _ = finish(launch(str(tmp_path / "one"), 1, final, reference, tmp_path))
    assert code == 0, err[-3000:]
    expected = dict(losses(reference))
    logged = losses(metrics)
    assert {step for step, _ in logged} == set(expected), "every step was logged by some launch"
    assert all(loss == expected[step] for step, loss in logged), "a resumed step left the uninterrupted trajectory"
    together = masters(tmp_path / "node-0") | masters(tmp_path / "node-1")
    assert together == masters(tmp_path / "one")

    shutil.rmtree(tmp_path / "node-1")
    before = sorted(p.name for p in (tmp_path / "node-0").iterdir())
    (code, err), (code1, _) = finish(launch(stores, 2, final + 1, metrics, tmp_path), timeout=120)
    assert code == 1 and code1 == 1
    assert "the store of host 1" in err and "node-1" in err, err[-2000:]
    assert sorted(p.name for p in (tmp_path / "node-0").iterdir()) == before
