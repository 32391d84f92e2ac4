"""``GradientShards`` on its own: each parameter's gradient reaches its unit's fp32 shard,
summed over micro-batches, at stage 1 (reduced once at the step) and stage 2 (reduced as
each unit's gradients arrive), and the shards go as the optimizer releases them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm
from engine.runtime.detect import detect_device
from engine.state.partition import ModelLayout, build_layout, flatten_into
from engine.zero.grads import GradientShards, bucket_bytes, grad_shard_bytes


def two_units(seed: int = 0) -> tuple[nn.Sequential, dict[str, list[tuple[str, nn.Parameter]]]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    owned = {
        "first": [("0.weight", model[0].weight), ("0.bias", model[0].bias)],
        "second": [("2.weight", model[2].weight), ("2.bias", model[2].bias)],
    }
    return model, owned


def shards_of(model: nn.Sequential, layout: ModelLayout, owned, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the shards must hold: torch's own gradients, summed over ``batches``, flattened."""
    model.zero_grad()
    for x in batches:
        model(x).square().sum().backward()
    expected = {}
    for unit in layout.units:
        flat = torch.zeros(unit.padded_numel)
        flatten_into(flat, unit, {name: p.grad for name, p in owned[unit.name]})
        expected[unit.name] = flat[: unit.shard_numel]
    model.zero_grad(set_to_none=True)
    return expected


def shards(stage: int, budget: DeviceBudget | None = None):
    model, owned = two_units()
    reference, reference_owned = two_units()
    layout = build_layout(owned, world_size=1, max_chunk_numel=2048)
    grads = GradientShards(
        layout,
        owned,
        Comm(),
        detect_device(),
        torch.device("cpu"),
        reduce_per_micro_batch=stage >= 2,
        budget=budget or DeviceBudget(),
        shards_on_device=False,
    )
    return model, reference, reference_owned, layout, grads


def micro_batches(grads: GradientShards, model: nn.Module, batches: list[torch.Tensor]) -> None:
    for index, x in enumerate(batches):
        grads.start_backward(last_micro_batch=index == len(batches) - 1)
        model(x).square().sum().backward()
        grads.end_backward()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("count", [1, 3])
def test_shards_hold_the_summed_gradients_of_every_micro_batch(stage: int, count: int) -> None:
    model, reference, reference_owned, layout, grads = shards(stage)
    torch.manual_seed(1)
    batches = [torch.randn(5, 8) for _ in range(count)]
    micro_batches(grads, model, batches)
    final = grads.final_shards()
    expected = shards_of(reference, layout, reference_owned, batches)
    assert len(final) == 2
    for unit, got in zip(layout.units, final, strict=True):
        torch.testing.assert_close(got, expected[unit.name], rtol=1e-6, atol=1e-6)
    assert all(p.grad is None for p in model.parameters()), "a hook drops each .grad once it is copied"
    grads.close()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("count", [1, 3])
def test_where_the_device_is_the_host_the_reduced_shard_is_kept_not_copied(stage: int, count: int) -> None:
    model, _, _, layout, grads = shards(stage)
    device = grads._device
    device.take_copied_bytes()
    torch.manual_seed(1)
    micro_batches(grads, model, [torch.randn(5, 8) for _ in range(count)])
    grads.final_shards()
    copied = device.take_copied_bytes()
    # Later micro-batches at stage 2 are added through the staging shard: one copy each.
    added = sum(grad_shard_bytes(u) for u in layout.units) * (count - 1) if stage == 2 else 0
    assert copied == added
    grads.close()


def test_stage_2_says_when_each_unit_is_ready_in_backward_order() -> None:
    model, _, _, _, grads = shards(stage=2)
    ready: list[str] = []
    grads.on_ready = ready.append
    micro_batches(grads, model, [torch.randn(5, 8)])
    assert ready == ["second", "first"], "backward reaches the last layer first"
    grads.start_backward(last_micro_batch=True)  # the next step's order: the one just recorded
    assert grads.order.recorded == ["second", "first"]
    grads.close()


def test_stage_2_frees_its_buckets_as_it_reduces() -> None:
    budget = DeviceBudget()
    model, _, _, layout, grads = shards(stage=2, budget=budget)
    micro_batches(grads, model, [torch.randn(5, 8)])
    assert budget.used == 0
    assert budget.high_water >= min(bucket_bytes(u) for u in layout.units)
    grads.close()


def test_stage_1_keeps_its_buckets_until_the_step() -> None:
    budget = DeviceBudget()
    model, _, _, layout, grads = shards(stage=1, budget=budget)
    micro_batches(grads, model, [torch.randn(5, 8)])
    assert budget.used == sum(bucket_bytes(u) for u in layout.units)
    grads.final_shards()
    assert budget.used == 0
    grads.close()


def test_released_shards_are_gone_and_zero_starts_a_new_window() -> None:
    model, reference, reference_owned, layout, grads = shards(stage=2)
    micro_batches(grads, model, [torch.randn(5, 8)])
    grads.final_shards()
    total = grads.nbytes()
    assert total == sum(u.shard_numel * 4 for u in layout.units)
    grads.release_shard("first")
    assert "first" not in grads.shards and grads.nbytes() == total - layout.unit("first").shard_numel * 4
    grads.zero()
    assert grads.shards == {}
    batch = torch.randn(5, 8)
    micro_batches(grads, model, [batch])  # copied, not added to the window before
    expected = shards_of(reference, layout, reference_owned, [batch])
    for unit, got in zip(layout.units, grads.final_shards(), strict=True):
        torch.testing.assert_close(got, expected[unit.name], rtol=1e-6, atol=1e-6)
    grads.close()


def test_close_removes_the_hooks() -> None:
    model, _, _, _, grads = shards(stage=2)
    grads.close()
    model(torch.randn(5, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert grads.shards == {}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("count", [1, 2])
def test_a_parameter_backward_did_not_use_and_the_padding_reduce_as_zeros(stage: int, count: int, monkeypatch) -> None:
    """A bucket is made without zeroing what gradients overwrite; what none writes (an unused
    parameter, the padding) must still be zero, whatever the memory held before."""
    model, owned = two_units()
    unused = nn.Parameter(torch.ones(3))
    owned["first"].append(("unused", unused))
    layout = build_layout(owned, world_size=1, max_chunk_numel=2048)
    assert layout.units[0].padded_numel > layout.units[0].numel, "the case needs padding"
    empty = torch.empty

    def dirty_empty(*args, **kwargs) -> torch.Tensor:
        made = empty(*args, **kwargs)
        return made.fill_(float("nan")) if made.is_floating_point() else made

    monkeypatch.setattr(torch, "empty", dirty_empty)
    grads = GradientShards(
        layout, owned, Comm(), detect_device(), torch.device("cpu"), reduce_per_micro_batch=stage >= 2,
        budget=DeviceBudget(), shards_on_device=False,
    )  # fmt: skip
    torch.manual_seed(1)
    micro_batches(grads, model, [torch.randn(5, 8) for _ in range(count)])
    first = grads.final_shards()[0]
    slot = next(s for s in layout.units[0].params if s.name == "unused")
    assert torch.equal(first[slot.offset : slot.offset + slot.numel], torch.zeros(3))
    assert torch.equal(first[layout.units[0].numel :], torch.zeros(layout.units[0].shard_numel - layout.units[0].numel))
    assert torch.isfinite(first).all()
    grads.close()


def one_weight_units(seed: int = 0) -> tuple[nn.Sequential, dict[str, list[tuple[str, nn.Parameter]]]]:
    """Two units of one bias-free weight each, 64 x 64: whole aligned shards, no padding."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False))
    return model, {"first": [("0.weight", model[0].weight)], "second": [("2.weight", model[2].weight)]}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("count", [1, 3])
def test_a_unit_of_one_weight_reduces_its_gradient_itself_at_stage_2(stage: int, count: int, monkeypatch) -> None:
    """At stage 2 a unit holding one parameter and no padding takes the parameter's gradient as
    its bucket, with no bucket made and nothing copied; stage 1 adds micro-batches into a
    bucket of its own. Either way the shards hold torch's summed gradients, bit for bit."""
    model, owned = one_weight_units()
    reference, reference_owned = one_weight_units()
    layout = build_layout(owned, world_size=1, max_chunk_numel=4096)
    assert all(u.padded_numel == u.numel for u in layout.units), "the case needs units without padding"
    made: list[str] = []
    new_bucket = GradientShards._new_bucket
    monkeypatch.setattr(
        GradientShards, "_new_bucket", lambda self, unit: made.append(unit.name) or new_bucket(self, unit)
    )
    budget = DeviceBudget()
    grads = GradientShards(
        layout, owned, Comm(), detect_device(), torch.device("cpu"), reduce_per_micro_batch=stage >= 2,
        budget=budget, shards_on_device=False,
    )  # fmt: skip
    torch.manual_seed(1)
    batches = [torch.randn(5, 64) for _ in range(count)]
    micro_batches(grads, model, batches)
    expected = shards_of(reference, layout, reference_owned, batches)
    for unit, got in zip(layout.units, grads.final_shards(), strict=True):
        assert torch.equal(got, expected[unit.name]) if count == 1 else torch.allclose(got, expected[unit.name])
    assert made == ([] if stage == 2 else ["second", "first"])
    assert budget.used == 0 and budget.high_water >= bucket_bytes(layout.units[0])
    grads.close()
