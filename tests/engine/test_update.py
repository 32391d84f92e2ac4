"""``Update`` on its own: each unit is updated once, in the order given, as soon as it and
every unit before it are ready; the rest at ``apply_remaining``; none after ``abandon``. With
the host worker an update started at one ``ready`` is handed on (written back, its master
handed to the parameters) at the next call, on the calling thread."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from engine.config import overlaps_backward
from engine.runtime.host_worker import WORKER_THREAD, HostWorker
from engine.state.forms import ShardState
from engine.state.partition import ROOT_UNIT, ModelLayout, UnitLayout, build_layout
from engine.tiers.optimizer import MemoryOptimizerState
from engine.zero.grads import PendingShard
from engine.zero.update import Update, update_order
from tests.training import config


def layout_of(*names: str) -> ModelLayout:
    units = {name: [("w", nn.Parameter(torch.empty(4, device="meta")))] for name in names}
    return build_layout(units, world_size=1, max_chunk_numel=2048)


class Recorded(MemoryOptimizerState):
    """A memory tier that records what was written back."""

    def __init__(self, layout: ModelLayout):
        super().__init__(torch.device("cpu"), checkpoints=lambda create: pytest.fail("no checkpoint"))
        self.written: list[str] = []
        for index, unit in enumerate(layout.units):
            self.add(unit, torch.full((unit.shard_numel,), float(index)))

    def write_back(self, unit: UnitLayout, state: ShardState) -> None:
        self.written.append(unit.name)


class Recorder:
    """A ``UnitUpdate`` that adds 10 to each master and records which thread did what."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        self.handed_on: list[str] = []
        self.threads: set[str] = set()

    def take_grad(self, unit: UnitLayout) -> PendingShard:
        return PendingShard(torch.zeros(unit.shard_numel))

    def compute(self, unit: UnitLayout, state: ShardState, grad: torch.Tensor) -> None:
        self.threads.add(threading.current_thread().name)
        self.applied.append(unit.name)
        state.master.add_(10)

    def hand_on(self, unit: UnitLayout, state: ShardState, spilled: bool) -> None:
        assert threading.current_thread() is threading.main_thread(), "handed on on the calling thread"
        self.handed_on.append(unit.name)


@pytest.fixture(params=[False, True], ids=["inline", "worker"])
def worker(request):
    host_worker = HostWorker() if request.param else None
    yield host_worker
    if host_worker is not None:
        host_worker.close()


def opened(names: tuple[str, ...], order: list[str], worker: HostWorker | None):
    layout = layout_of(*names)
    tier = Recorded(layout)
    recorder = Recorder()
    update = Update([layout.unit(n) for n in order], tier, recorder, worker)
    return layout, tier, update, recorder


def test_a_unit_waits_for_the_units_due_before_it(worker) -> None:
    _, tier, update, recorder = opened(("a", "b", "c"), ["c", "b", "a"], worker)
    update.ready("b")
    assert recorder.applied == []
    update.ready("c")
    assert tier.written == ([] if worker else ["c", "b"]), "the worker's updates are handed on at the next call"
    update.ready("a")
    assert tier.written == ["c", "b"] + ([] if worker else ["a"])
    update.apply_remaining()
    assert recorder.applied == ["c", "b", "a"], "a unit is updated once"
    assert tier.written == recorder.handed_on == ["c", "b", "a"]
    expected_thread = threading.current_thread().name if worker is None else f"{WORKER_THREAD}_0"
    assert recorder.threads == {expected_thread}
    masters = {u.name: m for u, m in tier.read_masters()}
    assert [float(masters[n][0]) for n in ("a", "b", "c")] == [10.0, 11.0, 12.0]


def test_apply_remaining_updates_every_unit_still_pending(worker) -> None:
    _, tier, update, recorder = opened(("a", "b", "c"), ["a", "b", "c"], worker)
    update.ready("a")
    update.apply_remaining()
    assert recorder.applied == ["a", "b", "c"] and tier.written == ["a", "b", "c"]
    assert update.compute_s >= 0 and update.wait_s >= 0


def test_until_hands_on_the_units_due_up_to_one_and_starts_the_next(worker) -> None:
    """A deferred update driven by the next forward's gathers: ``until`` hands on the units
    due before and at the one asked for, the worker left updating the one after it."""
    _, tier, update, recorder = opened(("a", "b", "c", "d"), ["a", "b", "c", "d"], worker)
    assert not update.until("b")
    assert tier.written == recorder.handed_on == ["a", "b"]
    assert recorder.applied[:2] == ["a", "b"]
    assert [unit.name for unit, *_ in update._running] == (["c"] if worker else [])
    assert not update.until("a"), "a unit handed on already: nothing to do"
    assert tier.written == ["a", "b"]
    assert update.until("d")
    assert tier.written == recorder.handed_on == ["a", "b", "c", "d"] == recorder.applied
    update.apply_remaining()
    assert tier.written == ["a", "b", "c", "d"], "nothing is left, and nothing is updated twice"


def test_abandon_updates_nothing(worker) -> None:
    _, tier, update, recorder = opened(("a", "b"), ["a", "b"], worker)
    update.abandon()
    update.apply_remaining()
    assert recorder.applied == [] and tier.written == []
    masters = {u.name: m for u, m in tier.read_masters()}
    assert float(masters["a"][0]) == 0.0 and float(masters["b"][0]) == 1.0


def test_update_order_follows_the_record_or_backward() -> None:
    layout = layout_of("h0", "h1", "h2", ROOT_UNIT)
    assert [u.name for u in update_order(["h1", ROOT_UNIT, "h0", "h2"], layout)] == ["h1", ROOT_UNIT, "h0", "h2"]
    assert [u.name for u in update_order([], layout)] == ["h2", "h1", "h0", ROOT_UNIT]
    assert [u.name for u in update_order(["h1"], layout)] == ["h2", "h1", "h0", ROOT_UNIT], "a partial record"


@pytest.mark.parametrize(
    ("sections", "overlaps"),
    [
        ({"zero": {"stage": 2}}, True),
        ({"zero": {"stage": 3}}, True),
        ({"zero": {"stage": 1}}, False),
        ({"zero": {"stage": 2}, "optim": {"overlap": False}}, False),
        ({"zero": {"stage": 2}, "optim": {"grad_clip": 1.0}}, False),
        ({"zero": {"stage": 2}, "precision": {"compute_dtype": "fp16", "loss_scaling": "dynamic"}}, False),
    ],
)
def test_updates_overlap_backward_only_when_nothing_needs_every_gradient(sections: dict, overlaps: bool) -> None:
    assert overlaps_backward(config(**sections)) is overlaps
