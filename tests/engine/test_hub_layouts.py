"""Checkpoints whose names and layouts on disk differ from their modules', in and out through
transformers' own conversion rules: Mixtral (``block_sparse_moe`` renamed to ``mlp``, one tensor
per expert on disk stacked into ``experts.gate_up_proj``/``down_proj``), Qwen2-MoE (stacked
experts beside a shared expert), GraniteMoE (stacked on disk, renamed) and GPT-NeoX
(``embed_out`` on disk for ``lm_head``). Each is imported at stage 3 with everything on nvme,
fine-tuned bit for bit as ``torch.optim.AdamW`` does from ``from_pretrained``, and exported in
the layout ``save_pretrained`` writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from engine.run.pretrained import Pretrained, meta_model, read_headers, record_source  # noqa: E402
from engine.tools.export import export  # noqa: E402
from tests.engine.test_pretrained import SHARD, checkpoint, fine_tune, params, start, torch_adamw  # noqa: E402
from tests.training import SEQ_LEN  # noqa: E402

SMALL = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": SEQ_LEN}


def mixtral() -> transformers.PreTrainedModel:
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            **SMALL, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2,
        )
    )  # fmt: skip


def qwen2_moe() -> transformers.PreTrainedModel:
    return transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **SMALL, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=64,
            num_hidden_layers=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, tie_word_embeddings=False,
        )
    )  # fmt: skip


def granitemoe() -> transformers.PreTrainedModel:
    return transformers.GraniteMoeForCausalLM(
        transformers.GraniteMoeConfig(
            **SMALL, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2,
        )
    )  # fmt: skip


def gpt_neox() -> transformers.PreTrainedModel:
    return transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            **SMALL, intermediate_size=128, num_hidden_layers=2, hidden_dropout=0.0, attention_dropout=0.0,
            tie_word_embeddings=False,
        )
    )  # fmt: skip


MODELS = [mixtral, qwen2_moe, granitemoe, gpt_neox]
IDS = ["mixtral", "qwen2_moe", "granitemoe", "gpt_neox"]


def stored(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint folder, by its name on disk: its shape."""
    return {name: tensor.shape for name, tensor in read_headers(folder).items()}


def test_the_checkpoints_store_names_their_modules_do_not_have() -> None:
    """What makes these models the cases to test: their names on disk are not their parameters'."""
    for build, on_disk in [(mixtral, "block_sparse_moe.experts.0.w1"), (gpt_neox, "embed_out")]:
        model = build()
        saved = transformers.core_model_loading.revert_weight_conversion(model, model.state_dict())
        assert any(on_disk in name for name in saved) and not any(on_disk in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("build", MODELS, ids=IDS)
def test_import_fine_tune_and_export_in_the_stored_layout(build, tmp_path: Path) -> None:
    folder, store, out = checkpoint(build, tmp_path / "pretrained", torch.float32), tmp_path / "store", tmp_path / "out"
    eng = start(folder, store)

    def step(x: torch.Tensor) -> float:
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        return loss.item()

    losses = fine_tune(step)
    with eng.gathered():
        ours = params(eng.module)
    eng.close()
    ref_losses, ref = torch_adamw(folder, eng.config)
    assert losses == ref_losses and losses[-1] < losses[0]
    for name in ours:
        assert torch.equal(ours[name], ref[name]), f"{name} differs from torch AdamW"

    record_source(folder, store, dtype="fp32")
    assert json.loads((store / "hf" / "source.json").read_text())["converted"] is True
    export(store, out, max_shard_size=SHARD)
    assert stored(out) == stored(folder), "the export's names and shapes are save_pretrained's"
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].keys() == stored(folder).keys()
    exported = params(transformers.AutoModelForCausalLM.from_pretrained(out))
    assert exported.keys() == ours.keys()
    for name in ours:
        assert torch.equal(exported[name], ours[name]), f"{name} differs from the engine's"


def _rename_on_disk(folder: Path, old: str, new: str) -> None:
    """Rename one tensor in a sharded checkpoint (its file and the index)."""
    from safetensors.torch import load_file, save_file

    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    file = folder / data["weight_map"].pop(old)
    tensors = load_file(file)
    tensors[new] = tensors.pop(old)
    save_file(tensors, file, metadata={"format": "pt"})
    data["weight_map"][new] = file.name
    index.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "model.layers.1.block_sparse_moe.experts.2.w1.weight",
            "model.layers.1.block_sparse_moe.experts.2.w9.weight",
            "holds tensor 'model.layers.1.block_sparse_moe.experts.2.w9.weight'",
        ),
        (
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.block_sparse_moe.router.weight",
            "lacks tensor 'model.layers.0.mlp.gate.weight'",
        ),
    ],
)
def test_a_damaged_expert_checkpoint_is_refused_by_its_names(tmp_path: Path, old: str, new: str, message: str) -> None:
    folder = checkpoint(mixtral, tmp_path / "pretrained")
    _rename_on_disk(folder, old, new)
    with pytest.raises(ValueError, match=message):
        Pretrained(folder, meta_model(folder))


def test_a_misshaped_expert_is_named_on_disk_and_in_the_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = checkpoint(mixtral, tmp_path / "pretrained")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    tensors = load_file(folder / index[name])
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, folder / index[name], metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.weight.*make the model's 'model\.layers\.0\.mlp\.experts"):
        Pretrained(folder, meta_model(folder))


def _config(kind: str, **settings) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(kind, **SMALL, num_hidden_layers=2, num_key_value_heads=2, **settings)


MORE = {
    "phimoe": {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2},
    "jamba": {
        "intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2, "attn_layer_period": 2,
        "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 8,
    },
    # Its routers keep a trained bias as a persistent buffer, which the checkpoint holds.
    "deepseek_v3": {
        "intermediate_size": 96, "moe_intermediate_size": 48, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_shared_experts": 1,
    },
    # Its hash routers keep an integer table (token to expert) as a persistent buffer.
    "deepseek_v4": {
        "intermediate_size": 96, "moe_intermediate_size": 48, "n_routed_experts": 4, "num_local_experts": 4,
        "num_experts_per_tok": 2, "head_dim": 16,
    },
}  # fmt: skip


@pytest.mark.parametrize("kind", MORE)
def test_more_expert_layouts_import_and_export_as_transformers_does(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **MORE[kind]))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_()  # as training leaves it: not what the model's code initialises
        if name.endswith("tid2eid"):
            buffer.random_(0, 4)
    folder, store, out = tmp_path / "pretrained", tmp_path / "store", tmp_path / "out"
    model.save_pretrained(folder, max_shard_size=SHARD)
    eng = start(folder, store)
    x = torch.randint(0, 256, (2, SEQ_LEN))
    with torch.no_grad():
        ours = eng(input_ids=x).logits
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ours, theirs(input_ids=x).logits)
    eng.backward(eng(input_ids=x, labels=x).loss)
    eng.step()
    with eng.gathered():
        trained = params(eng.module) | {n: b.clone() for n, b in eng.module.named_buffers()}
    eng.close()
    record_source(folder, store, dtype="fp32")
    export(store, out, max_shard_size=SHARD)
    assert stored(out) == stored(folder), "the export's names and shapes are save_pretrained's"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    exported = params(loaded) | dict(loaded.named_buffers())
    for name in params(loaded):
        assert torch.equal(exported[name], trained[name]), f"{name} differs from the engine's"
    for name, buffer in loaded.named_buffers():
        if name.endswith(("e_score_correction_bias", "tid2eid")):
            assert buffer.dtype == trained[name].dtype and torch.equal(buffer, trained[name]), f"buffer {name} kept"
