"""The fine-tune benchmark at a tiny size: a checkpoint written shard by shard, imported, fine-tuned
on chat records with everything on nvme, stopped by SIGTERM and resumed where it stopped,
exported as the store holds it, sampled from, and its work folder within its disk plan."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

PHASES = ["write checkpoint", "import", "fine-tune (stopped)", "resumed", "export", "generate"]


def test_finetune_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from benchmarks import finetune

    result = finetune.main(["--quick", "--dir", str(tmp_path), "--out", str(tmp_path)])
    rows = {row["phase"]: row for row in result["rows"]}
    assert list(rows) == PHASES
    assert all(row["seconds"] > 0 and row["peak RSS GiB"] > 0 for row in rows.values())
    assert all(rows[phase]["written GB"] > 0 for phase in ("write checkpoint", "import", "fine-tune (stopped)"))
    assert rows["export"]["written GB"] > 0 and rows["fine-tune (stopped)"]["read GB"] > 0
    summary = result["summary"]
    assert summary["stopped_by"] == "SIGTERM"
    assert summary["resumed_from"] == summary["committed_at_stop"] >= 1, "the resumed run goes on from its stop"
    assert summary["steps_done"] == 3 and summary["steps_in_order"]
    assert len(summary["val_loss"]) == 3 and all(math.isfinite(loss) for loss in summary["val_loss"])
    assert summary["export_equals_store"] and summary["export_tensors_checked"] > 0, "the first shard is the store's"
    assert summary["export_changed"], "the fine-tune changed the checked weight"
    assert summary["generated"], "generate added text"
    assert 0 < summary["measured_peak_GB"] <= summary["planned_peak_GB"], "the work folder stayed within its plan"
    assert all(step["bound s"] > 0 and step["step/bound"] > 0 for step in result["steps"])
    assert [step["run"] for step in result["steps"]].count("resumed") == 3 - summary["committed_at_stop"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench-finetune-")], "the work folder is removed"
    assert (tmp_path / "finetune.json").is_file()
