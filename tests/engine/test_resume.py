"""Resuming from the store: a run stopped after N steps and resumed equals one that never stopped."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.run.models.gpt import GPT, GPTConfig
from tests.training import batches, config, tiny_gpt


def nvme(tmp_path, stage: int = 2, **sections):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return config(
        zero={"stage": stage}, offload={"optimizer": "nvme", "nvme_path": str(tmp_path / "store")}, **sections
    )


def run(eng: Engine, steps: int) -> list[float]:
    data = batches(4)
    if "data" in eng.client_state:
        data.load_state_dict(eng.client_state["data"])
    losses = []
    for _ in range(steps):
        loss = eng(*data.next())
        eng.backward(loss)
        eng.client_state = {"data": data.state_dict()}
        eng.step()
        losses.append(loss.item())
    return losses


def params(eng: Engine) -> dict[str, torch.Tensor]:
    with eng.gathered():
        return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stop_and_resume_is_bit_identical(tmp_path, stage: int) -> None:
    straight = Engine(tiny_gpt(), nvme(tmp_path / "a", stage), total_steps=6)
    expected_losses, expected = run(straight, 6), params(straight)
    straight.close()

    first = Engine(tiny_gpt(), nvme(tmp_path / "b", stage), total_steps=6)
    losses = run(first, 3)
    first.close()
    torch.manual_seed(1234)  # resume must not depend on the new process's random state
    resumed = Engine.resume(tiny_gpt(seed=99), nvme(tmp_path / "b", stage), total_steps=6)
    assert resumed.global_step == 3
    losses += run(resumed, 3)
    assert losses == expected_losses
    got = params(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    resumed.close()


def test_loss_scale_and_random_state_survive(tmp_path) -> None:
    cfg = nvme(
        tmp_path,
        precision={"compute_dtype": "fp16", "loss_scaling": "dynamic", "initial_scale": 256.0, "growth_interval": 2},
    )
    eng = Engine(tiny_gpt(), cfg, total_steps=4)
    torch.manual_seed(5)
    run(eng, 3)
    next_draw = torch.rand(3)  # the stream right after the last committed step
    eng.close()
    torch.manual_seed(77)
    resumed = Engine.resume(tiny_gpt(), cfg, total_steps=4)
    assert resumed.scaler.scale == eng.scaler.scale == 512.0
    assert resumed.global_step == 3
    assert torch.equal(torch.rand(3), next_draw)
    resumed.close()


def test_resume_refuses_another_model(tmp_path) -> None:
    Engine(tiny_gpt(), nvme(tmp_path), total_steps=1).close()
    other = GPT(GPTConfig.preset("tiny", seq_len=32, d_model=128, n_head=4))
    with pytest.raises(
        ValueError,
        match=r"the store has parameter 'blocks.0.ln1.weight' with shape \[64\] .* where the model has .* shape \[128\]",
    ):
        Engine.resume(other, nvme(tmp_path), total_steps=1)


def test_resume_without_a_store_or_commit(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no offload store"):
        Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=1)


def test_resume_needs_the_nvme_tier(tmp_path) -> None:
    with pytest.raises(ValueError, match="resuming needs the state on disk"):
        Engine.resume(tiny_gpt(), config(offload={"optimizer": "cpu"}), total_steps=1)


def test_resume_catches_a_flipped_byte(tmp_path) -> None:
    import json

    from offload.chunks import ChecksumError

    eng = Engine(tiny_gpt(), nvme(tmp_path), total_steps=2)
    run(eng, 2)
    eng.close()
    generation = json.loads((tmp_path / "store" / "COMMITTED").read_text())["generation"]
    chunk = tmp_path / "store" / f"gen-{generation}" / "blocks.1" / "exp_avg" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=rf"gen-{generation}/blocks.1/exp_avg. chunk 0: .* fails its CRC-32C check"):
        Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=2)
