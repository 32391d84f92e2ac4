"""The fine-tune benchmark at a tiny size: a checkpoint written shard by shard, imported, fine-tuned
on chat records with everything on nvme, stopped by SIGTERM and resumed where it stopped,
exported as the store holds it, sampled from, and its work folder within its disk plan; and
the same of a mixture of experts started from its config. Both take minutes: slow. And the
prefetch window it gives the runs, and the stop it accepts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

RUNS = ["fine-tune (stopped)", "resumed", "export", "generate"]


WORK = "work"
"""The folder given as ``--dir``, under the test's."""


def run_quick(tmp_path: Path, *options: str) -> dict[str, Any]:
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from benchmarks import finetune

    work = tmp_path / WORK  # not made yet: the benchmark makes it
    return finetune.main(["--quick", *options, "--dir", str(work), "--out", str(tmp_path)])


def check_run(result: dict[str, Any], tmp_path: Path) -> None:
    """The verdicts every run must give, and each phase's columns."""
    rows = {row["phase"]: row for row in result["rows"]}
    assert all(row["seconds"] > 0 and row["peak RSS GiB"] > 0 for row in rows.values())
    assert rows["fine-tune (stopped)"]["written GB"] > 0 and rows["fine-tune (stopped)"]["read GB"] > 0
    assert rows["export"]["written GB"] > 0
    built = rows.get("import", rows.get("initialise"))
    assert 0 < built["start-up s"] < built["seconds"], "the build's process starts up before it streams"
    assert built["raw time / streamed time"] > built["raw time / time"]
    summary = result["summary"]
    assert summary["stopped_by"] == "SIGTERM"
    assert summary["resumed_from"] == summary["committed_at_stop"] >= 1, "the resumed run goes on from its stop"
    assert summary["steps_done"] == 3 and summary["steps_in_order"]
    assert len(summary["val_loss"]) == 3 and all(math.isfinite(loss) for loss in summary["val_loss"])
    assert summary["export_equals_store"] and summary["export_tensors_checked"] > 0, "the first shard is the store's"
    assert summary["generated"], "generate added text"
    assert 0 < summary["measured_peak_GB"] <= summary["planned_peak_GB"], "the work folder stayed within its plan"
    assert summary["training_peak_RSS_GiB"] > 0 and summary["largest_unit_M"] > 0
    assert summary["estimated_peak_at"] in ("construction", "backward start", "backward end", "optimizer step")
    assert all(step["bound s"] > 0 and step["step/bound"] > 0 for step in result["steps"])
    assert all(step["mixed bound s"] > 0 and step["step/mixed"] > 0 for step in result["steps"])
    assert [step["run"] for step in result["steps"]].count("resumed") == 3 - summary["committed_at_stop"]
    assert list((tmp_path / WORK).iterdir()) == [], "the work folder is removed"


@pytest.mark.slow
def test_finetune_quick(tmp_path: Path) -> None:
    result = run_quick(tmp_path)
    assert [row["phase"] for row in result["rows"]] == ["write checkpoint", "import", *RUNS]
    check_run(result, tmp_path)
    assert result["rows"][1]["written GB"] > 0, "the import wrote the store"
    assert result["summary"]["export_changed"], "the fine-tune changed the checked weight"
    assert (tmp_path / "finetune.json").is_file()


@pytest.mark.slow
def test_finetune_moe_quick(tmp_path: Path) -> None:
    result = run_quick(tmp_path, "--moe")
    assert [row["phase"] for row in result["rows"]] == ["initialise", *RUNS]
    check_run(result, tmp_path)
    assert result["summary"]["export_changed"] is None, "no checkpoint to compare with"
    assert (tmp_path / "finetune-moe.json").is_file()


@pytest.mark.parametrize(("given", "expected"), [(None, "auto"), ("0", 0.0), ("48", 48.0)])
def test_the_runs_prefetch_window_is_the_engines_auto_unless_given(tmp_path: Path, given, expected) -> None:
    """A 0 given (no prefetch) is kept, not taken for the default."""
    from benchmarks import finetune

    args, _ = finetune.parse_args(["--quick", *(["--prefetch-mb", given] if given else [])])
    config = finetune.planned_config(finetune.run_settings(tmp_path, args))
    assert config.zero.prefetch_mb == expected


@pytest.mark.parametrize(("steps", "stop_after", "fits"), [(4, 2, True), (3, 1, True), (3, 2, False), (4, 4, False)])
def test_the_stop_leaves_a_step_to_resume(steps: int, stop_after: int, fits: bool, capsys) -> None:
    """SIGTERM lands in the step after ``--stop-after``, which commits: a stop that leaves no
    step after that one would resume nothing, so it is refused in one line."""
    from benchmarks import finetune

    argv = ["--quick", "--steps", str(steps), "--stop-after", str(stop_after)]
    if fits:
        assert finetune.parse_args(argv)[0].stop_after == stop_after
        return
    with pytest.raises(SystemExit):
        finetune.parse_args(argv)
    assert f"[1, {steps - 2}]" in capsys.readouterr().err
