"""The estimate of any model: a Hugging Face folder's (its ``config.json`` alone, no weights) and
any ``nn.Module``'s, laid out and sized as the engine lays out and sizes it; and ``--plan auto``
never picks a plan the engine refuses."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from engine.build import model_units  # noqa: E402
from engine.config import Config  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.run.cli import main  # noqa: E402
from engine.tiers.sizing import optimizer_buffer_bytes  # noqa: E402
from engine.tools.estimate import (  # noqa: E402
    HEADROOM,
    Machine,
    estimate_plans,
    optimizer_staging_bytes,
    optimizer_state_bytes,
    recommend,
    run_shape,
    why_none_fits,
)
from tests.caches import fresh_cache  # noqa: E402
from tests.engine.test_buffer_auto import VOCAB, WIDTH, BigEmbedding  # noqa: E402
from tests.engine.test_pretrained import SHARD, TEXT, llama, save_tokenizer  # noqa: E402

BASELINE = 250 * 2**20


def config_folder(tmp_path: Path) -> Path:
    """A Hugging Face model folder holding only its config.json."""
    folder = tmp_path / "config-only"
    llama().config.save_pretrained(folder)
    assert [p.name for p in folder.iterdir()] == ["config.json"]
    return folder


def hf_config(folder: Path, tmp_path: Path, **offload) -> Config:
    return Config.from_dict(
        {
            "model": {"hf": str(folder)},
            "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path / "store")} | offload,
            "precision": {"compute_dtype": "fp32"},
            "data": {"seq_len": 32, "micro_batch": 2},
        }
    )


def test_a_config_folder_is_laid_out_and_sized_as_the_engine_does(tmp_path) -> None:
    folder = config_folder(tmp_path)
    config = hf_config(folder, tmp_path)
    run = run_shape(config, world_size=1)
    settings = llama().config
    assert (run.model.name, run.model.n_layer, run.model.d_model, run.model.n_head) == ("LlamaForCausalLM", 3, 64, 4)
    assert (run.model.vocab_size, run.model.ffn, run.model.seq_len) == (settings.vocab_size, 128, 32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(settings, dtype=torch.float32)
    engine = Engine(model, config, total_steps=1)
    try:
        assert run.layout == engine.layout
        pool = engine.optimizer_state.pool.budget_bytes  # type: ignore[attr-defined]
        assert pool == optimizer_buffer_bytes(config.offload, run.layout.units)
        assert optimizer_staging_bytes(run) == min(pool, optimizer_state_bytes(run))
    finally:
        engine.close()
    for world in (2, 3):
        assert run_shape(config, world).layout == model_units(model, run.config, world)[2]


def test_any_module_on_the_meta_device_is_estimated(tmp_path) -> None:
    config = Config.from_dict({"offload": {"optimizer": "nvme", "nvme_path": str(tmp_path / "store")}})
    with torch.device("meta"):
        module = BigEmbedding()
    run = run_shape(config, 1, model=module)
    assert run.layout == model_units(module, run.config, 1)[2]
    assert (run.model.name, run.model.vocab_size, run.model.d_model, run.model.n_layer) == (
        "BigEmbedding",
        VOCAB,
        WIDTH,
        1,
    )
    estimates = estimate_plans(run, baseline_bytes=BASELINE, device_is_host=True)
    assert all(e.peak_rss_bytes > BASELINE and not e.refused for e in estimates)


def test_no_plan_the_engine_refuses_is_recommended(tmp_path) -> None:
    with torch.device("meta"):
        module = BigEmbedding()
    config = Config.from_dict({"offload": {"buffer_mb": 64, "nvme_path": str(tmp_path / "store")}})
    estimates = estimate_plans(run_shape(config, 1, model=module), baseline_bytes=BASELINE, device_is_host=True)
    refused = {e.plan for e in estimates if e.refused}
    assert refused == {e.plan for e in estimates if e.plan.optimizer == "nvme"}
    assert all(
        re.search(r"unit .root. needs .* set offload.buffer_mb >= \d+", e.refused) for e in estimates if e.refused
    )
    least = min((e for e in estimates if e.refused), key=lambda e: e.peak_rss_bytes)
    ram = int(least.peak_rss_bytes / (1 - HEADROOM)) + 1
    small = Machine(ram_bytes=ram, disk_free_bytes=10**15, device_bytes=None, device_is_host=True)
    assert small.shortfalls(least) == [f"the engine refuses it: {least.refused}"]
    choice = recommend(estimates, small, config)
    assert choice is None or (choice.plan.optimizer != "nvme" and not choice.refused)
    if choice is None:
        assert "the engine refuses it: offload.buffer_mb = 64" in why_none_fits(estimates, small, config)
    auto = Config.from_dict({"offload": {"nvme_path": str(tmp_path / "store")}})
    fixed = estimate_plans(run_shape(auto, 1, model=module), baseline_bytes=BASELINE, device_is_host=True)
    assert not any(e.refused for e in fixed)


def test_estimate_command_takes_a_config_folder(tmp_path, capsys, caplog) -> None:
    folder = config_folder(tmp_path)
    assert main(["estimate", "--model.hf", str(folder), "--seq_len", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["name"] == "LlamaForCausalLM" and report["model"]["n_layer"] == 3
    assert report["recommended"] is not None
    assert main(["estimate", "--model.hf", str(folder), "--seq_len", "32"]) == 0
    assert "model: LlamaForCausalLM" in capsys.readouterr().out
    # --param is offload.param, not --params (the built-in GPT's size, refused with a folder below)
    assert main(["estimate", "--model.hf", str(folder), "--seq_len", "32", "--stage", "3", "--param", "nvme"]) == 0
    assert "model: LlamaForCausalLM" in capsys.readouterr().out
    assert main(["estimate", "--model.hf", str(folder), "--params", "1e6"]) == 2
    assert "size a built-in GPT: leave them out" in caplog.text


@pytest.mark.slow  # plan = auto is applied in test_estimate too: about 15 s
def test_train_with_plan_auto_fine_tunes_a_pretrained_model(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    folder = tmp_path / "pretrained"
    torch.manual_seed(0)
    llama(vocab=320).save_pretrained(folder, max_shard_size=SHARD)
    save_tokenizer(folder)
    (tmp_path / "corpus.txt").write_text(TEXT)
    args = ["train", "--plan", "auto", "--model.hf", str(folder), "--data.source", str(tmp_path / "corpus.txt")]
    args += ["--steps", "2", "--seq_len", "16", "--micro_batch", "2", "--nvme_path", str(tmp_path / "store")]
    with caplog.at_level("INFO"):
        assert main(args) == 0
    assert "--plan auto: stage 2, optimizer device, param device" in caplog.text
    assert "done: 2 steps" in caplog.text
