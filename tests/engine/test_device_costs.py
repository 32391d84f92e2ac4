"""What a step asks of a GPU, counted exactly on the simulated device (``benchmarks.device_costs``):
the waits that hold the thread launching kernels do not grow with the number of units (on
CUDA each such wait drains the compute queued before the copy it waits for, once per unit),
and parameters cross to the device in the compute dtype (a bf16 parameter filled from an fp32
master inside the copy moves 4 bytes, through a temporary on the device no budget counts)."""

from __future__ import annotations

import pytest

from benchmarks.device_costs import PLANS, QUICK_PLANS, plan_config, plan_label, step_costs

LAYERS = (2, 6)


def assert_waits_do_not_grow(plan: tuple[int, str, str], tmp_path, *, clip: bool = True, accumulate: int = 1) -> None:
    costs = {
        layers: step_costs(plan_config(plan, tmp_path / f"store-{layers}", clip=clip, accumulate=accumulate), layers)
        for layers in LAYERS
    }
    small, large = (costs[n] for n in LAYERS)
    assert large.syncs == small.syncs, (
        f"{plan_label(plan)}: host waits per step {small.host_syncs} at {LAYERS[0]} blocks, "
        f"{large.host_syncs} at {LAYERS[1]}"
    )
    assert large.syncs <= 1, f"{plan_label(plan)}: more than the step's one wait: {large.host_syncs}"


@pytest.mark.parametrize("plan", QUICK_PLANS, ids=plan_label)
def test_host_waits_per_step_do_not_grow_with_the_units(plan, tmp_path) -> None:
    assert_waits_do_not_grow(plan, tmp_path)


@pytest.mark.parametrize("plan", [(2, "cpu", "device"), (3, "cpu", "cpu")], ids=plan_label)
def test_nor_with_accumulation(plan, tmp_path) -> None:
    assert_waits_do_not_grow(plan, tmp_path, accumulate=2)


@pytest.mark.slow  # every plan, with clipping and without, and with accumulation: about a minute
@pytest.mark.parametrize("plan", PLANS, ids=plan_label)
def test_no_plan_waits_per_unit(plan, tmp_path) -> None:
    assert_waits_do_not_grow(plan, tmp_path / "clip")
    assert_waits_do_not_grow(plan, tmp_path / "no-clip", clip=False)
    assert_waits_do_not_grow(plan, tmp_path / "accumulate", accumulate=2)


@pytest.mark.parametrize("plan", [(1, "cpu", "device"), (2, "nvme", "device"), (3, "cpu", "device")], ids=plan_label)
def test_parameters_cross_in_the_compute_dtype(plan, tmp_path) -> None:
    """Stages 1-2 copy each unit's new shard up once a step: 2 bytes a parameter in bf16 (one
    rank); stage 3 with shards on the device rounds the masters on the host as well."""
    costs = step_costs(plan_config(plan, tmp_path / "store", clip=True, accumulate=1), LAYERS[0])
    assert costs.casts_in_copies == 0, f"{plan_label(plan)}: a copy to the device casts its source"
    if plan[0] < 3:
        assert costs.h2d_bytes == pytest.approx(2 * costs.params, rel=0.05), costs
