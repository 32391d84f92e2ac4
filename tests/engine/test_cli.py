"""``python -m engine`` end to end, as a user runs it (one process and torchrun), and how each
kind of bad input ends it: one line naming the fix, no traceback."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys

import pytest

from engine.run import cli as engine_cli
from tests.caches import fresh_cache
from tests.ranks import free_port

DONE = re.compile(r"done: (\d+) steps, loss ([-\d.naninf]+) -> ([-\d.naninf]+)")


def command(args: list[str], tmp_path, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """``python -m engine ARGS`` (under ``launcher`` if given) in ``tmp_path``."""
    env = os.environ | {"XDG_CACHE_HOME": fresh_cache(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    full = (launcher or [sys.executable, "-m"]) + ["engine", *args]
    return subprocess.run(full, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def run(args: list[str], tmp_path, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """``python -m engine train`` of the tiny preset with ``args``."""
    return command(["train", "--preset", "tiny", *args], tmp_path, launcher)


def losses(proc: subprocess.CompletedProcess) -> tuple[int, float, float]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = DONE.search(proc.stderr)
    assert match, proc.stderr[-3000:]
    return int(match[1]), float(match[2]), float(match[3])


def test_three_steps_exit_cleanly(tmp_path) -> None:
    steps, first, last = losses(run(["--steps", "3", "--seq_len", "64"], tmp_path))
    assert steps == 3 and math.isfinite(first) and math.isfinite(last)


@pytest.mark.slow  # fifty steps (a few steps lower it in test_gpt): about 45 s
def test_fifty_steps_lower_the_loss(tmp_path) -> None:
    steps, first, last = losses(
        run(["--steps", "50", "--seq_len", "64", "--lr", "3e-3", "--log_every", "25"], tmp_path)
    )
    assert steps == 50 and last < first - 1.0


def torchrun(ranks: int) -> list[str]:
    """The launcher of ``python -m engine`` on ``ranks`` local processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        f"--master-port={free_port()}",
        "-m",
    ]


@pytest.mark.slow  # torchrun trains two ranks in the two-rank resume below too: about 20 s
def test_torchrun_two_ranks(tmp_path) -> None:
    steps, _first, last = losses(run(["--steps", "3", "--seq_len", "64", "--stage", "1"], tmp_path, torchrun(2)))
    assert steps == 3 and math.isfinite(last)


@pytest.mark.slow  # kept out of the default run's 10 minutes; CI runs it with the slow ones
def test_a_two_rank_run_resumes_on_one_rank_keeping_its_global_batch(tmp_path) -> None:
    args = ["--seq_len", "64", "--stage", "1", "--micro_batch", "2"]
    assert losses(run([*args, "--steps", "2"], tmp_path, torchrun(2)))[0] == 2
    resumed = run([*args, "--steps", "4"], tmp_path)
    assert losses(resumed)[0] == 4, "on to step 4, from the two steps saved"
    assert (
        "resuming a 2-rank run on 1 rank(s): keeping its global batch of 4 rows, data.micro_batch 4 per rank"
        in resumed.stderr
    )
    three = run([*args, "--steps", "5"], tmp_path, torchrun(3))
    assert three.returncode == 1
    refused = "global batch of 4 rows on 1 rank(s), which 3 ranks cannot share evenly: resume on a number of ranks that divides 4"
    assert f"[rank 0] ERROR engine: the run was saved with a {refused}" in three.stderr


# (arguments, exit code, what the last line of stderr says). In tmp_path: "plain" is a folder,
# "weights.pt" a file, "broken.toml" not TOML. Config and argument errors come before torch loads.
BAD_INPUTS = [
    (["--log-level", "NOPE", "train"], 2, "argument --log-level: 'NOPE' is not a log level: use one of DEBUG, INFO"),
    (["train", "--stgae", "2"], 2, "config error: unknown config key 'stgae' (did you mean 'stage'?)"),
    (["train", "--stage", "two"], 2, "config error: zero.stage = 'two': expected int, got str"),
    (["train", "--steps", "0"], 2, "config error: train.steps = 0: must be >= 1"),
    (["train", "--lr", "inf"], 2, "config error: optim.lr = inf: must be finite"),
    (["train", "--lr", "nan"], 2, "config error: optim.lr = nan: must be finite"),
    (["train", "--debug", "--steps", "3"], 2, "error: --debug and --log-level go before the command"),
    (["train", "stray"], 2, "config error: unexpected argument 'stray': overrides look like --key value"),
    (["train", "--config", "broken.toml"], 2, "config error: config file broken.toml is not valid TOML: "),
    (["train", "--config", "missing.toml"], 2, "config error: config file missing.toml does not exist"),
    (["estimate", "--params", "inf"], 2, "argument --params: 'inf' is not a number > 0"),
    (["estimate", "--layers", "-1", "--hidden", "64"], 2, "argument --layers: '-1' is not an integer > 0"),
    (["inspect", "missing"], 1, "no store at missing: the path does not exist; pass the folder the engine"),
    (["inspect", "plain"], 1, "plain is not an offload store: it is a folder without a zarr.json; pass the"),
    (["inspect", "weights.pt"], 1, "weights.pt is not an offload store: it is a file, not a folder; pass the"),
    (["consolidate", "missing", "w.safetensors"], 1, "no store at missing: the path does not exist"),
    (["consolidate", "plain", "w.safetensors"], 1, "plain is not an offload store: it is a folder without"),
    (["consolidate", "weights.pt", "w.safetensors"], 1, "weights.pt is not an offload store: it is a file"),
]


@pytest.mark.parametrize(("args", "code", "message"), BAD_INPUTS, ids=[" ".join(case[0]) for case in BAD_INPUTS])
def test_bad_input_is_one_line_without_a_traceback(tmp_path, args: list[str], code: int, message: str) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "weights.pt").write_bytes(b"not a store")
    (tmp_path / "broken.toml").write_text("[zero\nstage = 1")
    proc = command(args, tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr
    assert message in lines[-1], proc.stderr
    logged = [line for line in lines if " ERROR " in line]
    assert logged == [lines[-1]] or (not logged and ": error: " in lines[-1]), proc.stderr  # else argparse's


def test_debug_adds_the_traceback(tmp_path) -> None:
    proc = command(["--debug", "train", "--lr", "inf"], tmp_path)
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "engine.config_parse.ConfigError: optim.lr = inf: must be finite (a number, not inf or nan)"


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (TypeError("first\n  second"), 1, "unexpected TypeError: first second (rerun with --debug for the traceback)"),
        (KeyError("units"), 1, "unexpected KeyError: 'units' (rerun with --debug for the traceback)"),
        (RuntimeError("Connection closed by peer\n[gloo] rank 1"), 1, "Connection closed by peer [gloo] rank 1"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ],
)
def test_any_error_is_one_line(monkeypatch, caplog, error: BaseException, code: int, line: str) -> None:
    """Every type, expected or not, ends the command with one line and its exit code."""

    def fail(args, extra) -> int:
        raise error

    monkeypatch.setattr(engine_cli, "_inspect", fail)
    assert engine_cli.main(["inspect", "store"]) == code
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == line and not record.exc_info
    caplog.clear()
    assert engine_cli.main(["--debug", "inspect", "store"]) == code
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info and "rerun with --debug" not in record.getMessage()


@pytest.mark.slow  # two runs of the console command; resuming is tested in process throughout tests/engine
def test_second_run_resumes_from_the_store(tmp_path) -> None:
    losses(run(["--steps", "3", "--seq_len", "64"], tmp_path))
    proc = run(["--steps", "5", "--seq_len", "64"], tmp_path)
    assert "resumed at step 3" in proc.stderr
    steps, _, _ = losses(proc)
    assert steps == 5


def test_sigterm_finishes_the_step_commits_and_exits_cleanly(tmp_path) -> None:
    env = os.environ | {"XDG_CACHE_HOME": fresh_cache(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "engine",
        "train",
        "--preset",
        "tiny",
        "--seq_len",
        "64",
        "--steps",
        "100000",
        "--log_every",
        "1",
    ]
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


@pytest.mark.slow  # the console commands end to end; inspect and consolidate are tested in process in their own modules
def test_inspect_and_consolidate_commands(tmp_path) -> None:
    losses(run(["--steps", "2", "--seq_len", "64", "--compute_dtype", "fp32"], tmp_path))
    inspect = command(["inspect", "offload_store", "--verify"], tmp_path)
    assert inspect.returncode == 0, inspect.stderr
    assert re.search(r"checksum:\s+ok", inspect.stdout), inspect.stdout
    chunk = next((tmp_path / "offload_store").glob("gen-2/blocks.0/master/c/0"))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    damaged = command(["inspect", "offload_store", "--verify"], tmp_path)
    assert damaged.returncode == 1 and "blocks.0 master chunk 0" in damaged.stdout
    consolidate = command(["consolidate", "offload_store", "w.safetensors"], tmp_path)
    assert consolidate.returncode == 1 and "fails its CRC-32C check" in consolidate.stderr, consolidate.stderr
    assert not (tmp_path / "w.safetensors").exists()
