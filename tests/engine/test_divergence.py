"""A step whose gradients or loss are not finite is never committed: it stops with
``DivergedError`` on every rank, naming the step, what was not finite, where the run can go
on and the fix. The store keeps its last good step, resumed bit-identically, unless in place
the step's updates were already written over it: then the store is dirty and refused."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from engine.run.models.gpt import GPT
from engine.run.train import train
from engine.tiers.store_checks import DirtyStoreError
from engine.zero.divergence import DivergedError, nonfinite_units
from offload.manifest import read_committed
from tests.engine.test_cli import run as run_cli
from tests.engine.test_in_place import same_params
from tests.engine.test_resume import nvme, params, run
from tests.ranks import run_ranks
from tests.training import config, tiny_gpt

GUARDS = {"clip": {"grad_clip": 1.0}, "overlap": {"grad_clip": 0.0}}
"""Clipping takes the global norm before any update; without it each unit is updated inside
backward, after its own gradient norm."""
POISONED_UNIT, POISONED = "blocks.1", "blocks.1.mlp.fc.weight"


def poison(eng: Engine) -> None:
    """Make every later gradient of one parameter infinite."""
    param = dict(eng.module.named_parameters())[POISONED]
    param.register_hook(lambda grad: torch.full_like(grad, float("inf")))


def committed_step(root: Path) -> int:
    return read_committed(root / "store")["step"]


@pytest.mark.parametrize(
    ("mode", "guard"),
    # each mode and each guard in the default run; the other two pairs are slow
    [("generations", "clip"), ("in-place", "overlap")]
    + [pytest.param(m, g, marks=pytest.mark.slow) for m, g in (("generations", "overlap"), ("in-place", "clip"))],
)
def test_a_diverged_step_is_never_committed(tmp_path, mode: str, guard: str) -> None:
    def cfg(name: str) -> Config:
        return nvme(tmp_path / name, store={"mode": mode}, optim=GUARDS[guard])

    straight = Engine(tiny_gpt(), cfg("straight"), total_steps=6)
    run(straight, 2)
    at_step_2 = params(straight)
    straight.close()

    eng = Engine(tiny_gpt(), cfg("run"), total_steps=6)
    run(eng, 2)
    dirtied = mode == "in-place" and guard == "overlap"  # the updates ran inside backward, over step 2
    if dirtied:
        eng.save("step-2")
    poison(eng)
    store = re.escape(str(tmp_path / "run" / "store"))
    if guard == "clip":
        what, fix = r"the gradient norm is inf", ""
    else:
        what, fix = (
            rf"the gradient norm is inf in unit '{POISONED_UNIT}' on rank 0",
            r" or enable optim.grad_clip \(e.g. 1.0\)",
        )
    if dirtied:
        where = (
            rf'its updates were already written over step 2 \(store.mode = "in-place"\), so store {store} is dirty and '
            rf"will not resume; resume from its last checkpoint, 'step-2': .*"
        )
    else:
        where = rf"store {store} still holds step 2, its last committed step, which a resume continues from"
    expected = rf"^step 3 diverged \({what}\) and was not committed: {where}; fix: lower optim.lr \(now 0.0003\){fix}$"
    with pytest.raises(DivergedError, match=expected):
        run(eng, 1)
    with pytest.raises(
        DivergedError, match=r"^this engine stopped at a diverged step and takes no further step: step 3"
    ):
        run(eng, 1)
    eng.close()  # as a user's `finally` would: it commits nothing of the diverged step
    assert committed_step(tmp_path / "run") == 2

    if dirtied:
        with pytest.raises(
            DirtyStoreError, match=r"is dirty: .* committed at step 2, .* resume from its last checkpoint, 'step-2'"
        ):
            Engine.resume(tiny_gpt(seed=99), cfg("run"), total_steps=6)
    resumed = Engine.resume(tiny_gpt(seed=99), cfg("run"), total_steps=6, checkpoint="step-2" if dirtied else None)
    assert resumed.global_step == 2
    assert same_params(params(resumed), at_step_2)
    resumed.close()


def test_the_message_names_three_units_and_counts_the_rest() -> None:
    per_rank = [
        [("blocks.0", float("nan")), ("blocks.1", float("inf"))],
        [("blocks.2", float("inf")), ("root", float("nan"))],
    ]
    assert nonfinite_units(per_rank) == (
        "the gradient norm is nan in unit 'blocks.0' on rank 0, inf in unit 'blocks.1' on rank 0, "
        "inf in unit 'blocks.2' on rank 1 and 1 more"
    )


def test_without_a_committed_step_the_message_names_the_checkpoint(tmp_path) -> None:
    eng = Engine(tiny_gpt(), config(offload={"optimizer": "cpu", "nvme_path": str(tmp_path / "store")}), total_steps=6)
    run(eng, 1)
    eng.save("step-1")  # written in the background, kept by close() although the next step diverges
    poison(eng)
    memory = r"the optimizer state is held in memory, so a run continues only from a checkpoint saved before this step"
    with pytest.raises(DivergedError, match=rf"^step 2 diverged \(.*\) and was not committed: {memory}"):
        run(eng, 1)
    eng.close()
    resumed = Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=6, checkpoint="step-1")  # the store holds only it
    poison(resumed)
    with pytest.raises(
        DivergedError,
        match=r"^step 2 diverged \(.*\) and was not committed: store .* has no committed step; resume from its last checkpoint, 'step-1'",
    ):
        run(resumed, 1)
    resumed.close()


def test_train_stops_at_a_non_finite_loss_before_its_step_commits(tmp_path, monkeypatch) -> None:
    forward, calls = GPT.forward, itertools.count(1)

    def nan_loss_at_step_3(self: GPT, *args, **kwargs) -> torch.Tensor:
        loss = forward(self, *args, **kwargs)
        return loss + float("nan") * loss.detach() if next(calls) == 3 else loss  # the gradients stay finite

    monkeypatch.setattr(GPT, "forward", nan_loss_at_step_3)
    cfg = Config.from_dict(
        {
            "model": {"preset": "tiny"},
            "data": {"seq_len": 32, "micro_batch": 2},
            "optim": {"grad_clip": 0.0},  # each unit is updated inside backward, before the loss is looked at
            "offload": {"nvme_path": str(tmp_path / "store")},
            "train": {"steps": 5},
        }
    )
    with pytest.raises(
        DivergedError, match=r"^step 3 diverged \(the loss is nan\) and was not committed: store .* still holds step 2,"
    ):
        train(cfg)
    assert committed_step(tmp_path) == 2, "train closes the engine without committing the diverged step"


def test_the_command_line_names_the_diverged_step_without_a_traceback(tmp_path) -> None:
    proc = run_cli(["--steps", "4", "--seq_len", "32", "--lr", "1e30"], tmp_path)  # the first step blows up the weights
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(
        r"ERROR engine: step 2 diverged \(the (loss|gradient norm) is (nan|inf)\) and was not committed: store .* still holds step 1,",
        proc.stderr,
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert read_committed(tmp_path / "offload_store")["step"] == 1


def poison_rank_1_shard(eng: Engine) -> None:
    """On this rank, make one gradient element infinite that the reduction puts in rank 1's
    shard of its unit: every other rank's shards stay finite."""
    unit = eng.layout.unit(POISONED_UNIT)
    index = unit.shard_numel  # the first element of rank 1's shard
    assert index < unit.numel, "rank 1's shard holds parameters"
    slot = next(s for s in unit.params if s.offset <= index < s.offset + s.numel)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[index - slot.offset] = float("inf")
        return grad

    dict(eng.module.named_parameters())[slot.name].register_hook(hook)


def diverge_on_rank_1(root: str, guard: str) -> tuple[str, int]:
    """Entry point for ``run_ranks``: two clean steps, then a third whose non-finite gradient
    only rank 1's shard holds; the error each rank raised, and the committed step."""
    eng = Engine(tiny_gpt(), nvme(Path(root), optim=GUARDS[guard]), total_steps=6)
    run(eng, 2)
    if eng.comm.rank == 0:
        poison_rank_1_shard(eng)
    message = "step 3 did not diverge"
    try:
        run(eng, 1)
    except DivergedError as err:
        message = str(err)
    finally:
        eng.close()
    return message, committed_step(Path(root))


@pytest.mark.parametrize("guard", [pytest.param("clip", marks=pytest.mark.slow), "overlap"])
def test_two_ranks_both_stop_when_one_shard_diverged(tmp_path, guard: str) -> None:
    ranks = run_ranks(2, diverge_on_rank_1, str(tmp_path), guard, timeout=120)
    (message, committed), (other_message, other_committed) = ranks
    assert message == other_message, "every rank names the same cause"
    what = "the gradient norm is inf" + (f" in unit '{POISONED_UNIT}' on rank 1" if guard == "overlap" else "")
    assert message.startswith(f"step 3 diverged ({what}) and was not committed: store ")
    assert "still holds step 2" in message
    assert committed == other_committed == 2
