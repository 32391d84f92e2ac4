"""``Update`` on its own: each unit is updated once, in the order given, as soon as it and
every unit before it are ready; the rest at ``apply_remaining``; none after ``abandon``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.tiers.optimizer import MemoryOptimizerState, ShardState
from engine.zero.partition import ROOT_UNIT, ModelLayout, UnitLayout, build_layout
from engine.zero.update import Update, overlaps_backward, update_order
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


def opened(names: tuple[str, ...], order: list[str]):
    layout = layout_of(*names)
    tier = Recorded(layout)
    applied: list[str] = []

    def apply(unit: UnitLayout, state: ShardState, grad: torch.Tensor | None) -> None:
        applied.append(unit.name)
        state.master.add_(10)

    update = Update([layout.unit(n) for n in order], tier, apply)
    return layout, tier, update, applied


def test_a_unit_waits_for_the_units_due_before_it() -> None:
    _, tier, update, applied = opened(("a", "b", "c"), ["c", "b", "a"])
    update.ready("b")
    assert applied == []
    update.ready("c")
    assert applied == ["c", "b"] and tier.written == ["c", "b"]
    update.ready("a")
    assert applied == ["c", "b", "a"] and tier.written == ["c", "b", "a"]
    update.apply_remaining()
    assert applied == ["c", "b", "a"], "a unit is updated once"
    masters = {u.name: m for u, m in tier.read_masters()}
    assert [float(masters[n][0]) for n in ("a", "b", "c")] == [10.0, 11.0, 12.0]


def test_apply_remaining_updates_every_unit_still_pending() -> None:
    _, tier, update, applied = opened(("a", "b", "c"), ["a", "b", "c"])
    update.ready("a")
    update.apply_remaining()
    assert applied == ["a", "b", "c"] and tier.written == ["a", "b", "c"]
    assert update.compute_s >= 0 and update.wait_s >= 0


def test_abandon_updates_nothing() -> None:
    _, tier, update, applied = opened(("a", "b"), ["a", "b"])
    update.abandon()
    update.apply_remaining()
    assert applied == [] and tier.written == []
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
