"""Smoke tests of the step and scale benchmarks: each runs end to end on tiny models and saves a
complete JSON record of finite numbers, one row per plan or size.

Not performance checks: the numbers only have to exist, be finite and be positive where
something was measured. One torch thread, so that a busy machine does not slow them tenfold.
"""

import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import scale, step, traffic
from benchmarks.optimizer import synthetic_layout
from benchmarks.plans import PLANS
from benchmarks.plots import line_panels
from benchmarks.traffic import StoreTraffic, step_transfers
from engine.config import OffloadConfig
from offload import read_shard, write_shard
from tests.benchmarks.test_benchmarks_quick import load_record

ONE_THREAD = ["--threads", "1"]


def assert_finite_non_negative(row: dict[str, Any]) -> None:
    for key, value in row.items():
        if isinstance(value, (int, float)):
            assert math.isfinite(value) and value >= 0, (key, value)


def test_step_quick(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    step.main(["--quick", "--out", str(tmp_path), "--dir", str(disk), "--reps", "1", *ONE_THREAD])
    record = load_record(tmp_path, "step")
    rows = record["rows"]
    assert [row["plan"] for row in rows] == [plan.label for plan in PLANS.values()]
    for plan, row in zip(PLANS.values(), rows, strict=True):
        assert_finite_non_negative(row)
        for key in ("step s", "compute s", "overlap", "engine compute s"):
            assert row[key] > 0, (plan.key, key)
        for key in ("movement s", "movement MB", "engine MB", "movement CPU s"):
            assert (row[key] > 0) == plan.uses_store, (plan.key, key)
        assert row["CPU bound s"] >= max(row["compute s"], row["movement s"])
    # With only the optimizer state on nvme, the traffic moved alone is exactly what the engine moves.
    optimizer_only = rows[list(PLANS).index("s2-nvme")]
    assert optimizer_only["movement MB"] == optimizer_only["engine MB"]
    assert set(record["computes"]) == set(PLANS)  # each plan ran beside its own compute-only partner
    # The engine's own account of the stores' I/O CPU, per GB and by stage, for every plan that moves bytes.
    costs = {row["plan"]: row for row in record["cpu_s_per_gb"]}
    assert set(costs) == {plan.label for plan in PLANS.values() if plan.uses_store}
    for row in costs.values():
        assert_finite_non_negative(row)
        assert row["crc32c"] > 0 and row["total"] >= row["crc32c"] and row["process"] > 0
    assert list(disk.iterdir()) == []  # every store was removed


def test_step_traffic_moves_what_the_plan_offloads() -> None:
    """Per parameter: 3 fp32 states read and written when the optimizer is on nvme (and an fp32
    gradient when it is spilled); a bf16 shard read twice (forward, backward) and written once
    when the parameters are."""
    layout = synthetic_layout([4096, 8192], chunk_mb=1)
    numel = sum(unit.shard_numel for unit in layout.units)
    expected = {  # (read, written) bytes per element
        "s2-cpu": (0, 0),
        "s2-nvme": (12, 12),
        "s3-nvme-cpu": (12, 12),
        "s3-nvme-nvme": (12 + 2 * 2, 12 + 2),
    }
    for key, (read, written) in expected.items():
        transfers = step_transfers(layout, PLANS[key], torch.bfloat16)
        assert sum(s.nbytes for t in transfers for s in t.reads) == read * numel, key
        assert sum(s.nbytes for t in transfers for s in t.writes) == written * numel, key
        if PLANS[key].optimizer != "nvme":
            continue  # gradients are spilled only beside optimizer state on nvme
        # Spilled gradients: an fp32 shard written in backward and read back with the state.
        spilled = step_transfers(layout, PLANS[key], torch.bfloat16, spill=True)
        assert sum(s.nbytes for t in spilled for s in t.reads) == (read + 4) * numel, key
        assert sum(s.nbytes for t in spilled for s in t.writes) == (written + 4) * numel, key


def test_step_traffic_reads_nothing_while_its_write_is_pending(tmp_path: Path, monkeypatch) -> None:
    """The update reads the gradients backward spilled: the replay lets those writes land first,
    as the engine does (a read racing its write fails the chunk's CRC on a many-core machine)."""
    writing: set[tuple[str, str]] = set()
    lock = threading.Lock()

    def slow_write(store, prefix, unit, rank, views) -> None:
        with lock:
            writing.update((unit.name, kind) for kind, _ in views)
        time.sleep(0.05)
        write_shard(store, prefix, unit, rank, views)
        with lock:
            writing.difference_update((unit.name, kind) for kind, _ in views)

    def checked_read(store, prefix, unit, rank, views) -> None:
        with lock:
            racing = writing & {(unit.name, kind) for kind, _ in views}
        assert not racing, f"read {racing} while its write was pending"
        read_shard(store, prefix, unit, rank, views)

    monkeypatch.setattr(traffic, "write_shard", slow_write)
    monkeypatch.setattr(traffic, "read_shard", checked_read)
    layout = synthetic_layout([4096] * 4, chunk_mb=1)
    transfers = step_transfers(layout, PLANS["s3-nvme-nvme"], torch.bfloat16, spill=True)
    offload = OffloadConfig(io_threads=4, buffer_mb=64, direct_io=False)
    with StoreTraffic(tmp_path / "store", transfers, offload, in_place=True) as replay:
        replay.step()


@pytest.mark.slow  # benchmarks.scale end to end over its sizes: about 45 s
def test_scale_quick(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    scale.main(["--quick", "--out", str(tmp_path), "--dir", str(disk), "--steps", "1", *ONE_THREAD])
    record = load_record(tmp_path, "scale")
    rows = record["rows"]
    assert len(rows) == len(scale.QUICK_SIZES)
    params = [row["params M"] for row in rows]
    assert params == sorted(params) and params[-1] / params[0] > 7  # about 8x, as for_params fits
    for row in rows:
        assert_finite_non_negative(row)
        assert all(value > 0 for value in row.values()), row
    for fit in ("step_fit", "rss_fit"):
        assert all(math.isfinite(value) for value in record[fit].values()), fit
    assert list(disk.iterdir()) == []


@pytest.mark.slow  # benchmarks.scale with clipping end to end: about 45 s
def test_scale_clipping_quick(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    argv = ["--clipping", "--sizes", "0.5", "--plan", "s2-nvme", "--seq_len", "32", "--micro_batch", "1"]
    scale.main([*argv, "--out", str(tmp_path), "--dir", str(disk), "--steps", "1", "--warmup", "0", *ONE_THREAD])
    rows = load_record(tmp_path, "scale-clipping")["rows"]
    assert [row["run"] for row in rows] == list(scale.CLIPPING)
    for row in rows:
        assert_finite_non_negative(row)
        assert row["peak RSS MB"] > 0 and row["step s"] > 0, row
    spilled, in_memory, unclipped = (row["GB moved"] for row in rows)
    assert spilled > in_memory == unclipped, "the spilled gradients are written and read back"
    assert list(disk.iterdir()) == []


def test_line_plot_is_skipped_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    path = tmp_path / "plot.png"
    panels = {"y": {"measured": [1.0, 2.0], "model": lambda x: x}}
    assert line_panels(path, [1.0, 2.0], panels, xlabel="x", title="t") is None
    assert not path.exists()
