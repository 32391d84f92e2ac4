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

from engine.run import cli  # noqa: E402
from tests.engine.test_lora import cli_lora_run, peft_reference  # noqa: E402
from tests.engine.test_pretrained import SHARD  # noqa: E402


def test_merged_export_equals_peft_merge_and_unload_and_loads_without_peft(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
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
