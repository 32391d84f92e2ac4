"""``python -m engine train`` end to end, as a user runs it (one process and torchrun)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys

from tests.ranks import free_port

DONE = re.compile(r"done: (\d+) steps, loss ([-\d.naninf]+) -> ([-\d.naninf]+)")


def run(args: list[str], tmp_path, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = (launcher or [sys.executable, "-m"]) + ["engine", "train", "--preset", "tiny", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def losses(proc: subprocess.CompletedProcess) -> tuple[int, float, float]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = DONE.search(proc.stderr)
    assert match, proc.stderr[-3000:]
    return int(match[1]), float(match[2]), float(match[3])


def test_three_steps_exit_cleanly(tmp_path) -> None:
    steps, first, last = losses(run(["--steps", "3", "--seq_len", "64"], tmp_path))
    assert steps == 3 and math.isfinite(first) and math.isfinite(last)


def test_fifty_steps_lower_the_loss(tmp_path) -> None:
    steps, first, last = losses(run(["--steps", "50", "--seq_len", "64", "--lr", "3e-3", "--log_every", "25"], tmp_path))
    assert steps == 50 and last < first - 1.0


def test_torchrun_two_ranks(tmp_path) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}", "-m"]
    steps, first, last = losses(run(["--steps", "3", "--seq_len", "64", "--stage", "1"], tmp_path, launcher))
    assert steps == 3 and math.isfinite(last)


def test_bad_override_is_a_clear_error(tmp_path) -> None:
    proc = run(["--stgae", "2"], tmp_path)
    assert proc.returncode == 2
    assert "unknown config key 'stgae' (did you mean 'stage'?)" in proc.stderr


def test_bad_step_count(tmp_path) -> None:
    proc = run(["--steps", "0"], tmp_path)
    assert proc.returncode == 2 and "train.steps" in proc.stderr


def test_second_run_resumes_from_the_store(tmp_path) -> None:
    losses(run(["--steps", "3", "--seq_len", "64"], tmp_path))
    proc = run(["--steps", "5", "--seq_len", "64"], tmp_path)
    assert "resumed at step 3" in proc.stderr
    steps, _, _ = losses(proc)
    assert steps == 5


def test_sigterm_finishes_the_step_commits_and_exits_cleanly(tmp_path) -> None:
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "engine", "train", "--preset", "tiny", "--seq_len", "64", "--steps", "100000", "--log_every", "1"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "step 2 loss" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=120)[1]
    output = "".join(seen) + rest
    assert proc.returncode == 0, output[-3000:]
    stopped = re.search(r"stopped after step (\d+) of 100000: run the same command again to resume", output)
    assert stopped, output[-3000:]
    committed = json.loads((tmp_path / "offload_store" / "COMMITTED").read_text())
    assert committed["step"] == int(stopped[1])


def test_inspect_and_consolidate_commands(tmp_path) -> None:
    losses(run(["--steps", "2", "--seq_len", "64", "--compute_dtype", "fp32"], tmp_path))
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    inspect = subprocess.run(
        [sys.executable, "-m", "engine", "inspect", "offload_store", "--verify"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert inspect.returncode == 0, inspect.stderr
    assert re.search(r"checksum:\s+ok", inspect.stdout), inspect.stdout
    chunk = next((tmp_path / "offload_store").glob("gen-2/blocks.0/master/c/0"))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    damaged = subprocess.run(
        [sys.executable, "-m", "engine", "inspect", "offload_store", "--verify"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert damaged.returncode == 1 and "blocks.0 master chunk 0" in damaged.stdout
    consolidate = subprocess.run(
        [sys.executable, "-m", "engine", "consolidate", "offload_store", "w.safetensors"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert consolidate.returncode == 1 and "fails its CRC-32C check" in consolidate.stderr, consolidate.stderr
    assert not (tmp_path / "w.safetensors").exists()
