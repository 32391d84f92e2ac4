"""LoRA through peft: a Hugging Face Llama (built from a config) wrapped by ``peft.get_peft_model``
trains at stage 3 with its frozen base on nvme, bit-identically (fp32, one rank) to peft and
``torch.optim.AdamW``; the store holds optimizer state for the adapters only, and peft's
``save_pretrained`` inside ``eng.gathered()`` writes the trained adapter alone."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from engine.engine import Engine  # noqa: E402
from engine.tiers.frozen import FROZEN  # noqa: E402
from engine.tools.inspect import inspect_store  # noqa: E402
from engine.zero.optim import lr_factor  # noqa: E402
from offload import IORunner, ShardStore, generation_prefix, unit_arrays  # noqa: E402
from tests.engine.test_hf_models import llama  # noqa: E402
from tests.training import batches, config  # noqa: E402

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
    trainable = [p for p in ref_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, o, STEPS))

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
