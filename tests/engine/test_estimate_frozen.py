"""The estimate of a run with frozen units (a fine-tune whose base is frozen, a few parameters
trained): the frozen base's bytes on its tier (host memory, the device, or disk), against real
training processes, and the plan that keeps a frozen base larger than memory on disk."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.tools.estimate import (
    Plan,
    estimate,
    estimate_plans,
    measured_baseline_bytes,
    plan_of,
    recommend,
    run_shape,
    scratch_bytes,
    store_bytes,
)
from tests.engine.frozen_probe import frozen_config, frozen_model
from tests.engine.test_estimate import TOLERANCE, UNDER_TOLERANCE, machine, probe, room_for

# The frozen base in host memory and on disk. Measured here (40M parameters, 99% frozen, bf16):
# 514 and 502 MiB peak RSS against 439 and 441 predicted; without the frozen units the estimate
# said 283 and 347. Stage 2 (replicated): 438 measured, 358 predicted, 282 without.
# Most of the gap is the probe's process starting about 50 MiB above the baseline the estimate
# is given (306 against 253 MiB).
RUNS = {
    "stage 3, optimizer cpu, param cpu": {"zero": {"stage": 3}, "offload": {"optimizer": "cpu", "param": "cpu"}},
    "stage 3, optimizer nvme, param nvme": {"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "param": "nvme"}},
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, tuple[int, int]]:
    """Each run's measured peak RSS and the bytes of its store on disk."""
    root = tmp_path_factory.mktemp("frozen-rss")
    results = {}
    for name, tiers in RUNS.items():
        folder = root / name.replace(", ", "-").replace(" ", "_")
        folder.mkdir()
        out = probe(["-m", "tests.engine.frozen_probe", json.dumps(tiers)], folder, root)
        on_disk = sum(f.stat().st_size for f in (folder / "store").rglob("*") if f.is_file())
        results[name] = (int(out.split()[-1]), on_disk)
    return results


@pytest.mark.slow  # a real run in a fresh process per plan: 10 s
@pytest.mark.parametrize("name", RUNS)
def test_predicted_peak_rss_of_a_frozen_base_is_within_tolerance(name: str, measured) -> None:
    peak, _ = measured[name]
    config = frozen_config(RUNS[name])
    run = run_shape(config, world_size=1, model=frozen_model(config)[0])
    assert run.layout.frozen_numel > 50 * run.layout.numel, "a large frozen fraction"
    assert run.layout.frozen_numel > 35e6, "the frozen base must dwarf the baseline for the comparison to mean anything"
    est = estimate(run, plan_of(config), baseline_bytes=measured_baseline_bytes())
    error = est.peak_rss_bytes / peak - 1
    assert -UNDER_TOLERANCE <= error <= TOLERANCE, (
        f"{name}: predicted {est.peak_rss_bytes / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB ({error:+.1%}); "
        f"terms in MiB: { {k: round(v / 2**20) for k, v in est.terms.items()} }"
    )


@pytest.mark.slow  # the real runs above
def test_predicted_store_of_a_frozen_base_is_the_store_on_disk(measured) -> None:
    name = "stage 3, optimizer nvme, param nvme"
    config = frozen_config(RUNS[name])
    run, plan = run_shape(config, world_size=1, model=frozen_model(config)[0]), plan_of(config)
    predicted = store_bytes(run, plan) - scratch_bytes(run, plan)  # the spilled gradients go at close
    on_disk = measured[name][1]
    # Besides the chunks' bytes, the files hold a 4-byte CRC per chunk and some JSON.
    assert predicted <= on_disk <= 1.01 * predicted


def test_a_frozen_base_larger_than_memory_is_kept_on_disk() -> None:
    """A 1B-parameter model, 1% of it trained: the plan that fits in less RAM than its frozen
    base puts the base on disk, and counts it there."""
    config = frozen_config(RUNS["stage 3, optimizer cpu, param cpu"])
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, params=1e9))
    run = run_shape(config, world_size=1, model=frozen_model(config)[0])
    base = run.dtype.itemsize * run.layout.frozen_numel  # in the compute dtype
    assert run.layout.frozen_numel > 50 * run.layout.numel
    plans = {e.plan: e for e in estimate_plans(run, baseline_bytes=0, device_is_host=True)}
    in_memory = plans[Plan(3, "cpu", "cpu")]
    assert in_memory.host_bytes > base, "the frozen base is counted on the parameter tier"
    on_disk = plans[Plan(3, "nvme", "nvme")]
    assert on_disk.disk_bytes > base and on_disk.peak_rss_bytes < base, "on disk, less memory than the base alone"
    ram = int(room_for(on_disk.peak_rss_bytes))
    choice = recommend(list(plans.values()), machine(ram), config)
    assert choice is not None and choice.plan.param == "nvme", "a frozen base larger than RAM goes to disk"
