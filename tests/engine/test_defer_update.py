"""``optim.defer_update``: after clipping, each unit of a step is updated in the next forward,
just before it runs, and goes up to the device from its new master; its gradient comes back
from the spill (optimizer on nvme) or waits in memory (on the host). A forward that ran a unit
before its update would compute with the values of the step before, which the comparison with
torch AdamW + ``clip_grad_norm_`` catches (``test_a_forward_ahead_of_the_update_is_caught``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ConfigError
from engine.engine import Engine
from engine.runtime.device import SIM_ENV
from engine.zero.params import ShardedParams
from engine.zero.phase import StepPhase
from engine.zero.step import UnitWork
from tests.ranks import run_ranks
from tests.training import _snapshot, batches, config, rel_diff, tiny_gpt, train_reference

STEPS = 3


def deferred(tmp_path: Path, param: str = "cpu", optimizer: str = "nvme", **sections):
    optim = {"grad_clip": 0.05, "defer_update": True} | sections.pop("optim", {})
    return config(
        zero={"stage": 3} | sections.pop("zero", {}),
        offload={"optimizer": optimizer, "param": param, "nvme_path": str(tmp_path / "store")},
        optim=optim,
        **sections,
    )


def train(cfg, steps: int = STEPS, resume: bool = False, close: bool = True, micro_batch: int = 4) -> dict:
    """Train with nothing between the steps that would finish a deferred update (no
    ``gathered``); which units each forward and each ``step()`` updated, the losses, and the
    parameters at the end."""
    eng = (Engine.resume if resume else Engine)(tiny_gpt(), cfg, total_steps=STEPS)
    data = batches(micro_batch, eng.comm.rank, eng.comm.world_size)
    for _ in range(eng.global_step):
        for _ in range(cfg.zero.grad_accum_steps):
            data.next()
    updated: list[tuple[str, str]] = []
    write_back, doing = eng.params.write_back, ["build"]
    eng.params.write_back = lambda unit, master: updated.append((doing[0], unit.name)) or write_back(unit, master)
    losses, phases = [], []
    for _ in range(steps):
        loss = 0.0
        for _ in range(cfg.zero.grad_accum_steps):
            doing[0] = "forward"
            micro = eng(*data.next())
            doing[0] = "backward"
            eng.backward(micro)
            doing[0] = "step"
            eng.step()
            loss += micro.item() / cfg.zero.grad_accum_steps
        losses.append(loss)
        phases.append(eng.phase)
    doing[0] = "end"
    with eng.gathered():
        params = _snapshot(eng.module)
    if close:
        eng.close()
    return {"losses": losses, "params": params, "updated": updated, "phases": phases, "engine": eng}


def train_on_ranks(cfg) -> dict:
    result = train(cfg, micro_batch=2)  # 4 a step over both ranks
    return {"params": result["params"], "losses": result["losses"]}


@pytest.mark.parametrize("param", ["cpu", "device", "nvme"])
@pytest.mark.parametrize("optimizer", ["nvme", "cpu", "device"])
def test_deferred_updates_run_in_the_next_forward_and_equal_torch(optimizer: str, param: str, tmp_path) -> None:
    cfg = deferred(tmp_path, param, optimizer)
    ours, ref = train(cfg), train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])
    trained = len(ours["engine"].layout.units)
    when = [doing for doing, _ in ours["updated"]]
    assert "step" not in when, "step() leaves every unit to the next forward"
    assert when == ["forward"] * trained * (STEPS - 1) + ["end"] * trained
    assert ours["phases"] == [StepPhase.COMMIT_PENDING] * STEPS


def test_bf16_masters_read_as_parameters_equal_the_update_after_backward(tmp_path) -> None:
    """Where the shards are the bf16 masters themselves, the deferred update gives each unit's
    forward the master it just computed, bit for bit what the update after backward stores."""
    bf16 = {"precision": {"compute_dtype": "bf16"}}
    ours = train(deferred(tmp_path / "deferred", "nvme", optim={"master_dtype": "bf16"}, **bf16))
    eager = train(deferred(tmp_path / "eager", "nvme", optim={"master_dtype": "bf16", "defer_update": False}, **bf16))
    assert ours["losses"] == eager["losses"]
    assert all(torch.equal(ours["params"][k], eager["params"][k]) for k in eager["params"])
    assert {doing for doing, _ in eager["updated"]} == {"step"}


@pytest.mark.parametrize("optimizer", ["nvme", "cpu"])
def test_accumulated_micro_batches_update_in_the_first_forward(optimizer: str, tmp_path) -> None:
    """The first micro-batch's backward finishes the update before it adds to any gradient
    shard: one held in memory for the update is not summed into the next step's."""
    cfg = deferred(tmp_path, "nvme", optimizer, zero={"grad_accum_steps": 2})
    ours, ref = train(cfg), train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert rel_diff(ours["params"], ref["params"]) <= 1e-6


def test_gradients_in_memory_wait_for_their_update_past_zero_grad(tmp_path) -> None:
    """With the optimizer on the host the gradient shards stay in memory after ``step()`` for
    the next forward's updates, through a ``zero_grad()`` (the plain loop's first call), and
    each is freed by its unit's update: none is left once the forward has run."""
    cfg = deferred(tmp_path, "cpu", "cpu")
    eng, data = Engine(tiny_gpt(), cfg, total_steps=STEPS), batches(4)
    losses = []
    for _ in range(STEPS):
        eng.zero_grad()
        loss = eng(*data.next())
        assert not eng.grads.shards, "every unit was updated before it ran, and its shard freed"
        eng.backward(loss)
        eng.step()
        assert set(eng.grads.shards) == {unit.name for unit in eng.layout.units}
        losses.append(loss.item())
    with eng.gathered():
        params = _snapshot(eng.module)
    assert not eng.grads.shards
    eng.close()
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert losses == ref["losses"]
    assert all(torch.equal(params[k], ref["params"][k]) for k in ref["params"])


def test_a_forward_ahead_of_the_update_is_caught(tmp_path, monkeypatch) -> None:
    """The comparison above, shown able to fail: with the forward's gathers not driving the
    update, each forward runs on the values of the step before (the backward then updates)."""
    monkeypatch.setattr(ShardedParams, "update_in_forward", lambda self, units, until: None)
    cfg = deferred(tmp_path)
    ours, ref = train(cfg), train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"][1:] != pytest.approx(ref["losses"][1:], rel=1e-4)


def test_close_commits_the_deferred_step_and_a_resume_goes_on_from_it(tmp_path) -> None:
    cfg = deferred(tmp_path, "nvme")
    first = train(cfg, steps=2, close=False)
    eng = first["engine"]
    assert eng.optimizer_state.commit_pending, "the last step is not committed before its update is done"
    eng.close()
    resumed, ref = train(cfg, steps=STEPS - 2, resume=True), train_reference(cfg, STEPS, micro_batch=4)
    assert first["losses"] + resumed["losses"] == ref["losses"]
    assert all(torch.equal(resumed["params"][k], ref["params"][k]) for k in ref["params"])


def test_an_update_failing_in_the_forward_loses_only_its_step(tmp_path, monkeypatch) -> None:
    """A unit's update that raises inside the next forward raises there, as it was raised; the
    step is lost (FAILED) and never committed: a resume starts from the step before."""
    compute, updated = UnitWork.compute, []

    def failing(self, unit, state, grad) -> None:
        if updated:
            raise OSError(f"the update of unit {unit.name!r} failed")
        updated.append(unit.name)
        compute(self, unit, state, grad)

    cfg = deferred(tmp_path, "nvme")
    eng, data = Engine(tiny_gpt(), cfg, total_steps=STEPS), batches(4)
    eng.backward(eng(*data.next()))
    eng.step()
    monkeypatch.setattr(UnitWork, "compute", failing)
    with pytest.raises(OSError, match=r"the update of unit .* failed"):
        eng(*data.next())
    assert eng.phase is StepPhase.FAILED
    eng.close()
    monkeypatch.undo()
    resumed = Engine.resume(tiny_gpt(), cfg, total_steps=STEPS)
    assert resumed.global_step == 0
    resumed.close()


@pytest.mark.parametrize(
    ("sim", "optimizer"),
    [
        (False, "cpu"),
        pytest.param(False, "nvme", marks=pytest.mark.slow),
        pytest.param(True, "cpu", marks=pytest.mark.slow),
        (True, "nvme"),
    ],
    ids=["cpu-cpu", "cpu-nvme", "late-copies-cpu", "late-copies-nvme"],
)
def test_two_ranks_update_in_the_same_order(sim: bool, optimizer: str, tmp_path, monkeypatch) -> None:
    """Each rank's gathers drive its update in the same order, so the gathers of the units
    handed on meet on every rank, with copies done at once (the CPU) or landing late (a
    gradient held in memory then read by the host worker only once its copy has landed)."""
    if sim:
        monkeypatch.setenv(SIM_ENV, "seed=6,delay_ms=1")  # the ranks inherit it
    cfg = deferred(tmp_path, "nvme", optimizer)
    ranks = run_ranks(2, train_on_ranks, cfg)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert all(rel_diff(result["params"], ref["params"]) <= 1e-6 for result in ranks)


@pytest.mark.parametrize(
    "sections",
    [{"zero": {"stage": 2}}, {"optim": {"grad_clip": 0.0}}],
    ids=["stage-2", "no-clipping"],
)
def test_a_deferred_update_where_it_cannot_be_is_refused(sections: dict, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"optim\.defer_update = True: .*zero\.stage = 3"):
        deferred(tmp_path, "device", **sections).validate()
