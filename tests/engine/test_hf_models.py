"""Hugging Face causal LMs, built from a config (random init, nothing downloaded), trained at
stage 3 with parameters and optimizer state on nvme: bit-identical to plain PyTorch AdamW in
fp32 on one rank. Their blocks sit in an ``nn.ModuleList`` (the default units); GPT-2 ties
its head to the token embedding; their forward returns a ``ModelOutput``, not a tensor."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from engine.engine import Engine  # noqa: E402
from tests.training import SEQ_LEN, batches, config, reference_adamw, reference_schedule  # noqa: E402

STEPS = 3


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def gpt2_tied() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=3, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).float()


def train(step_fn) -> list[float]:
    data = batches(4)
    return [step_fn(data.next()[0]) for _ in range(STEPS)]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


PROJECTIONS = ["LlamaDecoderLayer", "Linear"]
"""Units below a layer: each projection a unit of its own inside its layer's."""


def test_projection_units_leave_the_output_head_in_the_root() -> None:
    """The chunked loss reads the head's weight outside its forward, so the head is never a
    unit of its own, whatever ``zero.unit_classes`` names."""
    from engine.state.partition import ROOT_UNIT, find_units

    names = [name for name, _ in find_units(llama(), PROJECTIONS)]
    layer = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    per_layer = [[*(f"model.layers.{i}.{part}" for part in layer), f"model.layers.{i}"] for i in range(3)]
    assert names == [name for names_of_layer in per_layer for name in names_of_layer] + [ROOT_UNIT]


def counted(forward, name: str, calls: list[str]):
    def run(*args, **kwargs):
        calls.append(name)
        return forward(*args, **kwargs)

    return run


def test_a_recomputed_layer_runs_each_projection_twice_a_step_not_three_times(tmp_path) -> None:
    """Only the outermost units are checkpointed: a projection inside a recomputed layer runs
    once in forward and once in the layer's recomputation, not again in a checkpoint of its own."""
    cfg = config(
        zero={"stage": 3, "unit_classes": PROJECTIONS, "activation_checkpointing": True},
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path / "store")},
    )
    model = llama()
    calls: list[str] = []
    for name, module in [("q_proj", model.model.layers[0].self_attn.q_proj), ("layer", model.model.layers[0])]:
        module.forward = counted(module.forward, name, calls)  # what a checkpoint recomputes, too
    eng = Engine(model, cfg, total_steps=1)
    x = batches(4).next()[0]
    eng.backward(eng(input_ids=x, labels=x).loss)
    eng.step()
    eng.close()
    assert calls.count("q_proj") == 2 and calls.count("layer") == 2


def bytes_read_a_step(tmp_path, recompute: bool) -> int:
    cfg = config(
        zero={"stage": 3, "prefetch_mb": 0, "unit_classes": PROJECTIONS, "activation_checkpointing": recompute},
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path / f"store-{recompute}")},
    )
    eng = Engine(llama(), cfg, total_steps=2)
    x = batches(4).next()[0]
    for _ in range(2):
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
    read = eng.last_step_stats.bytes_read
    eng.close()
    return read


def test_a_recomputed_layer_reads_its_projections_once_in_backward(tmp_path) -> None:
    """The recomputation gathers a nested unit for its backward, which comes next: released after
    the recomputed forward, it was read from disk a second time."""
    assert bytes_read_a_step(tmp_path, recompute=True) == bytes_read_a_step(tmp_path, recompute=False)


@pytest.mark.parametrize(
    ("build", "unit_classes", "recompute"),
    [(llama, [], False), (llama, PROJECTIONS, False), (llama, PROJECTIONS, True), (gpt2_tied, [], False)],
    ids=["llama", "llama-projection-units", "llama-projection-units-recomputed", "gpt2-tied"],
)
def test_stage3_on_nvme_is_bit_identical_to_torch_adamw(build, unit_classes, recompute, tmp_path) -> None:
    cfg = config(
        zero={"stage": 3, "prefetch_mb": 1, "unit_classes": unit_classes, "activation_checkpointing": recompute},
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path / "store")},
    )
    model = build()
    if build is gpt2_tied:
        assert model.lm_head.weight is model.transformer.wte.weight
    eng = Engine(model, cfg, total_steps=STEPS)

    def engine_step(x: torch.Tensor) -> float:
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        return loss.item()

    ours = train(engine_step)
    with eng.gathered():  # outside it a stage-3 unit's parameters have no storage
        ours_params = snapshot(model)
    assert eng.last_step_stats.prefetch_hit_rate > 0.5, "the traced order predicts an HF model's units too"
    eng.close()

    ref_model = build()
    o = cfg.optim
    opt = reference_adamw(ref_model, o)
    schedule = reference_schedule(opt, o, STEPS)

    def reference_step(x: torch.Tensor) -> float:
        loss = ref_model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    ref, ref_params = train(reference_step), snapshot(ref_model)
    assert ours == ref
    assert ours[-1] < ours[0]
    assert ours_params.keys() == ref_params.keys()
    for name in ref_params:
        assert torch.equal(ours_params[name], ref_params[name]), f"{name} differs from torch AdamW"
