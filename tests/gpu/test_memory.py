"""Stage 3 with everything offloaded keeps a CUDA device within ``zero.device_memory_limit_mb``
as CUDA's caching allocator counts it, not only as the engine counts itself.

The limit covers what the engine holds (gathered units, shards, gradient buckets, the prefetch
window); the activations are outside it, so the allocator's peak may exceed it by the
activations the estimator predicts (``engine.tools.estimate.activation_bytes``) and by ``SLACK``. The
model is made four times the limit and the activations small (one sequence, activation
checkpointing), so an engine that held the whole model at once would break the bound.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.run.models.gpt import GPT, GPTConfig
from engine.runtime.sizes import MIB
from engine.tools.estimate import activation_bytes, run_shape
from tests.gpu import needs_cuda
from tests.training import SEQ_LEN, batches, config

pytestmark = [pytest.mark.gpu, needs_cuda]

STEPS = 3
SLACK = 4 * MIB
"""Device bytes in neither count: the batch, the loss, and the allocator's rounding of every
tensor up to a multiple of 512 bytes."""


def train_step(eng: Engine, data) -> float:
    loss = eng(*data.next())
    eng.backward(loss)
    eng.step()
    return loss.item()


def test_stage3_everything_offloaded_stays_within_the_device_limit(tmp_path) -> None:
    gpt = GPTConfig.preset("tiny", seq_len=SEQ_LEN, n_layer=32, d_model=256)  # 32 blocks of 0.79M parameters
    torch.manual_seed(0)
    model = GPT(gpt)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    limit = model_bytes // 4
    cfg = config(
        zero={"stage": 3, "device_memory_limit_mb": limit / MIB, "activation_checkpointing": True},
        offload={"optimizer": "nvme", "param": "nvme", "nvme_path": str(tmp_path / "store")},
        data={"micro_batch": 1, "seq_len": SEQ_LEN},
    )
    allowed = limit + activation_bytes(run_shape(cfg, 1, gpt)) + SLACK
    assert allowed < model_bytes / 2, "the bound must be broken by an engine holding the whole model"

    eng = Engine(model, cfg, total_steps=STEPS + 1)
    data = batches(1)
    try:
        losses = [train_step(eng, data)]  # makes cuBLAS's workspaces, which the process keeps
        torch.cuda.synchronize()
        outside = torch.cuda.memory_allocated() - eng.budget.used
        torch.cuda.reset_peak_memory_stats()
        losses += [train_step(eng, data) for _ in range(STEPS)]
        peak = torch.cuda.max_memory_allocated() - outside
    finally:
        eng.close()
    assert eng.budget.run_high_water <= limit
    assert peak <= allowed, f"the device held {peak / MIB:.1f} MiB, over {allowed / MIB:.1f} (limit {limit / MIB:.1f})"
    assert all(torch.isfinite(torch.tensor(losses)))
