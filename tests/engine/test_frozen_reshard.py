"""Frozen parameters across a change of world size: a store (or a memory tier's checkpoint)
written by 2 ranks resumes on 1 and back on 2, and one written by 1 rank on 2 and back on 1.
Each resume restores every parameter bit for bit as the last run left it, frozen ones included,
even though the frozen values stay cut for the world size that first wrote them; the frozen
values never change; and training goes on as the uninterrupted run (to rounding: the
gradients are summed over another number of ranks)."""

from __future__ import annotations

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from tests.engine.test_frozen import frozen_gpt, frozen_names, run_engine, train_reference
from tests.engine.test_reshard import on_ranks
from tests.training import _snapshot, config, rel_diff

STEPS = 4
GLOBAL_BATCH = 4  # rows per step over all ranks: divides among 1 and 2 ranks
LEGS = (2, 1, 1)  # steps of the first run, then of each resumed one


def tier_config(tier: str, store: str) -> Config:
    offload = {"optimizer": tier, "param": tier, "nvme_path": store}
    return config(zero={"stage": 3, "prefetch_mb": 1}, offload=offload)


def leg(cfg: Config, first_step: int, steps: int) -> tuple[dict, dict]:
    """On this rank: ``steps`` steps from step ``first_step``, afresh at step 0, else resumed
    from the store (the memory tiers: from the checkpoint the last leg saved). Returns the
    parameters as built or restored, and after the steps."""
    if first_step:
        tag = None if cfg.offload.optimizer == "nvme" else f"step-{first_step}"
        eng = Engine.resume(frozen_gpt(seed=1), cfg, total_steps=STEPS, checkpoint=tag)  # values from the store
    else:
        eng = Engine(frozen_gpt(), cfg, total_steps=STEPS)
    with eng.gathered():
        restored = _snapshot(eng.module)
    after = run_engine(eng, steps, GLOBAL_BATCH // eng.comm.world_size, skip=first_step)
    if cfg.offload.optimizer != "nvme":
        eng.save(f"step-{first_step + steps}")
    eng.close()
    return restored, after["params"]


@pytest.mark.parametrize("tier", ["nvme", pytest.param("cpu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("sizes", [pytest.param((2, 1, 2), marks=pytest.mark.slow), (1, 2, 1)], ids=["2-1-2", "1-2-1"])
def test_resumes_on_other_world_sizes_restore_frozen_values_bit_for_bit(tier, sizes, tmp_path) -> None:
    cfg = tier_config(tier, str(tmp_path / "store"))
    left, step = None, 0
    for world_size, steps in zip(sizes, LEGS, strict=True):
        results = [result for [result] in on_ranks(world_size, [(leg, (cfg, step, steps))])]
        for restored, _ in results:
            if left is not None:  # bit for bit what the last leg's ranks left, whatever their number
                differing = [name for name in left if not torch.equal(restored[name], left[name])]
                assert not differing, f"{sizes}, leg at step {step}: restored values differ: {differing[:3]}"
        left = results[0][1]
        assert all(torch.equal(after[name], left[name]) for _, after in results for name in left), "ranks agree"
        step += steps
    initial = _snapshot(frozen_gpt())
    names = frozen_names(frozen_gpt())
    assert all(torch.equal(left[name], initial[name]) for name in names), "a frozen value changed"
    reference = train_reference(cfg, steps=STEPS, micro_batch=GLOBAL_BATCH)["params"]
    assert rel_diff(left, reference) <= 1e-6
    assert not torch.equal(left["head.weight"], initial["head.weight"])
