"""A fresh run predicts the order its units run in from their definition order, so that its
first step prefetches as later ones do (before, it fetched every unit on demand: at 10.1B
parameters on nvme the first step waited 43.8 s for parameters). The prediction must be what
the iteration then does: a wrong one would be re-recorded, and the first step would miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from tests.training import batches, config, tiny_gpt

transformers = pytest.importorskip("transformers")


def llama() -> torch.nn.Module:
    from tests.engine.test_hf_models import llama as build

    return build()


def lora_llama() -> torch.nn.Module:
    from tests.engine.test_lora import lora_llama as build

    return build()


def first_step(model: torch.nn.Module, tmp_path: Path, **zero) -> tuple[Engine, dict[str, list[str]], int, int]:
    cfg = config(
        zero={"stage": 3, "prefetch_mb": 1} | zero,
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path / "store")},
        optim={"grad_clip": 1.0},
    )
    eng = Engine(model, cfg, total_steps=3)
    predicted = {name: order.recorded for name, order in eng._orders().items()}
    x, y = batches(2).next()
    loss = eng(x, y) if isinstance(model, type(tiny_gpt())) else eng(input_ids=x, labels=x).loss
    eng.backward(loss)
    eng.step()
    stats = eng.last_step_stats
    return eng, predicted, stats.prefetch_hits, stats.prefetch_misses


@pytest.mark.parametrize("build", [tiny_gpt, llama, lora_llama], ids=["gpt", "llama", "lora-llama"])
def test_a_fresh_runs_first_step_follows_the_predicted_order(build, tmp_path: Path) -> None:
    eng, predicted, hits, misses = first_step(build(), tmp_path)
    try:
        assert predicted["params"] and predicted["grads"], "a fresh run predicts"
        for name, order in eng._orders().items():
            assert order.recorded == predicted[name], f"the first iteration ran otherwise than predicted ({name})"
        assert hits > misses, f"the first step fetched ahead: {hits} hits, {misses} misses"
    finally:
        eng.close()


def test_recomputed_activations_are_not_predicted(tmp_path: Path) -> None:
    eng, predicted, _, _ = first_step(tiny_gpt(), tmp_path, activation_checkpointing=True)
    eng.close()
    assert predicted == {"grads": [], "params": []}
