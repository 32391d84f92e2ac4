"""The disk's mixed rate: reads and durable writes at once, in the share a step moves them."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from benchmarks.bandwidth import mixed_disk_gbps
from benchmarks.giant import step_rows


@pytest.mark.parametrize("share", [0.25, 0.62])
def test_the_mixed_rate_moves_the_asked_share_and_leaves_no_file(tmp_path: Path, share: float) -> None:
    nbytes = 256 * mmap.PAGESIZE
    mixed = mixed_disk_gbps(tmp_path, nbytes, share, threads=2, reps=1)
    assert mixed["gbps"] > 0
    assert abs(mixed["read_share"] - share) <= 1 / 256
    assert not list(tmp_path.iterdir()), "both probe files are removed"


def test_a_step_is_held_against_both_bounds() -> None:
    record = {"step": 1, "loss": 1.0, "seconds": 10.0, "compute_s": 2.0, "param_wait_s": 1.0}
    record |= {"optimizer_wait_s": 1.0, "bytes_read": 6e9, "bytes_written": 4e9, "prefetch_hit_rate": 1.0}
    record |= {"peak_rss_bytes": 1 << 30, "device_high_water": 0}
    bound = {"read_gbps": 2.0, "write_gbps": 1.0, "compute_s": 0.0}
    (summed,) = step_rows([record], ["first"], bound)
    assert summed["bound s"] == pytest.approx(7.0) and "step/mixed" not in summed
    (both,) = step_rows([record], ["first"], bound | {"mixed_gbps": 2.0})
    assert both["mixed bound s"] == pytest.approx(5.0) and both["step/mixed"] == pytest.approx(2.0)
