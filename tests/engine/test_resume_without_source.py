"""A fine-tuning run resumes from its store alone: the store keeps the model's config and
tokenizer (``<store>/hf/``), so the source checkpoint, which the first start imported, can be
deleted to make room (a 7-8B checkpoint is 16 GB beside a store of 30 or more) and the run
still continues, exports and generates."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from engine.run import cli  # noqa: E402
from engine.run.generate import Sampling, continue_ids, recorded_model  # noqa: E402
from tests.engine.test_pretrained import cli_run  # noqa: E402

LORA = ["--lora.r", "4", "--lora.target-modules", '["q_proj", "v_proj"]']


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_the_run_resumes_exports_and_generates_after_its_checkpoint_is_deleted(lora, tmp_path, monkeypatch) -> None:
    folder, store, out, train = cli_run(tmp_path, monkeypatch)
    train += ["--stage", "3", "--param", "nvme", *(LORA if lora else [])]
    assert cli.main(train) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    shutil.rmtree(folder)
    more = [*train[: train.index("--steps") + 1], "3", *train[train.index("--steps") + 2 :]]
    assert cli.main(more) == 0
    assert cli.main(["export", str(store), str(out)]) == 0
    assert (out / ("adapter_config.json" if lora else "config.json")).is_file()
    config = recorded_model(cli._load_config(None, ["--nvme-path", str(store), "--stage", "3", "--param", "nvme"]))
    tokens = continue_ids(config, tokenizer("the quick")["input_ids"], Sampling(tokens=4, temperature=0))
    assert len(tokens) == 4
    if not lora:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert all(torch.isfinite(p).all() for p in loaded.parameters())
