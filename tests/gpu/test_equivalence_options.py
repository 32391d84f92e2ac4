"""The engine's training options on CUDA against plain PyTorch on the same device: clipping,
gradient accumulation, fp16 with dynamic loss scaling, gradients spilled to disk, the update
deferred to the next forward, and the compact optimizer state's update, compiled for the device or the host's C kernel.

The CPU suite holds the first four to torch bit for bit, or fp16 within a measured bound
(``tests/engine``); on CUDA nothing makes both sides round alike, so the exact ones are held
within ``TOLERANCE`` after every step (``tests.gpu.test_equivalence`` says why 1e-5), and the
forms that round by design within the CPU suite's own bound for them.
"""

from __future__ import annotations

import pytest

from engine.config import spills_gradients
from engine.zero import compact_update, host_update
from tests.engine.test_defer_update import STEPS as DEFER_STEPS
from tests.engine.test_defer_update import train as train_deferred
from tests.engine.test_loss_scaling import FP16_CLIP, FP16_TOLERANCE
from tests.engine.test_master_dtype import STEPS as COMPACT_STEPS
from tests.engine.test_master_dtype import TRACK_TOLERANCE
from tests.gpu import needs_cuda
from tests.gpu.test_equivalence import CUDA, STEPS, TOLERANCE, placed
from tests.training import change_error, config, initial_params, rel_diff, train_engine, train_reference

pytestmark = [pytest.mark.gpu, needs_cuda]

CLIP = 0.05
"""Below every step's gradient norm of the tiny GPT (as in ``tests.engine.test_equivalence``): the clip bites."""
NORM_TOLERANCE = 1e-4
"""Relative, on each step's gradient norm: taken at parameters up to ``TOLERANCE`` apart, from
gradients that CUDA's kernels sum in no fixed order; a norm of the scaled gradients, or of one
micro-batch's, is off by a factor."""
FP16_NORM_TOLERANCE = 3e-3
"""Relative, on each step's gradient norm in fp16: ten times the CPU suite's measured 3e-4
(``tests.engine.test_loss_scaling``), CUDA's fp16 kernels rounding otherwise than the CPU's; a
norm left scaled by the loss scale is 1024 times off."""


def follows(ours: dict, ref: dict, what: str) -> None:
    """The engine's losses and parameters after every step within ``TOLERANCE`` of the reference's."""
    assert ours["losses"] == pytest.approx(ref["losses"], rel=TOLERANCE), what
    for step, (a, b) in enumerate(zip(ours["history"], ref["history"], strict=True)):
        assert rel_diff(a, b) <= TOLERANCE, f"step {step}: {rel_diff(a, b):.3g} from {what} on CUDA"


@pytest.mark.parametrize(("stage", "optimizer", "param"), [(1, "cpu", "device"), (3, "cpu", "cpu")])
def test_clipping_follows_clip_grad_norm(stage: int, optimizer: str, param: str, tmp_path) -> None:
    cfg = config(**placed(tmp_path, stage, optimizer, param, optim={"grad_clip": CLIP}))
    ours = train_engine(cfg, STEPS)
    ref = train_reference(cfg, STEPS, micro_batch=4, device=CUDA)
    assert max(ref["grad_norms"]) > CLIP, f"the clip never bites: {ref['grad_norms']}"
    assert ours["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_TOLERANCE)
    follows(ours, ref, "torch AdamW + clip_grad_norm_")


@pytest.mark.parametrize(("stage", "optimizer", "param"), [(2, "cpu", "device"), (3, "cpu", "cpu")])
def test_gradient_accumulation_follows_torch_accumulating(stage: int, optimizer: str, param: str, tmp_path) -> None:
    cfg = config(**placed(tmp_path, stage, optimizer, param, zero={"stage": stage, "grad_accum_steps": 2}))
    ours = train_engine(cfg, STEPS, micro_batch=2)
    ref = train_reference(cfg, STEPS, micro_batch=2, device=CUDA)  # two backward passes per step
    follows(ours, ref, "torch AdamW over gradients accumulated by autograd")


@pytest.mark.parametrize(("stage", "param"), [(2, "device"), (3, "nvme")])
def test_spilled_gradients_follow_clip_grad_norm(stage: int, param: str, tmp_path) -> None:
    cfg = config(**placed(tmp_path, stage, "nvme", param, optim={"grad_clip": CLIP}))
    assert spills_gradients(cfg), "offload.grad_spill = auto spills here: the optimizer on nvme waits for the norm"
    ours = train_engine(cfg, STEPS)
    ref = train_reference(cfg, STEPS, micro_batch=4, device=CUDA)
    assert ours["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_TOLERANCE)
    follows(ours, ref, "torch AdamW + clip_grad_norm_")


@pytest.mark.parametrize(("optimizer", "param"), [("nvme", "cpu"), ("nvme", "nvme"), ("cpu", "cpu")])
def test_a_deferred_update_follows_clip_grad_norm(optimizer: str, param: str, tmp_path) -> None:
    """Each unit updated in the next forward and sent up from its new master (through the
    staging ring, on the copy stream) before its gather; on the ``cpu`` tier from a gradient
    shard kept in pinned memory since the step before."""
    cfg = config(**placed(tmp_path, 3, optimizer, param, optim={"grad_clip": CLIP, "defer_update": True}))
    ours = train_deferred(cfg)  # nothing between the steps: each update runs in the next forward
    ref = train_reference(cfg, DEFER_STEPS, micro_batch=4, device=CUDA)
    assert {doing for doing, _ in ours["updated"]} == {"forward", "end"}
    assert ours["losses"] == pytest.approx(ref["losses"], rel=TOLERANCE)
    assert rel_diff(ours["params"], ref["params"]) <= TOLERANCE


@pytest.mark.parametrize(("stage", "param"), [(1, "device"), (3, "cpu")])
def test_fp16_with_loss_scaling_follows_grad_scaler(stage: int, param: str, tmp_path) -> None:
    seed = stage - 1  # a model per stage, as in tests.engine.test_loss_scaling
    precision = {"compute_dtype": "fp16", "loss_scaling": "dynamic", "initial_scale": 1024.0}
    cfg = config(
        **placed(tmp_path, stage, "cpu", param, precision=precision, optim={"lr": 1e-3, "grad_clip": FP16_CLIP})
    )
    ours = train_engine(cfg, 8, seed=seed)
    ref = train_reference(cfg, 8, micro_batch=4, device=CUDA, seed=seed)
    norms = ref["grad_norms"]
    assert min(norms) < FP16_CLIP < max(norms), f"the clip must bite on some steps only: {norms}"
    assert ours["grad_norms"] == pytest.approx(norms, rel=FP16_NORM_TOLERANCE)
    error = change_error(ours["params"], ref["params"], initial_params(seed))
    assert 0 < error < FP16_TOLERANCE, f"{error:.3g} from GradScaler + clip_grad_norm_ + AdamW under fp16 autocast"


@pytest.mark.parametrize("optimizer", ["device", "cpu"])
def test_the_compact_update_tracks_torch_adamw(optimizer: str, tmp_path, monkeypatch) -> None:
    """int8 moments and bf16 masters, held to ``tests.engine.test_master_dtype``'s bound for
    these forms over its steps: on the device tier, the update compiled for CUDA (Triton); on
    the cpu tier, the host worker's C kernel (``engine.zero.host_update``), every unit's."""
    monkeypatch.setattr(compact_update.ADAMW, "kernel", None)  # compiled here, for CUDA tensors
    served = []
    update = host_update.update
    monkeypatch.setattr(host_update, "update", lambda *args: served.append(update(*args)) or served[-1])
    compact = {"state_dtype": "int8", "master_dtype": "bf16"}
    cfg = config(**placed(tmp_path, 2, optimizer, "device", optim=compact))
    ours = train_engine(cfg, COMPACT_STEPS)
    ref = train_reference(cfg, COMPACT_STEPS, micro_batch=4, device=CUDA)
    if optimizer == "device":
        kernel = compact_update.ADAMW.kernel
        assert kernel is not None and kernel is not compact_update.ADAMW.fn, (
            "ran uncompiled: see the warning logged why"
        )
        assert not any(served)
    else:
        assert served and all(served), "the host kernel updated every unit: see the warning logged why not"
    error = change_error(ours["params"], ref["params"], initial_params())
    assert 0 < error < TRACK_TOLERANCE, f"{error:.3g} from torch's fp32 AdamW"
    assert ours["losses"][-1] < ours["losses"][0]
