"""``export --merged`` of a LoRA run: the base with its trained adapters merged in, streamed into
a plain Hugging Face folder that ``from_pretrained`` loads with no peft, equal bit for bit (fp32)
to peft's ``merge_and_unload`` of the same training done by peft and ``torch.optim.AdamW``."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from engine.run import cli  # noqa: E402
from engine.tools.consolidate import consolidate  # noqa: E402
from tests.caches import fresh_cache  # noqa: E402
from tests.engine.test_lora import cli_lora_run, peft_reference  # noqa: E402
from tests.engine.test_pretrained import SHARD, llama  # noqa: E402


def test_merged_export_equals_peft_merge_and_unload_and_loads_without_peft(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    folder, corpus, args = cli_lora_run(tmp_path)
    assert cli.main(args) == 0
    out = tmp_path / "merged"
    assert cli.main(["export", str(tmp_path / "store"), str(out), "--merged", "--max-shard-size", SHARD]) == 0
    assert not (out / "adapter_config.json").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "streamed into several shards"

    ref, _ = peft_reference(folder, corpus, args)
    expected = ref.merge_and_unload().state_dict()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(transformers.AutoModelForCausalLM.from_pretrained(folder))
    ours = loaded.state_dict()
    assert ours.keys() == expected.keys() and index["weight_map"].keys() == expected.keys()
    for name, values in expected.items():
        assert values.dtype == ours[name].dtype == torch.float32
        assert torch.equal(ours[name], values), f"{name} differs from peft's merge_and_unload"
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    changed = {n for n in base if not torch.equal(base[n], ours[n])}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed), changed

    # A store whose record names no adapters (a full fine-tune's) has nothing to merge: refused in one line.
    record = tmp_path / "store" / "hf" / "source.json"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "lora"}))
    caplog.clear()
    assert cli.main(["export", str(tmp_path / "store"), str(tmp_path / "refused"), "--merged"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "trained no LoRA adapters" in errors[0] and "without --merged" in errors[0], errors
    assert not (tmp_path / "refused").exists()


def test_a_bf16_base_is_merged_in_fp32_and_rounded_once_into_the_checkpoints_dtype(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    folder, _, args = cli_lora_run(tmp_path)
    torch.manual_seed(0)
    llama(vocab=320).to(torch.bfloat16).save_pretrained(folder, max_shard_size=SHARD)  # over the fp32 one
    assert cli.main(args) == 0
    out = tmp_path / "merged"
    assert cli.main(["export", str(tmp_path / "store"), str(out), "--merged"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").state_dict()
    consolidate(tmp_path / "store", tmp_path / "all.safetensors")  # fp32: the adapters and the base's values
    stored = load_file(tmp_path / "all.safetensors")
    scaling = 8 / 4  # lora.alpha / lora.r
    plain = {n.removeprefix("base_model.model.") for n in stored}
    assert loaded.keys() == llama(vocab=320).state_dict().keys()
    for name, values in loaded.items():
        layer, _, kind = name.rpartition(".")
        expected = stored[f"base_model.model.{name}"] if name in plain else None
        if layer.endswith(("q_proj", "v_proj")):
            a, b = (stored[f"base_model.model.{layer}.lora_{x}.default.weight"] for x in "AB")
            expected = stored[f"base_model.model.{layer}.base_layer.{kind}"] + (b @ a) * scaling
        assert expected is not None, f"{name} is not in the store"
        assert values.dtype == torch.bfloat16 and torch.equal(values, expected.bfloat16()), name
