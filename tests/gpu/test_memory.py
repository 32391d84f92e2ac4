"""Stage 3 with everything offloaded keeps a CUDA device within ``zero.device_memory_limit_mb``
as CUDA's caching allocator counts it, not only as the engine counts itself: in the bytes of
its tensors (allocated) and in the device memory the allocator took for them (reserved).

The limit covers what the engine holds (gathered units, shards, gradient buckets, the prefetch
window); the activations are outside it, so the allocator's peak may exceed it by the
activations the estimator predicts (``engine.tools.estimate.activation_bytes``) and by ``SLACK``. The
model is made four times the limit and the activations small (one sequence, activation
checkpointing), so an engine that held the whole model at once would break the bound.

Reserved memory is what the process takes from the device, and what another process or a
larger batch then cannot have; it exceeds the bytes allocated by the unused rest of the
allocator's segments (``RESERVED_SLACK``), and by more where the engine's pattern of
allocations keeps the allocator from reusing what it freed: a block freed while another stream
still uses it waits for that stream, so an allocation meanwhile takes a new segment.
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
LARGE_SEGMENT = 20 * MIB
"""The segment CUDA's caching allocator cuts tensors of 1 to 10 MiB from (``kLargeBuffer``):
a unit of this model (0.79M fp32 parameters, 3.2 MB) and its gradient buckets are of that size."""
RESERVED_SLACK = 2 * LARGE_SEGMENT
"""Reserved bytes beyond the allocated bound: at the peak, the free rest of the segment the
gathered units are cut from and of the one the gradient buckets and activations are cut from
(the 2 MiB segments of tensors under 1 MiB are within ``SLACK``). It still leaves the bound
below the model's size."""


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

    assert allowed + RESERVED_SLACK < model_bytes, "the reserved bound must be broken by one too"

    eng = Engine(model, cfg, total_steps=STEPS + 1)
    data = batches(1)
    try:
        losses = [train_step(eng, data)]  # makes cuBLAS's workspaces, which the process keeps
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what earlier tests and the first step left cached
        outside = torch.cuda.memory_allocated() - eng.budget.used
        reserved_outside = torch.cuda.memory_reserved() - eng.budget.used
        torch.cuda.reset_peak_memory_stats()
        losses += [train_step(eng, data) for _ in range(STEPS)]
        peak = torch.cuda.max_memory_allocated() - outside
        reserved = torch.cuda.max_memory_reserved() - reserved_outside
    finally:
        eng.close()
    assert eng.budget.run_high_water <= limit
    held = f"(limit {limit / MIB:.1f} MiB, allocated peak {peak / MIB:.1f}, reserved peak {reserved / MIB:.1f})"
    assert peak <= allowed, f"the device held {peak / MIB:.1f} MiB, over {allowed / MIB:.1f} {held}"
    assert reserved <= allowed + RESERVED_SLACK, (
        f"the allocator reserved {reserved / MIB:.1f} MiB, over {(allowed + RESERVED_SLACK) / MIB:.1f} {held}"
    )
    assert all(torch.isfinite(torch.tensor(losses)))
