"""The giant benchmark's code path at a small size: a model built into the store unit by unit,
stage 3 with everything on nvme, stopped once (kill -9 with generations, SIGTERM in place),
resumed from the store and finished, its host memory within the estimator's prediction."""

from __future__ import annotations

import math

import pytest

from benchmarks import giant

RSS_TOLERANCE = 1.15


@pytest.mark.parametrize(("mode", "signal"), [("in-place", "SIGTERM"), ("generations", "SIGKILL")])
def test_stop_resume_and_finish_within_the_predicted_memory(tmp_path, mode: str, signal: str) -> None:
    store = tmp_path / "store"
    result = giant.main(["--quick", "--params", "2e7", "--mode", mode, "--store", str(store), "--out", str(tmp_path)])
    summary, steps = result["summary"], result["steps"]
    assert summary["stopped_by"] == signal
    assert summary["first_exit_code"] == (0 if signal == "SIGTERM" else -9)
    first = [row["step"] for row in steps if row["run"] == "first"]
    resumed = [row["step"] for row in steps if row["run"] == "resumed"]
    committed = summary["committed_at_stop"]
    if signal == "SIGTERM":
        assert first[-1] == committed == 2, "SIGTERM after step 1 finishes the step in flight, commits it, then stops"
    else:  # a kill before the last finished step's deferred commit landed loses that step too
        assert committed in (first[-1] - 1, first[-1]), "the store resumes at one of the last two finished steps"
    assert resumed == list(range(committed + 1, 4)) and summary["resumed_exit_code"] == 0
    assert all(math.isfinite(row["loss"]) for row in steps)
    assert summary["peak_rss_bytes"] <= RSS_TOLERANCE * summary["predicted_peak_rss_bytes"], summary
    assert summary["store_bytes"] == pytest.approx(summary["predicted_store_bytes"], rel=0.15)
    assert not store.exists(), "the benchmark removes its store"
