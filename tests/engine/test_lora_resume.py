"""A LoRA run stopped after N steps and resumed from its store for M more equals the same run of
N + M steps uninterrupted, bit for bit in fp32: losses, trained adapters and the untouched base."""

from __future__ import annotations

import json
import logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors.torch import load_file

from engine.run import cli
from engine.tools.consolidate import consolidate
from tests.caches import fresh_cache
from tests.engine.test_lora import cli_lora_run

FIRST, TOTAL = 2, 5


def with_steps(args: list[str], steps: int, store: str, metrics: str) -> list[str]:
    """``args`` for ``steps`` steps into ``store``, the cosine decay fixed at ``TOTAL`` steps so
    that the learning rate of a step does not depend on where a run stops."""
    replaced = {"--steps": str(steps), "--nvme_path": store, "--metrics": metrics}
    out = [replaced.get(args[i - 1], arg) if i else arg for i, arg in enumerate(args)]
    return [*out, "--optim.decay_steps", str(TOTAL)]


def test_a_resumed_lora_run_equals_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    _, _, args = cli_lora_run(tmp_path)
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    assert cli.main(with_steps(args, TOTAL, whole, str(tmp_path / "whole.jsonl"))) == 0
    assert cli.main(with_steps(args, FIRST, parts, str(tmp_path / "parts.jsonl"))) == 0
    caplog.clear()
    caplog.set_level(logging.INFO, logger="engine")
    assert cli.main(with_steps(args, TOTAL, parts, str(tmp_path / "parts.jsonl"))) == 0
    assert any(f"resumed at step {FIRST}" in r.getMessage() for r in caplog.records), "the second run resumed"

    def losses(name: str) -> list[tuple[int, float]]:
        lines = (tmp_path / name).read_text().splitlines()
        return [(record["step"], record["loss"]) for record in map(json.loads, lines)]

    assert losses("parts.jsonl") == losses("whole.jsonl") and len(losses("whole.jsonl")) == TOTAL
    consolidate(whole, tmp_path / "whole.safetensors")
    consolidate(parts, tmp_path / "parts.safetensors")
    ours, expected = load_file(tmp_path / "parts.safetensors"), load_file(tmp_path / "whole.safetensors")
    assert ours.keys() == expected.keys() and any("lora_B" in name for name in ours)
    for name, values in expected.items():
        assert values.equal(ours[name]), f"{name} differs from the uninterrupted run"
