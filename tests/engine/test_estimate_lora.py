"""The estimate of a LoRA run (``[lora]`` on a ``model.hf`` run): the adapters alone train, the
base is frozen, laid out as the engine lays out the peft model; its peak RSS against a real
LoRA run, and the plan ``--plan auto`` picks from it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from engine.config import LoraConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.run import cli  # noqa: E402
from engine.run.lora import peft_config  # noqa: E402
from engine.tools.estimate import (  # noqa: E402
    Plan,
    estimate,
    estimate_plans,
    measured_baseline_bytes,
    plan_of,
    recommend,
    run_shape,
)
from tests.engine.test_estimate import PEAK_RSS_PROBE, TOLERANCE, machine, probe, room_for  # noqa: E402
from tests.engine.test_estimate_models import config_folder, hf_config  # noqa: E402
from tests.engine.test_lora import LORA  # noqa: E402
from tests.engine.test_pretrained import TEXT, llama, save_tokenizer  # noqa: E402


def test_a_lora_run_is_laid_out_as_the_engine_lays_out_the_peft_model(tmp_path) -> None:
    config = hf_config(config_folder(tmp_path), tmp_path)
    lora = dataclasses.replace(config, lora=LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    run = run_shape(lora, world_size=1)
    model = peft.get_peft_model(llama(), peft_config(lora.lora))
    engine = Engine(model, lora, total_steps=1)
    try:
        assert run.layout == engine.layout
    finally:
        engine.close()
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert run.layout.numel == adapters and run.layout.frozen_numel == sum(p.numel() for p in llama().parameters())

    # The optimizer state is the adapters': a machine too small for a full fine-tune's state in
    # memory holds a LoRA run's.
    full = {e.plan: e for e in estimate_plans(run_shape(config, 1), baseline_bytes=0, device_is_host=True)}
    ours = {e.plan: e for e in estimate_plans(run, baseline_bytes=0, device_is_host=True)}
    in_memory = Plan(2, "device", "device")
    assert ours[in_memory].peak_rss_bytes < full[in_memory].peak_rss_bytes
    ram = room_for(ours[in_memory].node_rss_bytes)
    full_choice = recommend(list(full.values()), machine(ram), config)
    assert full_choice is None or full_choice.plan != in_memory
    assert recommend(list(ours.values()), machine(ram), lora).plan == in_memory


def big_llama_folder(tmp_path: Path) -> Path:
    """A 40M-parameter Llama in bf16 with a tokenizer: its frozen base, not the torch baseline,
    is what the run holds."""
    folder = tmp_path / "pretrained"
    settings = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(settings).to(torch.bfloat16).save_pretrained(folder, max_shard_size="20MB")
    save_tokenizer(folder)
    return folder


@pytest.mark.slow  # a real LoRA run measured: about 30 s
def test_predicted_peak_rss_of_a_lora_run_is_within_tolerance(tmp_path) -> None:
    """Measured here: 734 MiB peak RSS against 697 predicted; as a full fine-tune, 1236."""
    folder = big_llama_folder(tmp_path)
    (tmp_path / "corpus.txt").write_text(TEXT)
    args = ["--model.hf", str(folder), "--data.source", str(tmp_path / "corpus.txt"), "--steps", "2"]
    args += [
        "--seq_len",
        "32",
        "--micro_batch",
        "2",
        "--nvme_path",
        str(tmp_path / "store"),
        "--stage",
        "3",
        "--log_every",
        "100",
    ]
    args += ["--offload.optimizer", "cpu", "--offload.param", "cpu", "--compute_dtype", "fp32", *LORA]
    peak = int(probe(["-c", PEAK_RSS_PROBE, *args], tmp_path, tmp_path).split()[-1])
    config = cli._load_config(None, args)
    run = run_shape(config, world_size=1)
    assert run.layout.frozen_numel > 35e6 and run.layout.frozen_numel > 100 * run.layout.numel
    baseline = measured_baseline_bytes(str(folder))
    est = estimate(run, plan_of(config), baseline_bytes=baseline)
    error = est.peak_rss_bytes / peak - 1
    assert abs(error) <= TOLERANCE, (
        f"predicted {est.peak_rss_bytes / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB ({error:+.1%}); "
        f"terms in MiB: { {k: round(v / 2**20) for k, v in est.terms.items()} }"
    )
    full = estimate(
        run_shape(dataclasses.replace(config, lora=LoraConfig()), 1), plan_of(config), baseline_bytes=baseline
    )
    assert full.peak_rss_bytes > (1 + TOLERANCE) * peak, "a full fine-tune's estimate would not do"
