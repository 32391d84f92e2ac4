"""The gradient-norm benchmark: both ways of widening timed, in a process of its own (the
benchmark sets the engine's heap as it starts), and giving the same bits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_both_widenings_are_timed_and_agree_bit_for_bit(tmp_path) -> None:
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "benchmarks.grad_norms", "--quick", "--rounds", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    payload = json.loads((tmp_path / "grad_norms.json").read_text())
    assert payload["same_bits"] is True and payload["elements"] > 0
    torch_row, scratch_row = payload["rows"]
    assert torch_row["widening"].startswith("widened by torch") and torch_row["x torch's"] == 1.0
    assert all(len(s) == 2 and min(s) > 0 for s in payload["seconds"].values())
    assert scratch_row["s (fastest round)"] == min(payload["seconds"][scratch_row["widening"]])
