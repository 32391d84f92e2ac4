"""The engine on CUDA against plain PyTorch AdamW on the same device: every stage and tier
placement in fp32 and bf16 on one rank, and on two NCCL ranks where two GPUs exist.

On the CPU build these runs are bit-identical (``tests/engine/test_equivalence.py``). On CUDA
they are compared within ``TOLERANCE`` instead, because nothing makes both sides round alike:
the backward of scaled-dot-product attention accumulates with atomics, in no fixed order;
cuBLAS picks its kernel by shape and by the alignment of the operands, and the engine's
parameters are views into a unit's flat buffer where the reference's are tensors of their own;
and with the optimizer state offloaded the engine's AdamW runs on the host while the
reference's runs on the device. ``torch.use_deterministic_algorithms`` would fix the first
alone, so it would not make these runs exact.

``TOLERANCE`` bounds ``rel_diff`` (all parameters as one vector) and each step's loss. Measured
on the CPU build over these 5 steps: swapping the fused and the foreach AdamW kernels moves the
parameters by 1.4e-7, and noise of 2 ulps on every gradient by 1.4e-7, while one step left out
moves them by at least 8.9e-4 and a learning rate 1% off by 1.3e-4. 1e-5 lies 70x above the
rounding and 13x below the smallest of those errors.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from tests.gpu import needs_cuda
from tests.ranks import run_ranks
from tests.training import config, rel_diff, tiny_gpt, train_engine, train_engine_on_ranks, train_reference

pytestmark = [pytest.mark.gpu, needs_cuda]

STEPS = 5
TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2
"""Per-step loss, relative: the CPU suite's bound for bf16 parameters (8 mantissa bits) against
autocast's fp32 parameters."""
CUDA = torch.device("cuda")
TIERS = ("device", "cpu", "nvme")
PLACEMENTS = [(stage, optimizer, "device") for stage in (1, 2) for optimizer in TIERS] + [
    (3, optimizer, param) for optimizer in TIERS for param in TIERS
]
"""(stage, offload.optimizer, offload.param): parameter shards have a tier of their own at stage 3 only."""


def placed(tmp_path, stage: int, optimizer: str, param: str, **sections: dict) -> dict:
    """The config sections of one placement, its store under ``tmp_path``."""
    return {
        "zero": {"stage": stage},
        "offload": {"optimizer": optimizer, "param": param, "nvme_path": str(tmp_path / "store")},
        **sections,
    }


def test_the_engine_computes_on_cuda_pinning_only_what_crosses() -> None:
    eng = Engine(tiny_gpt(), config())  # the optimizer state on the cpu tier
    try:
        assert eng.device.device.type == "cuda" and eng.device.backend == "nccl"
        assert all(p.is_cuda for p in eng.module.parameters())
        states = [state for _, state in eng.optimizer_state.read(eng.layout.units)]
        assert states and all(t.device.type == "cpu" for s in states for t in s.tensors())
        assert not any(t.is_pinned() for s in states for t in s.tensors()), "masters cross rounded, through a ring"
        pool = eng.device.pinned
        assert pool is not None and 0 < pool.used_bytes <= pool.limit_bytes, "cut from the one bounded pool"
        assert eng.step_control.worker is not None, (
            "AdamW on the host worker (offload.host_worker = auto on an accelerator)"
        )
    finally:
        eng.close()


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
@pytest.mark.parametrize(("stage", "optimizer", "param"), PLACEMENTS)
def test_fp32_one_rank_follows_torch_adamw_every_step(
    stage: int, optimizer: str, param: str, kernel: str, tmp_path
) -> None:
    cfg = config(**placed(tmp_path, stage, optimizer, param, optim={"kernel": kernel}))
    ours = train_engine(cfg, STEPS)
    ref = train_reference(cfg, STEPS, micro_batch=4, device=CUDA)
    assert ours["losses"] == pytest.approx(ref["losses"], rel=TOLERANCE)
    for step, (a, b) in enumerate(zip(ours["history"], ref["history"], strict=True)):
        assert rel_diff(a, b) <= TOLERANCE, f"step {step}: {rel_diff(a, b):.3g} from torch AdamW on CUDA"


@pytest.mark.parametrize(
    ("stage", "optimizer", "param"), [(1, "cpu", "device"), (2, "cpu", "device"), (3, "nvme", "nvme")]
)
def test_bf16_loss_curve_follows_autocast_on_cuda(stage: int, optimizer: str, param: str, tmp_path) -> None:
    cfg = config(**placed(tmp_path, stage, optimizer, param, precision={"compute_dtype": "bf16"}, optim={"lr": 1e-3}))
    ours = train_engine(cfg, 8)
    ref = train_reference(cfg, 8, micro_batch=4, device=CUDA)
    assert ours["losses"] == pytest.approx(ref["losses"], rel=BF16_TOLERANCE)
    assert ours["losses"][-1] < ours["losses"][0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices, one per NCCL rank")
@pytest.mark.parametrize(
    ("stage", "optimizer", "param"), [(1, "cpu", "device"), (2, "nvme", "device"), (3, "nvme", "nvme")]
)
def test_two_nccl_ranks_follow_one_process(stage: int, optimizer: str, param: str, tmp_path) -> None:
    cfg = config(**placed(tmp_path, stage, optimizer, param))
    ranks = run_ranks(2, train_engine_on_ranks, cfg, STEPS, 2)
    ref = train_reference(cfg, STEPS, micro_batch=4, device=CUDA)
    for result in ranks:
        assert rel_diff(result["params"], ref["params"]) <= TOLERANCE
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"the ranks' {name} differ"
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert mean_losses == pytest.approx(ref["losses"], rel=TOLERANCE)
