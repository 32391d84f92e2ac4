"""The step cycle: every public call runs only in its phases, moves the engine on, and a call
out of order raises ``PhaseError`` naming the call, the phase and what comes first, leaving
the engine as it was. The loops users write (accumulation with or without a ``step()`` per
micro-batch, evaluation forwards, saves between steps, stage 3) run as before, bit for bit."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from engine.zero.divergence import DivergedError
from engine.zero.params import ShardedParams
from engine.zero.phase import PhaseError, StepPhase
from engine.zero.unit_params import UnitState, UnitStateError
from tests.engine.test_divergence import poison
from tests.engine.test_resume import nvme, params
from tests.training import batches, config, tiny_gpt, train_engine

IDLE, COMMIT_PENDING, FORWARD, ACCUMULATING, UPDATING, CLOSED = (
    StepPhase.IDLE,
    StepPhase.COMMIT_PENDING,
    StepPhase.FORWARD,
    StepPhase.ACCUMULATING,
    StepPhase.UPDATING,
    StepPhase.CLOSED,
)
Call = Callable[[Engine, Any], Any]
"""A call on an engine, given the batches it trains on."""


def micro_batch(eng: Engine, data: Any) -> torch.Tensor:
    """One micro-batch's forward and backward; its loss."""
    loss = eng(*data.next())
    eng.backward(loss)
    return loss


def forward(eng: Engine, data: Any) -> None:
    eng(*data.next())


def early_micro_batch(eng: Engine, data: Any) -> None:
    """A micro-batch before the step's last, with the ``step()`` that returns False after it."""
    micro_batch(eng, data)
    assert not eng.step()


def close(eng: Engine, data: Any) -> None:
    eng.close()


class Misuse(NamedTuple):
    accum: int
    """``zero.grad_accum_steps``."""
    before: list[Call]
    call: Call
    phase: StepPhase
    """The phase the call finds, and leaves."""
    first: str
    """What the error says to call first."""


MISUSES = {
    "step() with no forward": Misuse(1, [], lambda e, d: e.step(), IDLE, "eng(...)"),
    "step() before backward()": Misuse(1, [forward], lambda e, d: e.step(), FORWARD, "backward(loss)"),
    "step() before the last micro-batch's backward()": Misuse(
        2, [early_micro_batch, forward], lambda e, d: e.step(), FORWARD, "backward(loss)"
    ),
    "backward() without a forward": Misuse(
        1, [], lambda e, d: e.backward(torch.ones((), requires_grad=True)), IDLE, "eng(...)"
    ),
    "backward() twice for one forward": Misuse(1, [], lambda e, d: e.backward(micro_batch(e, d)), UPDATING, "step()"),
    "backward() twice for an early micro-batch": Misuse(
        2, [], lambda e, d: e.backward(micro_batch(e, d)), ACCUMULATING, "eng(...)"
    ),
    "save() between backward() and step()": Misuse(
        1, [micro_batch], lambda e, d: e.save("mid-step"), UPDATING, "step()"
    ),
    "a forward between backward() and step()": Misuse(1, [micro_batch], lambda e, d: e(*d.next()), UPDATING, "step()"),
    "gathered() between backward() and step()": Misuse(1, [micro_batch], lambda e, d: e.gathered(), UPDATING, "step()"),
    "zero_grad() between backward() and step()": Misuse(
        1, [micro_batch], lambda e, d: e.zero_grad(), UPDATING, "step()"
    ),
    "abandon_step() before backward()": Misuse(
        1, [forward], lambda e, d: e.abandon_step("the loss is nan"), FORWARD, "backward(loss)"
    ),
    "a forward after close()": Misuse(1, [close], lambda e, d: e(*d.next()), CLOSED, "build a new Engine"),
    "step() after close()": Misuse(1, [close], lambda e, d: e.step(), CLOSED, "build a new Engine"),
    "save() after close()": Misuse(1, [close], lambda e, d: e.save("late"), CLOSED, "build a new Engine"),
    "flush() after close()": Misuse(1, [close], lambda e, d: e.flush(), CLOSED, "build a new Engine"),
    "gathered() after close()": Misuse(1, [close], lambda e, d: e.gathered(), CLOSED, "build a new Engine"),
}


def engine_config(tmp_path, tier: str, **sections: dict) -> Config:
    """The test config with the optimizer state on ``tier``."""
    return config(offload={"optimizer": tier, "nvme_path": str(tmp_path / "store")}, **sections)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name", list(MISUSES))
def test_a_call_out_of_order_is_refused_naming_the_phase_and_what_comes_first(tmp_path, name: str, tier: str) -> None:
    misuse = MISUSES[name]
    eng = Engine(tiny_gpt(), engine_config(tmp_path, tier, zero={"grad_accum_steps": misuse.accum}), total_steps=4)
    data = batches(4)
    for call in misuse.before:
        call(eng, data)
    with pytest.raises(
        PhaseError, match=rf"^Engine\.\S+ .*cannot run in phase {misuse.phase.name} \(.*\): .*{re.escape(misuse.first)}"
    ) as refused:
        misuse.call(eng, data)
    assert refused.value.phase is misuse.phase and eng.phase is misuse.phase, "a refused call changes nothing"
    eng.close()


def test_the_error_says_it_in_one_line() -> None:
    eng = Engine(tiny_gpt(), config(), total_steps=2)
    eng(*batches(4).next())
    with pytest.raises(PhaseError) as refused:
        eng.step()
    assert str(refused.value) == (
        "Engine.step() cannot run in phase FORWARD (a forward ran and its loss awaits backward): call backward(loss) first"
    )
    assert isinstance(refused.value, RuntimeError)
    eng.close()


def test_after_a_refused_call_the_step_goes_on_as_if_it_never_came() -> None:
    cfg = config(zero={"grad_accum_steps": 2})
    expected = train_engine(cfg, 2)
    eng = Engine(tiny_gpt(), cfg, total_steps=2)
    data = batches(4)
    for _ in range(2):
        with pytest.raises(PhaseError):
            eng.step()  # no forward yet
        loss = eng(*data.next())
        with pytest.raises(PhaseError):
            eng.step()  # before its backward
        eng.backward(loss)
        with pytest.raises(PhaseError):
            eng.backward(loss)  # again
        assert not eng.step()
        eng.backward(eng(*data.next()))
        with pytest.raises(PhaseError):
            eng.save("mid-step")
        assert eng.step()
    got = params(eng)
    assert all(torch.equal(got[k], expected["params"][k]) for k in got)
    eng.close()


def test_the_phases_of_an_accumulating_loop_with_deferred_commits(tmp_path) -> None:
    eng = Engine(tiny_gpt(), engine_config(tmp_path, "nvme", zero={"grad_accum_steps": 2}), total_steps=4)
    data = batches(4)
    seen = [eng.phase]
    for _ in range(2):
        for _ in range(2):
            loss = eng(*data.next())
            seen.append(eng.phase)
            eng.backward(loss)
            seen.append(eng.phase)
            eng.step()  # after every micro-batch: False until the last
            seen.append(eng.phase)
    eng.flush()
    seen.append(eng.phase)
    step = [FORWARD, ACCUMULATING, ACCUMULATING, FORWARD, UPDATING, COMMIT_PENDING]
    assert seen == [IDLE, *step, *step, IDLE]
    eng.close()
    assert eng.phase is CLOSED


def test_without_deferral_and_on_the_memory_tiers_a_step_ends_idle(tmp_path) -> None:
    for cfg in (nvme(tmp_path / "a", store={"defer_commit": False}), config()):
        eng = Engine(tiny_gpt(), cfg, total_steps=2)
        data = batches(4)
        micro_batch(eng, data)
        assert eng.step() and eng.phase is IDLE
        eng.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_evaluation_forwards_saves_and_zero_grad_between_the_calls_change_no_bit(tmp_path, stage: int) -> None:
    """A loop as users write it: a ``step()`` only after the last micro-batch (as ``python -m
    engine train``), evaluation forwards between steps and between micro-batches, under
    ``no_grad`` and in ``gathered``, a loss never sent backward, ``zero_grad`` between a step's
    first forward and its backward, and saves between micro-batches and between steps."""
    offload = {"optimizer": "nvme", "param": "nvme" if stage == 3 else "device", "nvme_path": str(tmp_path / "store")}
    expected = train_engine(config(zero={"stage": stage, "grad_accum_steps": 2}), 3)
    eng = Engine(tiny_gpt(), config(zero={"stage": stage, "grad_accum_steps": 2}, offload=offload), total_steps=3)
    data, held_out = batches(4), batches(4).next()
    losses = []
    for _ in range(3):
        with torch.no_grad():
            eng(*held_out)
        first = eng(*data.next())
        eng.zero_grad()
        eng.backward(first)
        with eng.gathered(), torch.no_grad():
            eng(*held_out)
        eng.save(f"step-{eng.global_step}")  # the last step, committed now if deferred
        eng(*held_out)
        second = eng(*data.next())
        eng.backward(second)
        assert eng.step()
        losses.append((first.item() + second.item()) / 2)
    eng.save("last")
    assert losses == expected["losses"]
    got = params(eng)
    assert all(torch.equal(got[k], expected["params"][k]) for k in got)
    eng.close()


def test_zero_grad_discards_an_accumulating_step() -> None:
    eng = Engine(tiny_gpt(), config(zero={"grad_accum_steps": 2}), total_steps=2)
    data = batches(4)
    micro_batch(eng, data)
    eng.zero_grad()
    assert eng.phase is IDLE
    micro_batch(eng, data)
    assert not eng.step(), "the window starts again: this is its first micro-batch"
    eng.close()


def test_a_loss_without_a_graph_is_refused_before_anything_changes() -> None:
    eng = Engine(tiny_gpt(), config(), total_steps=2)
    data = batches(4)
    with torch.no_grad():
        loss = eng(*data.next())
    with pytest.raises(ValueError, match=r"the loss has no autograd graph .*torch\.no_grad"):
        eng.backward(loss)
    assert eng.phase is FORWARD
    micro_batch(eng, data)
    assert eng.step()
    eng.close()


def test_a_diverged_engine_refuses_everything_but_reading_and_closing() -> None:
    eng = Engine(tiny_gpt(), config(), total_steps=4)
    data = batches(4)
    poison(eng)
    micro_batch(eng, data)
    with pytest.raises(DivergedError, match=r"^step 1 diverged"):
        eng.step()
    assert eng.phase is StepPhase.DIVERGED
    for call in (lambda: eng(*data.next()), eng.step, eng.zero_grad, lambda: eng.save("x")):
        with pytest.raises(
            DivergedError, match=r"^this engine stopped at a diverged step and takes no further step: step 1"
        ):
            call()
    with eng.gathered():
        pass
    eng.flush()
    eng.close()


def test_abandon_step_ends_the_engine_diverged() -> None:
    eng = Engine(tiny_gpt(), config(), total_steps=4)
    micro_batch(eng, batches(4))
    with pytest.raises(DivergedError, match=r"^step 1 diverged \(the loss is nan\)"):
        eng.abandon_step("the loss is nan")
    assert eng.phase is StepPhase.DIVERGED
    eng.close()


class Injected(Exception):
    """A failure in the middle of a step (an I/O error, an interrupt)."""


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_step_that_fails_part_way_is_lost_and_only_close_follows(tmp_path, tier: str) -> None:
    eng = Engine(tiny_gpt(), engine_config(tmp_path, tier), total_steps=4)
    data = batches(4)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise Injected("in the middle of backward")

    handle = eng.module.blocks[0].mlp.fc.weight.register_hook(fail)
    with pytest.raises(Injected):
        micro_batch(eng, data)
    handle.remove()
    assert eng.phase is StepPhase.FAILED
    for call in (lambda: eng(*data.next()), eng.step, eng.zero_grad):
        with pytest.raises(PhaseError, match=r"cannot run in phase FAILED \(.*\): close\(\) it, then resume"):
            call()
    if tier == "cpu":  # the state in memory may be half updated
        with pytest.raises(PhaseError, match="phase FAILED"):
            eng.save("after-failure")
    else:  # the store keeps its last commit, which the lost step never changed
        eng.save("after-failure")
    eng.close()


def test_close_twice_does_nothing_the_second_time() -> None:
    eng = Engine(tiny_gpt(), config(), total_steps=2)
    eng.close()
    eng.close()
    assert eng.phase is StepPhase.CLOSED


def test_a_stage_3_unit_refuses_a_transition_its_state_does_not_lead_to() -> None:
    eng = Engine(tiny_gpt(), config(zero={"stage": 3}), total_steps=2)
    sharded, name = eng.params, "blocks.0"
    assert isinstance(sharded, ShardedParams)
    unit = sharded.unit(name)
    refused = r"^unit 'blocks\.0' cannot become GATHERED from SHARDED: only from GATHERING$"
    with pytest.raises(UnitStateError, match=refused), unit.becoming(UnitState.GATHERED):
        pytest.fail("the transition's work runs only from a state that leads to it")
    sharded.gather(name)
    used = eng.budget.used
    with pytest.raises(
        UnitStateError, match=r"^unit 'blocks\.0' cannot become GATHERING from GATHERED: only from COPYING or SHARDED$"
    ):
        unit.start_gather()  # a second gather of a gathered unit
    with pytest.raises(
        UnitStateError, match=r"^unit 'blocks\.0' cannot become FETCHING from GATHERED: only from SHARDED$"
    ):
        unit.start_fetch()
    assert unit.state is UnitState.GATHERED and eng.budget.used == used, "a refused transition does none of its work"
    sharded.release(name)
    assert unit.state is UnitState.SHARDED and eng.budget.used == used - unit.nbytes
    micro_batch(eng, batches(4))
    assert eng.step()
    eng.close()
