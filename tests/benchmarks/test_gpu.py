"""python -m benchmarks.gpu: without CUDA it stops at once with one line; the largest-model
search stops where the engine's device limit refuses a size (the limit is enforced on any
device, so this runs here); and on CUDA the quick run saves a complete record."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu
from benchmarks.plans import PLANS
from benchmarks.runs import REPO_ROOT
from tests.benchmarks.test_benchmarks_quick import load_record
from tests.gpu import needs_cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the benchmark runs instead")
def test_without_cuda_it_says_so_in_one_line_and_saves_nothing(tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == gpu.NO_DEVICE_EXIT
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("benchmarks.gpu: no CUDA device"), done.stderr
    assert list(tmp_path.iterdir()) == []


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


@pytest.mark.gpu
@needs_cuda
def test_quick_run_on_cuda(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    gpu.main(["--quick", "--out", str(tmp_path), "--dir", str(disk), "--reps", "1"])
    record = load_record(tmp_path, "gpu")
    copies = record["copies"]
    assert {(row["host memory"], row["MiB"]) for row in copies} == {
        (kind, mib) for kind in gpu.HOST_MEMORY for mib in gpu.QUICK.copy_mib
    }
    for row in copies:
        assert row["pinned"] == (row["host memory"] != "pageable"), row
        assert row["to device GB/s"] > 0 and row["to host GB/s"] > 0
    assert [row["plan"] for row in record["steps"]] == [plan.label for plan in PLANS.values()]
    for row in record["steps"]:
        assert row["step s"] > 0 and row["overlap"] > 0 and row["engine device MiB"] > 0, row
    search = record["search"]
    assert search["largest_params"] > 0
    for row in search["rows"]:
        assert 0 < row["engine device MiB"] <= gpu.QUICK.limit_mb, row
        assert row["device peak MiB"] >= row["engine device MiB"], "the allocator counts all the engine holds, and more"
    assert list(disk.iterdir()) == []
