"""benchmarks.phase_plot draws the phases benchmarks.giant saved: a row per step and phase in
its table, a PNG of every labelled run, and a refusal of labels that do not match the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import phase_plot


def phases(forward: float, update: float) -> dict[str, dict[str, float]]:
    split = {
        "forward": {"seconds": forward, "param_wait_s": 0.5, "optimizer_wait_s": 0.0},
        "backward": {"seconds": 2.0, "param_wait_s": 0.25, "optimizer_wait_s": 0.25},
        "update": {"seconds": update, "param_wait_s": 0.0, "optimizer_wait_s": update / 2},
        "other": {"seconds": 0.1, "param_wait_s": 0.0, "optimizer_wait_s": 0.0},
    }
    return {
        name: p | {"compute_s": p["seconds"] - p["param_wait_s"] - p["optimizer_wait_s"]} for name, p in split.items()
    }


def saved(path: Path, forward: float) -> Path:
    steps = [{"step": 1, "loss": 5.0, "phases": phases(forward, 4.0)}, {"step": 2, "loss": 4.0}]
    path.write_text(json.dumps({"phases": phase_plot.phase_steps(steps, ["first", "resumed"])}))
    return path


def test_phase_steps_keep_the_steps_recorded_with_phases() -> None:
    steps = phase_plot.phase_steps([{"step": 1, "phases": phases(1.0, 2.0)}, {"step": 2}], ["first", "first"])
    assert [(s["run"], s["step"]) for s in steps] == [("first", 1)]


def test_a_row_per_step_and_phase_and_a_png_of_both_runs(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    before, after = saved(tmp_path / "before.json", 3.0), saved(tmp_path / "after.json", 1.5)
    png = phase_plot.main([str(before), str(after), "--labels", "before", "after", "--out", str(tmp_path)])
    assert png == tmp_path / "phases.png" and png.stat().st_size > 0
    rows = phase_plot.phase_rows(json.loads(before.read_text())["phases"])
    assert [row["phase"] for row in rows] == ["forward", "backward", "update", "other"]
    assert rows[0]["s"] == 3.0 and rows[0]["parameter wait"] == 0.5 and rows[2]["optimizer wait"] == 2.0
    printed = capsys.readouterr().out
    assert "phases: before" in printed and "phases: after" in printed


def test_labels_one_per_file(tmp_path, capsys) -> None:
    run = saved(tmp_path / "run.json", 1.0)
    with pytest.raises(SystemExit) as exit_info:
        phase_plot.main([str(run), "--labels", "a", "b"])
    assert exit_info.value.code == 2
    assert "2 labels for 1 files" in capsys.readouterr().err
