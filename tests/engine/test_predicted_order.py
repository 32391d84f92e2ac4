"""A fresh run predicts the order its units run in from their definition order, so that its
first step prefetches as later ones do (before, it fetched every unit on demand: at 10.1B
parameters on nvme the first step waited 43.8 s for parameters). The prediction must be what
the iteration then does: a wrong one would be re-recorded, and the first step would miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.zero.order import TracedOrder
from tests.training import batches, config, tiny_gpt

transformers = pytest.importorskip("transformers")


def llama() -> torch.nn.Module:
    from tests.engine.test_hf_models import llama as build

    return build()


def lora_llama() -> torch.nn.Module:
    from tests.engine.test_lora import lora_llama as build

    return build()


def mixtral() -> torch.nn.Module:
    from tests.engine.test_moe import mixtral as build

    return build()


def two_steps(model: torch.nn.Module, tmp_path: Path, **zero) -> tuple[Engine, dict[str, list[str]], int, int]:
    """A fresh engine's predicted orders, and the first step's prefetch hits and misses; the
    engine is left after a second step, whose start recorded the first (unless it followed
    the prediction exactly)."""
    cfg = config(
        zero={"stage": 3, "prefetch_mb": 1} | zero,
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path / "store")},
        optim={"grad_clip": 1.0},
    )
    eng = Engine(model, cfg, total_steps=3)
    predicted = {name: order.recorded for name, order in eng._orders().items()}
    data, stats = batches(2), []
    for _ in range(2):
        x, y = data.next()
        loss = eng(x, y) if isinstance(model, type(tiny_gpt())) else eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        stats.append(eng.last_step_stats)
    return eng, predicted, stats[0].prefetch_hits, stats[0].prefetch_misses


CASES = {
    "gpt": (tiny_gpt, [], True),
    # With projections as units the head is one, and its output is the model's: its hook and
    # the root's fire on one tensor, the head's first, where the prediction puts the root first.
    "gpt-projections": (tiny_gpt, ["Linear"], False),
    "gpt-blocks-and-projections": (tiny_gpt, ["Block", "Linear"], False),
    "llama": (llama, [], True),
    "llama-layers-and-projections": (llama, ["LlamaDecoderLayer", "Linear"], True),
    "lora-llama": (lora_llama, [], True),
    "mixtral-layers-and-experts": (mixtral, ["MixtralDecoderLayer", "MixtralExperts"], True),
}


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recomputed"])
@pytest.mark.parametrize(("build", "unit_classes", "exact"), CASES.values(), ids=CASES)
def test_a_fresh_runs_first_step_follows_the_predicted_order(
    build, unit_classes: list[str], exact: bool, recompute: bool, tmp_path: Path
) -> None:
    eng, predicted, hits, misses = two_steps(
        build(), tmp_path, unit_classes=unit_classes, activation_checkpointing=recompute
    )
    try:
        assert predicted["params"] and predicted["grads"], "a fresh run predicts"
        for name, order in eng._orders().items():
            ran = order.recorded  # the first iteration's order, recorded where it was not the prediction
            assert sorted(ran) == sorted(predicted[name]), f"the prediction names the units that ran ({name})"
            if exact:
                assert ran == predicted[name], f"the first iteration ran otherwise than predicted ({name})"
        assert misses == 1, f"only the first unit is fetched on demand: {hits} hits, {misses} misses"
    finally:
        eng.close()


def iteration(order: TracedOrder, names: str) -> list[list[str]]:
    """Visit each of ``names`` in a new iteration; what was upcoming after each visit."""
    order.start()
    upcoming = []
    for name in names:
        order.visit(name)
        upcoming.append(order.upcoming())
    return upcoming


def test_neighbours_that_trade_places_are_followed_and_recorded() -> None:
    order = TracedOrder("test")
    order.adopt(list("rabhRHba"))
    assert iteration(order, "rabhHRba")[4:] == [list("ba"), list("ba"), ["a"], []]
    assert iteration(order, "rab")[-1] == list("hHRba")  # the swapped iteration became the record
    assert order.recorded == list("rabhHRba")


def test_a_departure_is_recorded_and_a_shorter_iteration_keeps_the_record() -> None:
    order = TracedOrder("test")
    order.adopt(list("abcd"))
    assert iteration(order, "bacx") == [list("cd"), list("cd"), ["d"], []]  # x is no neighbour of d
    order.start()
    assert order.recorded == list("bacx")
    assert iteration(order, "ab") == [list("cx"), list("cx")]  # a swap, then cut short (an evaluation's forward)
    order.start()
    assert order.recorded == list("bacx")
