"""Host memory of the ``nvme`` tier is bounded by its buffer budget, not by the model.

Each measurement runs in a fresh process (``tests.engine.rss_probe``). On a CPU-only
machine the "device" is host memory too, so the engine's own report of what it keeps
resident (compute-dtype parameters, and the fp32 gradient shards at their peak where they are
held rather than spilled to the store) is subtracted: what remains is the staging of optimizer
state, which must stay within the budget plus a constant.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BUDGET_MB = 64
CONSTANT_MB = 48
"""Interpreter and kernel allocations of a first step, one unit's gradient bucket in flight and
the spilled gradients' writes in flight. Measured with the heap tuned as the console command
tunes it, the excess over held parameters is 90 MiB at 2 layers (the pool's peak 43 of it) and
71 MiB at 8 (the pool's 63): within 64 + 48 = 112."""
MIB = 2**20


def probe(n_layer: int, tier: str, folder) -> dict:
    store = folder / f"store-{n_layer}-{tier}"
    out = subprocess.run(
        [sys.executable, "-m", "tests.engine.rss_probe", str(n_layer), tier, str(BUDGET_MB), str(store)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)
    result["excess"] = result["added_peak"] - result["held_device"] - result["held_cpu"] - result["held_grads"]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("rss")
    return {"small": probe(2, "nvme", folder), "large": probe(8, "nvme", folder), "large_cpu": probe(8, "cpu", folder)}


def test_peak_rss_stays_within_budget_as_the_model_grows_4x(runs) -> None:
    small, large = runs["small"], runs["large"]
    assert large["params"] > 3.5 * small["params"]
    assert small["spills_gradients"] and large["spills_gradients"], "the nvme tier spills clipped gradients"
    for run in (small, large):
        assert run["pool_peak"] <= BUDGET_MB * MIB
        assert run["excess"] <= (BUDGET_MB + CONSTANT_MB) * MIB, run
    assert large["excess"] - small["excess"] <= 16 * MIB, "staging memory grew with the model"


def test_cpu_tier_would_hold_the_state_the_nvme_tier_streams(runs) -> None:
    nvme, cpu = runs["large"], runs["large_cpu"]
    state = 12 * nvme["params"]  # fp32 master, exp_avg, exp_avg_sq
    assert cpu["added_peak"] - nvme["added_peak"] >= state - BUDGET_MB * MIB - CONSTANT_MB * MIB
