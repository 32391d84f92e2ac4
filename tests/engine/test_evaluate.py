"""The validation loss of ``python -m engine train``: what a plain model gives on the same held-out
batches, and taking it never changes the training."""

from __future__ import annotations

import collections
import copy
import json

import pytest
import torch

from engine.config import Config, ConfigError
from engine.engine import Engine
from engine.run.data import TokenBatches, load_tokens, split
from engine.run.evaluate import Validation, perplexity
from engine.run.train import build_model, train
from tests.caches import fresh_cache

OVERRIDES = ["preset=tiny", "compute_dtype=fp32", "seq_len=32", "micro_batch=2", "log_every=1", "val_fraction=0.1"]
STAGE3_NVME = ["stage=3", "offload.param=nvme", "offload.optimizer=nvme"]


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))


def test_the_validation_loss_is_the_plain_models_loss_on_the_held_out_batches(tmp_path) -> None:
    config = Config.from_dict({}, [*OVERRIDES, *STAGE3_NVME, f"nvme_path={tmp_path / 'store'}"])
    tokens, vocab = load_tokens(config.data.source)
    _, held_out = split(tokens, config.data.val_fraction)
    model = build_model(config, vocab)
    plain = copy.deepcopy(model)
    validation = Validation(held_out, seq_len=32, micro_batch=2, batches=3, every=1)
    eng = Engine(model, config)
    gathers: collections.Counter[str] = collections.Counter()
    gather = eng.params.gather
    eng.params.gather = lambda name: (gathers.update([name]), gather(name))[1]  # type: ignore[method-assign]
    try:
        ours = validation.loss(eng, seed=5)
        again = validation.loss(eng, seed=5)
    finally:
        eng.close()
    assert set(gathers.values()) == {6} and len(gathers) == len(eng.layout.units), (
        "once per forward, none for a backward"
    )
    data = TokenBatches(held_out, seq_len=32, micro_batch=2, seed=5)
    with torch.no_grad():
        expected = sum(plain(*data.next()).item() for _ in range(3)) / 3
    assert ours == expected and again == ours, "the same batches each time, and the plain model's loss on them"


def test_evaluating_every_step_leaves_the_training_bit_identical(tmp_path) -> None:
    common = [*OVERRIDES, *STAGE3_NVME, "steps=4", "eval_batches=2"]
    metrics = tmp_path / "metrics.jsonl"
    every = train(Config.from_dict({}, [*common, "eval_every=1", f"nvme_path={tmp_path / 'a'}", f"metrics={metrics}"]))
    last = train(Config.from_dict({}, [*common, f"nvme_path={tmp_path / 'b'}"]))
    assert every.losses == last.losses
    assert [step for step, _ in every.val_losses] == [1, 2, 3, 4] and last.val_losses == every.val_losses[-1:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["val_loss"] for r in records] == [loss for _, loss in every.val_losses]
    assert all(r["val_perplexity"] == perplexity(r["val_loss"]) and r["lr"] > 0 and r["grad_norm"] > 0 for r in records)


def test_evaluation_needs_held_out_tokens() -> None:
    with pytest.raises(ConfigError, match=r"train.eval_every = 5: needs held-out tokens: set data.val_fraction"):
        Config.from_dict({}, ["eval_every=5"])
    with pytest.raises(ConfigError, match=r"data.val_fraction = 1.0: must be in \[0, 1\)"):
        Config.from_dict({}, ["val_fraction=1.0"])


def test_perplexity_of_a_diverged_loss_is_inf() -> None:
    assert perplexity(0.0) == 1.0 and perplexity(1e4) == float("inf")
