"""python -m benchmarks.gpu: without CUDA it stops at once with one line, --sanitize too; the
largest-model search stops where the engine's device limit refuses a size (the limit is
enforced on any device, so this runs here); a sanitized training is judged by its exit and its
output (any child process runs here); and on CUDA the quick run saves a record whose copies,
steps and search hold to what the engine promises."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu, gpu_sanitize
from benchmarks.plans import PLANS
from benchmarks.runs import REPO_ROOT
from tests.benchmarks.test_benchmarks_quick import load_record
from tests.gpu import needs_cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the benchmark runs instead")
@pytest.mark.parametrize("mode", ["--quick", pytest.param("--sanitize", marks=pytest.mark.slow)])
def test_without_cuda_it_says_so_in_one_line_and_saves_nothing(mode: str, tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", mode, "--out", str(tmp_path), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == gpu.NO_DEVICE_EXIT
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("benchmarks.gpu: no CUDA device"), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_sanitize_flags_parse() -> None:
    args = gpu.build_parser().parse_args(["--sanitize", "--sanitize-s", "30"])
    assert args.sanitize and args.sanitize_s == 30
    assert not gpu.build_parser().parse_args([]).sanitize


PRINTS = "import sys; print('step 1 loss 5.5'); print({!r}, file=sys.stderr); sys.exit({})"
"""A stand-in for a sanitized training: what it prints, and how it exits."""


@pytest.mark.parametrize(
    ("printed", "code", "verdict"),
    [
        ("done", 0, "clean"),
        (
            f"====\n{gpu_sanitize.RACE_MARK} on tensor with data pointer 1\nAccess by stream 7",
            1,
            "a possible data race",
        ),
        ("Traceback: RuntimeError", 1, "exited with code 1"),
    ],
)
def test_a_sanitized_training_is_clean_only_when_it_exits_0_without_a_race(
    printed: str, code: int, verdict: str
) -> None:
    run = gpu_sanitize.run_sanitized("stand-in", [sys.executable, "-c", PRINTS.format(printed, code)], timeout_s=60)
    assert (run.exit_code, run.verdict(), run.clean) == (code, verdict, verdict == "clean")
    assert run.race == ("" if "CSAN" not in printed else printed[printed.index("CSAN") :] + "\n")
    assert "step 1 loss" in run.tail


def test_a_sanitized_training_past_its_limit_is_not_clean() -> None:
    run = gpu_sanitize.run_sanitized("stand-in", [sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert run.exit_code is None and not run.clean and run.verdict() == "ran past its time limit"


@pytest.mark.slow  # a run of each size in turn: about 25 s
def test_the_search_doubles_until_the_device_limit_refuses_a_size(tmp_path: Path) -> None:
    search = gpu.largest_model(limit_mb=8, start_params=1e6, budget_s=600, threads=1, work=tmp_path)
    params = [row["params M"] for row in search.rows]
    assert len(params) >= 2 and all(1.5 < b / a < 2.5 for a, b in itertools.pairwise(params))
    assert search.largest_params / 1e6 == params[-1]
    assert "exited with code 1" in search.stopped, "the next size was refused, not timed out"
    assert all(0 < row["engine device MiB"] <= 8 for row in search.rows)
    assert list(tmp_path.iterdir()) == []


def test_the_search_stops_before_a_size_that_would_end_late(tmp_path: Path) -> None:
    search = gpu.largest_model(limit_mb=64, start_params=1e6, budget_s=0, threads=1, work=tmp_path)
    assert len(search.rows) == 1 and search.largest_params > 0
    assert "--search-s" in search.stopped


PINNED_OVER_PAGEABLE = 1.5
"""How much faster a pinned host-to-device copy must be than a pageable one at the largest size:
the driver stages a pageable copy through a pinned buffer of its own, a host memcpy in series
with the DMA (about 10 GB/s on one core), against 25 GB/s pinned over PCIe 4 and 50 over PCIe 5;
a "pinned" buffer that is not is as slow as pageable memory."""
ENGINE_OF_TORCH = 0.8
"""The least share of torch's pinned GB/s the engine's copy path keeps at the largest size, each
way: it adds an event and a wait between streams per copy, microseconds against milliseconds."""
OVERLAP_NOISE = 1.2
"""The most a plan's overlap may read: max(compute, movement) / step is at most 1 for any real
step, but here both steps are the median of two steps of the tiny model, milliseconds long."""


def check_copies(copies: list[dict]) -> None:
    """Every path at every size, the pinned paths pinned, and their speeds at the largest size."""
    assert {(row["path"], row["MiB"]) for row in copies} == {
        (path, mib) for path in gpu.COPY_PATHS for mib in gpu.QUICK.copy_mib
    }
    for row in copies:
        assert row["pinned"] == (row["path"] != "torch pageable"), row
        assert row["to device GB/s"] > 0 and row["to host GB/s"] > 0, row
    largest = {row["path"]: row for row in copies if row["MiB"] == max(gpu.QUICK.copy_mib)}
    pinned, pageable, engine = largest["torch pinned"], largest["torch pageable"], largest["engine"]
    assert pinned["to device GB/s"] >= PINNED_OVER_PAGEABLE * pageable["to device GB/s"], largest
    for way in gpu.DIRECTIONS:
        assert engine[f"{way} GB/s"] >= ENGINE_OF_TORCH * pinned[f"{way} GB/s"], f"{way}: {largest}"


@pytest.mark.gpu
@needs_cuda
def test_quick_run_on_cuda(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    gpu.main(["--quick", "--out", str(tmp_path), "--dir", str(disk), "--reps", "1"])
    record = load_record(tmp_path, "gpu")
    check_copies(record["copies"])
    assert [row["plan"] for row in record["steps"]] == [PLANS[key].label for key in gpu.QUICK_PLANS]
    for row in record["steps"]:
        assert row["step s"] > 0 and 0 < row["overlap"] <= OVERLAP_NOISE and row["engine device MiB"] > 0, row
    search = record["search"]
    assert search["largest_params"] > 0
    for row in search["rows"]:
        assert 0 < row["engine device MiB"] <= gpu.QUICK.limit_mb, row
        assert row["device peak MiB"] >= row["engine device MiB"], "the allocator counts all the engine holds, and more"
    assert list(disk.iterdir()) == []
