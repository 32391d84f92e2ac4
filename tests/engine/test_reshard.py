"""Resuming a store on another world size: the new ranks read bit for bit what the old ones
committed, the store becomes an ordinary store of the new world size, and training goes on
as if the world size had never changed."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zarr

from engine.config import Config
from engine.engine import Engine
from engine.state.forms import STATE_KINDS
from engine.state.partition import ModelLayout
from offload.manifest import read_committed
from tests.ranks import run_ranks
from tests.training import batches, config, rel_diff, tiny_gpt, train_reference

STEPS = 6
GLOBAL_BATCH = 6  # rows per step over all ranks: divides among 1, 2 and 3 ranks


def nvme(store: Path) -> Config:
    return config(offload={"optimizer": "nvme", "nvme_path": str(store)})


def snapshot(eng: Engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in eng.module.named_parameters()}


def train(store: Path, steps: int, resume: bool) -> dict[str, torch.Tensor]:
    """On this process's rank: ``steps`` steps of ``GLOBAL_BATCH`` rows split over the ranks,
    from scratch or resumed from ``store``; returns the parameters after them."""
    eng = Engine(tiny_gpt(seed=99 if resume else 0), nvme(store), total_steps=STEPS, resume=resume)
    world_size = eng.comm.world_size
    data = batches(GLOBAL_BATCH // world_size, eng.comm.rank, world_size)
    if resume:
        data.load_state_dict(eng.client_state["data"])
    for _ in range(steps):
        loss = eng(*data.next())
        eng.backward(loss)
        eng.client_state = {"data": data.state_dict()}
        eng.step()
    params = snapshot(eng)
    eng.close()
    return params


def recommit(store: Path) -> dict[str, torch.Tensor]:
    """Resume, then commit the optimizer state as read, without a step: the new generation
    holds exactly what this world size read, cut for its own shards. Returns the parameters
    the resume restored."""
    eng = Engine(tiny_gpt(seed=99), nvme(store), total_steps=STEPS, resume=True)
    restored = snapshot(eng)
    state = eng.optimizer_state
    for unit, shard in state.read(eng.layout.units):
        state.write_back(unit, shard)
    state.commit(state.resumed_from)
    eng.close()
    return restored


def run_tasks(tasks: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """On this rank, each ``fn(*args)`` of ``tasks`` in order, their engines all joining one
    process group (as several engines in one launched job do)."""
    dist.init_process_group("gloo")
    try:
        return [fn(*args) for fn, args in tasks]
    finally:
        dist.destroy_process_group()


def on_ranks(world_size: int, tasks: list[tuple[Callable[..., Any], tuple]]) -> list[list[Any]]:
    """``tasks`` on each of ``world_size`` ranks, results by rank then task; one rank runs here."""
    if world_size == 1:
        return [[fn(*args) for fn, args in tasks]]
    return run_ranks(world_size, run_tasks, tasks)


def stored_state(store: Path, generation: int) -> tuple[ModelLayout, dict[str, bytes]]:
    """Through zarr, as any reader would: the layout the store records and the bytes of each
    unit's state in ``generation`` (its first ``numel`` elements), once its arrays are checked
    to be cut as that layout says, with zero padding."""
    group = zarr.open_group(store, mode="r")
    layout = ModelLayout.from_dict(group.attrs["layout"])
    state = {}
    for unit in layout.units:
        for kind in STATE_KINDS:
            array = group[f"gen-{generation}/{unit.name}/{kind}"]
            assert (array.shape, array.chunks) == ((unit.padded_numel,), (unit.chunk_numel,)), array.path
            values = array[:]
            assert not values[unit.numel :].any(), f"{array.path}: nonzero padding"
            state[array.path.split("/", 1)[1]] = values[: unit.numel].tobytes()
    return layout, state


def committed_state(store: Path) -> tuple[ModelLayout, dict[str, bytes]]:
    return stored_state(store, read_committed(store)["generation"])


@dataclass
class Outcome:
    """One resume from ``before`` ranks onto ``after``."""

    first: dict[str, torch.Tensor]  # the parameters after the steps on ``before`` ranks
    committed: tuple[ModelLayout, dict[str, bytes]]  # the state those steps committed
    restored: list[dict[str, torch.Tensor]]  # the parameters each new rank restored
    recommitted: tuple[ModelLayout, dict[str, bytes]]  # the state the new ranks read, as they committed it
    final: list[dict[str, torch.Tensor]]  # each new rank's parameters after the resumed steps
    store: Path  # the store those steps left


SCENARIOS = [(2, 1), (1, 2), (2, 3)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], Outcome]:
    """Every resume of ``SCENARIOS``. Spawning ranks costs seconds, so the ranks of each world
    size are spawned once and do all of its work in turn. Each resume starts from two copies
    of the source store, one to recommit and one to train on; the source stays as committed."""
    root = tmp_path_factory.mktemp("reshard")
    sources = {before: root / f"steps-on-{before}" for before in (1, 2)}

    def resume(before: int, after: int) -> list[tuple[Callable[..., Any], tuple]]:
        check, store = root / f"{before}-to-{after}-check", root / f"{before}-to-{after}"
        shutil.copytree(sources[before], check)
        shutil.copytree(sources[before], store)
        return [(recommit, (check,)), (train, (store, 3, True))]

    def outcome(before: int, after: int, first: dict[str, torch.Tensor], ranks: list[list[Any]]) -> Outcome:
        """From each new rank's results of ``resume(before, after)``, the last two tasks it ran."""
        return Outcome(
            first=first,
            committed=committed_state(sources[before]),
            restored=[results[-2] for results in ranks],
            recommitted=committed_state(root / f"{before}-to-{after}-check"),
            final=[results[-1] for results in ranks],
            store=root / f"{before}-to-{after}",
        )

    [[first_on_one]] = on_ranks(1, [(train, (sources[1], 3, False))])
    on_two = on_ranks(2, [(train, (sources[2], 3, False)), *resume(1, 2)])
    first_on_two = on_two[0][0]
    return {
        (1, 2): outcome(1, 2, first_on_one, on_two),
        (2, 1): outcome(2, 1, first_on_two, on_ranks(1, resume(2, 1))),
        (2, 3): outcome(2, 3, first_on_two, on_ranks(3, resume(2, 3))),
    }


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """The parameters after ``STEPS`` steps of plain PyTorch on the same global batches."""
    return train_reference(config(), STEPS, micro_batch=GLOBAL_BATCH)["params"]


@pytest.mark.parametrize(("before", "after"), SCENARIOS)
def test_new_ranks_read_exactly_what_the_old_ones_committed(outcomes, before: int, after: int) -> None:
    run = outcomes[before, after]
    (old_layout, committed), (new_layout, read) = run.committed, run.recommitted
    assert (old_layout.world_size, new_layout.world_size) == (before, after)
    for restored in run.restored:
        differing = [name for name in run.first if not torch.equal(restored[name], run.first[name])]
        assert not differing, f"restored parameters differ: {differing}"
    assert read.keys() == committed.keys()
    differing = [name for name in committed if read[name] != committed[name]]
    assert not differing, f"master or moments differ: {differing}"


@pytest.mark.parametrize(("before", "after"), SCENARIOS)
def test_training_goes_on_as_if_the_world_size_never_changed(outcomes, reference, before: int, after: int) -> None:
    run = outcomes[before, after]
    for params in run.final:
        assert rel_diff(params, reference) <= 1e-6
    # An ordinary store of the new world size: its attributes and both generations are cut for it.
    on_disk = [int(path.name.removeprefix("gen-")) for path in run.store.glob("gen-*")]
    assert len(on_disk) == 2
    assert all(stored_state(run.store, generation)[0].world_size == after for generation in on_disk)
