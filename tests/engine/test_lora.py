"""LoRA through peft: a Hugging Face Llama (built from a config) wrapped by ``peft.get_peft_model``
trains at stage 3 with its frozen base on nvme, bit-identically (fp32, one rank) to peft and
``torch.optim.AdamW``; the store holds optimizer state for the adapters only, and peft's
``save_pretrained`` inside ``eng.gathered()`` writes the trained adapter alone."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


from engine.config import Config, ConfigError  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.run import cli  # noqa: E402
from engine.run.data import TokenBatches, load_tokens  # noqa: E402
from engine.run.generate import Sampling, continue_ids, recorded_model  # noqa: E402
from engine.run.lora import init_adapters_, peft_config  # noqa: E402
from engine.run.loss import chunked_cross_entropy  # noqa: E402
from engine.tiers.frozen import FROZEN  # noqa: E402
from engine.tools.inspect import inspect_store  # noqa: E402
from offload import IORunner, ShardStore, generation_prefix, unit_arrays  # noqa: E402
from tests.caches import fresh_cache  # noqa: E402
from tests.engine.test_hf_models import llama  # noqa: E402
from tests.engine.test_pretrained import SHARD, TEXT, save_tokenizer  # noqa: E402
from tests.engine.test_pretrained import llama as pretrained_llama  # noqa: E402
from tests.training import batches, config, reference_adamw, reference_schedule  # noqa: E402

STEPS = 3


def lora_llama() -> torch.nn.Module:
    model = llama()
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():  # lora_B starts at zero: make the adapters change the output from the first step
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model: torch.nn.Module, step) -> list[float]:
    data = batches(4)
    losses = []
    for _ in range(STEPS):
        x = data.next()[0]
        losses.append(step(model(input_ids=x, labels=x).loss))
    return losses


def test_lora_stage3_base_on_nvme_is_bit_identical_to_peft_and_adamw(tmp_path) -> None:
    cfg = config(
        zero={"stage": 3, "prefetch_mb": 1},
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path / "store")},
    )
    model = lora_llama()
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    eng = Engine(model, cfg, total_steps=STEPS)

    def engine_step(loss: torch.Tensor) -> float:
        eng.backward(loss)
        eng.step()
        return loss.item()

    ours = train(eng, engine_step)
    with eng.gathered():
        ours_params = snapshot(model)
        model.save_pretrained(tmp_path / "adapter")  # peft's own format: the adapters alone
    layout = eng.layout
    eng.close()

    ref_model = lora_llama()
    o = cfg.optim
    opt = reference_adamw(ref_model, o)
    schedule = reference_schedule(opt, o, STEPS)

    def reference_step(loss: torch.Tensor) -> float:
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    ref, ref_params = train(ref_model, reference_step), snapshot(ref_model)
    assert ours == ref
    assert ours[-1] < ours[0]
    assert ours_params.keys() == ref_params.keys()
    for name in ref_params:
        assert torch.equal(ours_params[name], ref_params[name]), f"{name} differs from peft + torch AdamW"
    base = snapshot(lora_llama())
    assert all(torch.equal(ours_params[n], base[n]) for n in base if n not in adapters), "the base never changes"

    # Optimizer state for the adapters only; the base is stored once, outside the generations.
    adapter_numel = sum(p.numel() for n, p in ref_params.items() if n in adapters)
    assert layout.numel == adapter_numel and layout.frozen_numel > 20 * adapter_numel
    report = inspect_store(tmp_path / "store")
    with IORunner(threads=1) as runner:
        store = ShardStore.open(tmp_path / "store", runner=runner)
        state = unit_arrays(store, generation_prefix(report["committed"]["generation"]))
        assert {unit for unit, _ in state.values()} == {u.name for u in layout.units}
        state_numel = sum(store.array_info(name).numel for name in state)
        assert state_numel == 3 * sum(u.padded_numel for u in layout.units)
        assert {unit for unit, _ in unit_arrays(store, FROZEN).values()} == {u.name for u in layout.frozen}
    assert report["frozen"]["numel"] == layout.frozen_numel

    loaded = peft.PeftModel.from_pretrained(llama(), tmp_path / "adapter")
    for name, param in loaded.named_parameters():
        assert torch.equal(param, ours_params[name]), f"{name} differs in the saved adapter"


LORA = ["--lora.r", "4", "--lora.alpha", "8", "--lora.target_modules", '["q_proj", "v_proj"]']


def cli_lora_run(tmp_path) -> tuple[Path, Path, list[str]]:
    """A pretrained fp32 Llama folder (sharded, with a tokenizer), a corpus, and the train command
    that fine-tunes it with LoRA at stage 3, base and optimizer on nvme."""
    folder = tmp_path / "pretrained"
    torch.manual_seed(0)
    pretrained_llama(vocab=320).save_pretrained(folder, max_shard_size=SHARD)
    save_tokenizer(folder)
    (tmp_path / "corpus.txt").write_text(TEXT)
    args = ["train", "--model.hf", str(folder), "--data.source", str(tmp_path / "corpus.txt"), "--steps", str(STEPS)]
    args += ["--seq_len", "16", "--micro_batch", "2", "--nvme_path", str(tmp_path / "store"), "--stage", "3"]
    args += ["--param", "nvme", "--compute_dtype", "fp32", "--lr", "1e-2", "--metrics", str(tmp_path / "m.jsonl")]
    return folder, tmp_path / "corpus.txt", [*args, *LORA]


def peft_reference(folder: Path, corpus: Path, args: list[str]) -> tuple[torch.nn.Module, list[float]]:
    """What the train command ``args`` computes, by peft and ``torch.optim.AdamW`` on the whole
    model in memory: the trained peft model and its losses."""
    cfg = cli._load_config(None, args[1:])
    ref = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder), peft_config(cfg.lora))
    adapters = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    init_adapters_(adapters, cfg.train.seed)
    o, steps = cfg.optim, cfg.train.steps
    opt = reference_adamw(ref, o)  # over the adapters, the parameters that require grad
    schedule = reference_schedule(opt, o, steps)
    tokens, _ = load_tokens(str(corpus), pretrained=str(folder))
    data = TokenBatches(tokens, seq_len=16, micro_batch=2, seed=cfg.data.seed)
    losses = []
    for _ in range(steps):
        x, y = data.next()
        # The engine's loss, taken in chunks from the last hidden states (equal to the full one
        # within 1e-6, tests/engine/test_chunked_loss.py): what is compared here is the training.
        hidden = ref(input_ids=x, output_hidden_states=True).hidden_states[-1]
        loss = chunked_cross_entropy(hidden, ref.get_output_embeddings().weight, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapters.values(), o.grad_clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return ref, losses


def test_cli_lora_equals_peft_and_adamw_and_exports_the_adapter_in_peft_format(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    folder, corpus, args = cli_lora_run(tmp_path)
    assert cli.main(args) == 0
    assert cli.main(["export", str(tmp_path / "store"), str(tmp_path / "adapter")]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    ours = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    cfg = cli._load_config(None, args[1:])
    ref, theirs = peft_reference(folder, corpus, args)
    assert ours == theirs and ours[-1] < ours[0]

    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(folder.resolve()) and saved["r"] == 4
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")  # the base found by the adapter
    expected = dict(ref.named_parameters())
    assert dict(loaded.named_parameters()).keys() == expected.keys()
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), f"{name} differs from peft + torch AdamW"
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in loaded.named_parameters() if "lora_B" in n)

    # generate finds the base and the adapters' settings in the store, and decodes as the trained peft model
    unnamed = recorded_model(dataclasses.replace(cfg, model=Config().model, lora=Config().lora))
    assert unnamed.lora == cfg.lora
    prompt = transformers.AutoTokenizer.from_pretrained(folder)("the quick")["input_ids"]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert continue_ids(unnamed, prompt, Sampling(tokens=6, temperature=0)) == ids[len(prompt) :]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lora.target_modules", '["nothing_here"]'], "lora.target_modules = ['nothing_here']"),
        (["--lora.target_modules", '["embed_tokens"]'], "not a linear layer's: target the model's linear layers"),
    ],
)
def test_cli_lora_refuses_target_modules_it_cannot_train_in_one_line(
    tmp_path, monkeypatch, caplog, extra, message
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    _, _, args = cli_lora_run(tmp_path)
    assert cli.main([*args, *extra]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], errors
    assert not (tmp_path / "store").exists(), "a refused run leaves no store"


def test_lora_settings_are_checked_with_the_config(monkeypatch, tmp_path) -> None:
    with pytest.raises(ConfigError, match=re.escape("lora.r = 4: LoRA fine-tunes a pretrained model: set model.hf")):
        Config.from_dict({}, ["lora.r=4"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"lora.dropout = 1.0: must be in \[0, 1\)"):
        Config.from_dict({}, [f"model.hf={tmp_path}", "lora.r=4", "lora.dropout=1.0"])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=re.escape("lora.r = 4: needs the peft library: pip install peft")):
        Config.from_dict({}, [f"model.hf={tmp_path}", "lora.r=4"])
