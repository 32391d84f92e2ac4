"""The giant benchmark's code path at a small size: a model built into the store unit by unit,
stage 3 with everything on nvme, stopped once (kill -9 with generations, SIGTERM in place),
resumed from the store and finished, its host memory within the estimator's prediction, and
its losses and final masters those of the same run left alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import giant
from engine.tools.consolidate import consolidate

pytestmark = pytest.mark.slow  # three runs of python -m engine train and two resumes: about 100 s

RSS_TOLERANCE = 1.15
ARGS = ["--quick", "--params", "2e7"]


def masters(store: Path, out: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights a store's last commit holds."""
    consolidate(store, out)
    return load_file(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The same command as the benchmark's, run to the end without a stop: each step's loss
    and the final masters."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    store, metrics = folder / "store", folder / "metrics.jsonl"
    args = giant.parse_args([*ARGS, "--store", str(store)])
    code = giant.launch(giant.run_config(args, store, metrics), folder / "train.log").wait()
    assert code == 0, (folder / "train.log").read_text()[-3000:]
    losses = {row["step"]: row["loss"] for row in giant.steps_recorded(metrics)}
    return losses, masters(store, folder / "masters.safetensors")


@pytest.mark.parametrize(("mode", "signal", "keep"), [("in-place", "SIGTERM", False), ("generations", "SIGKILL", True)])
def test_stop_resume_and_finish_within_the_predicted_memory(
    tmp_path, mode: str, signal: str, keep: bool, uninterrupted
) -> None:
    """The killed run's store is kept (``--keep-store``) to compare its masters; the other is
    left to the benchmark, which removes it."""
    store = tmp_path / "store"
    argv = [*ARGS, "--mode", mode, "--store", str(store), "--out", str(tmp_path)] + ["--keep-store"] * keep
    result = giant.main(argv)
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
    assert [(p["run"], p["step"]) for p in result["phases"]] == [(row["run"], row["step"]) for row in steps]
    for split, row in zip(result["phases"], steps, strict=True):
        assert sum(phase["seconds"] for phase in split["phases"].values()) == pytest.approx(row["step s"], rel=1e-9)
    assert summary["peak_rss_bytes"] <= RSS_TOLERANCE * summary["predicted_peak_rss_bytes"], summary
    assert summary["store_bytes"] == pytest.approx(summary["predicted_store_bytes"], rel=0.15)
    expected_losses, expected_masters = uninterrupted
    assert {row["step"] for row in steps} == set(expected_losses)
    wrong = [(row["step"], row["loss"]) for row in steps if row["loss"] != expected_losses[row["step"]]]
    assert not wrong, f"losses (of each run of a step, a redone one too) not the uninterrupted run's: {wrong}"
    if not keep:
        assert not store.exists(), "the benchmark removes its store"
        return
    got = masters(store, tmp_path / "masters.safetensors")
    assert got.keys() == expected_masters.keys()
    differing = [name for name in got if not torch.equal(got[name], expected_masters[name])]
    assert not differing, f"the stopped and resumed run's masters differ from the uninterrupted run's: {differing[:3]}"
