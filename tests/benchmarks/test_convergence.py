"""The convergence benchmark at its quick size: three seeds a form, a score that is not one
point, results kept only beside those of the same code and configuration, and a verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import convergence
from tests.benchmarks.test_benchmarks_quick import load_record


@pytest.mark.slow  # seven runs of python -m engine train: about 90 s
def test_convergence_scores_each_form_over_seeds_and_keys_results_on_code_and_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = ["--quick", "--out", str(tmp_path), "--steps", "4", "--eval-every", "2"]
    convergence.main([*tiny, "--forms", "fp32"])
    convergence.main([*tiny, "--forms", "int8"])
    record = load_record(tmp_path, "convergence-quick")
    assert list(record["forms"]) == ["fp32", "int8"]
    for curves in record["forms"].values():
        assert list(curves) == ["0", "1", "2"], "three seeds a form"
        assert all(c["steps"] == [2, 4] and all(loss > 0 for loss in c["val_loss"]) for c in curves.values())
    fp32 = record["forms"]["fp32"]
    assert fp32["0"]["val_loss"] != fp32["1"]["val_loss"], "a seed draws its own initialisation and batches"
    settings = record["settings"]
    assert settings["code"] == convergence.code_version() != "unknown"
    assert settings["config"]["optim"]["betas"] == [0.9, 0.95], "the whole configuration, defaults included"
    base, int8 = record["rows"]
    assert (base["form"], base["vs fp32"], base["within"]) == ("fp32", 1.0, None)
    assert int8["form"] == "int8" and int8["seeds"] == 3
    assert int8["within"] is True, f"int8 moments trained worse than fp32 beyond their bound: {int8}"
    monkeypatch.setattr(convergence, "code_version", lambda: "0" * 40)  # other code: its curves start afresh
    convergence.main([*tiny, "--forms", "bf16", "--seeds", "1"])
    assert list(load_record(tmp_path, "convergence-quick")["forms"]) == ["bf16"]


def test_the_verdict_holds_a_forms_score_to_its_bound() -> None:
    def form(*finals: float) -> dict:
        return {
            str(seed): {"steps": [2, 4, 6, 8], "val_loss": [5.0, 9.0, final, final]}
            for seed, final in enumerate(finals)
        }

    # A score is the mean over seeds of the last TAIL = 3 losses: fp32's (13 + 17) / 6 = 5, and 4.27 for 4 makes it (13 + 17.54) / 6.
    forms = {"fp32": form(2.0, 4.0), "int8": form(2.0, 4.27), "bf16": form(2.0, 4.27)}
    assert convergence.TAIL == 3
    rows = {row["form"]: row for row in convergence.rows(forms)}
    assert rows["fp32"]["score"] == 5.0
    assert rows["int8"]["vs fp32"] == rows["bf16"]["vs fp32"] == pytest.approx(1.018)
    assert rows["int8"]["within"] is True, "int8's bound is 2%"
    assert rows["bf16"]["within"] is False, "bf16's bound is 1%"
    assert rows["int8"]["seed spread"] == pytest.approx(2.27)
