"""``store.defer_commit``: a step's last writes, fsync and commit land during the next step's
forward. The store then trails the engine by one step until the next step reads its state
(or ``flush``/``save``/``close``), the results are the same bits, and a write that fails in
the background surfaces at the next step without touching the last commit."""

from __future__ import annotations

import errno

import pytest
import torch

from engine.engine import Engine
from offload.io import OffloadIOError
from offload.manifest import read_committed
from tests.engine.test_nvme_tier import FailingOps
from tests.engine.test_resume import nvme, params, run
from tests.training import batches, config, tiny_gpt


def committed_step(tmp_path) -> int:
    return read_committed(tmp_path / "store")["step"]


def test_the_commit_lands_when_the_next_step_first_reads_the_state(tmp_path) -> None:
    eng = Engine(tiny_gpt(), nvme(tmp_path), total_steps=6)
    run(eng, 2)
    assert committed_step(tmp_path) == 1, "step 2's commit waits for the next step"
    data = batches(4)
    loss = eng(*data.next())
    assert committed_step(tmp_path) == 1, "the forward runs beside step 2's write-back"
    eng.backward(loss)
    assert committed_step(tmp_path) == 2, "the backward reads step 2's state, so it commits it first"
    eng.step()
    eng.flush()
    assert committed_step(tmp_path) == 3
    run(eng, 1)
    eng.close()
    assert committed_step(tmp_path) == 4, "close commits the last step"


def test_without_deferral_every_step_is_committed_when_step_returns(tmp_path) -> None:
    eng = Engine(tiny_gpt(), nvme(tmp_path, store={"defer_commit": False}), total_steps=6)
    for step in (1, 2):
        run(eng, 1)
        assert committed_step(tmp_path) == step
    eng.close()


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # the default run keeps stage 3
def test_deferring_changes_no_bit(tmp_path, stage: int) -> None:
    results = {}
    for defer in (True, False):
        offload = {
            "optimizer": "nvme",
            "param": "nvme" if stage == 3 else "device",
            "nvme_path": str(tmp_path / f"{defer}"),
        }
        cfg = config(zero={"stage": stage}, offload=offload, store={"defer_commit": defer})
        eng = Engine(tiny_gpt(), cfg, total_steps=4)
        results[defer] = run(eng, 4), params(eng)
        eng.close()
    (deferred_losses, deferred), (losses, expected) = results[True], results[False]
    assert deferred_losses == losses
    assert all(torch.equal(deferred[k], expected[k]) for k in expected)


@pytest.mark.parametrize("mode", ["generations", "in-place"])
def test_a_background_write_failure_surfaces_at_the_next_step_and_keeps_the_last_commit(tmp_path, mode: str) -> None:
    cfg = nvme(tmp_path, store={"mode": mode})
    eng = Engine(tiny_gpt(), cfg, total_steps=6)
    run(eng, 1)
    eng.flush()
    at_step_1 = params(eng)
    checkpoint = None
    if mode == "in-place":  # a failed rewrite in place leaves the store dirty: resume from a checkpoint
        eng.save(checkpoint := "step-1")
    ops = FailingOps("write", errno.ENOSPC)
    eng.optimizer_state.store._ops = ops
    last = eng.step_control.update_order()[-1].name
    hand_on = eng.step_control.unit_work.hand_on

    def fail_the_last_writes(unit, state, spilled) -> None:  # only the step's final write-back fails
        hand_on(unit, state, spilled)
        ops.armed = unit.name == last

    eng.step_control.unit_work.hand_on = fail_the_last_writes  # type: ignore[method-assign]
    run(eng, 1)  # step 2 returns before its last writes land
    with pytest.raises(OffloadIOError, match=r"write gen-\d+/.*injected"):
        run(eng, 1)  # step 3 reads step 2's state: the failure surfaces before anything is read
    ops.armed = False
    assert committed_step(tmp_path) == 1
    eng.close()
    resumed = Engine.resume(tiny_gpt(), cfg, total_steps=6, checkpoint=checkpoint)
    assert resumed.global_step == 1
    got = params(resumed)
    assert all(torch.equal(got[k], at_step_1[k]) for k in at_step_1)
    run(resumed, 1)
    resumed.close()
