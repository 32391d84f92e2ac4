"""With the optimizer on the device, a step reads device values on the host once, not once per unit.

On an accelerator each read of a device value on the host (``.item()``, ``float(t)``) waits for
every kernel queued before it, so a read per unit (its gradient norm inside backward, its step
count for the compact update's seeds) would stall the device once per unit. The reads are
counted here, on the CPU, where torch dispatches each as ``aten._local_scalar_dense`` just as
on CUDA: a step of a GPT with 6 blocks must read no more than one with 2, at most once.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import OptimConfig
from engine.engine import Engine
from engine.run.models.gpt import GPT, GPTConfig
from engine.state.quantize import packed_bytes
from engine.zero import compact_update
from tests.training import SEQ_LEN, batches, config

SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}

FORMS = {"fp32": {}, "compact": {"state_dtype": "int8", "master_dtype": "bf16"}}


class ScalarReads(TorchDispatchMode):
    """Counts the reads of one tensor value on the host while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in SCALAR_READS
        return func(*args, **(kwargs or {}))


def reads_in_a_step(blocks: int, stage: int, form: str, clip: float) -> int:
    """The host reads of the second step (the first may set things up) of a GPT with ``blocks`` blocks."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", seq_len=SEQ_LEN, n_layer=blocks), seed=0)
    optim = {"grad_clip": clip} | FORMS[form]
    eng = Engine(model, config(zero={"stage": stage}, offload={"optimizer": "device"}, optim=optim), total_steps=2)
    data = batches(4)
    for _ in range(2):
        with ScalarReads() as reads:
            eng.backward(eng(*data.next()))
            eng.step()
    eng.close()
    return reads.count


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_reads_the_device_once_whatever_the_number_of_units(stage, form, clip, monkeypatch) -> None:
    monkeypatch.setattr(compact_update.ADAMW, "kernel", compact_update.compact_adamw_)  # what it runs, uncompiled
    few, many = (reads_in_a_step(blocks, stage, form, clip) for blocks in (2, 6))
    assert few == many <= 1, (few, many)


KERNELS = {"fused": ("fused", torch.float32, torch.float32), "foreach": ("foreach", torch.float32, torch.float32)}
KERNELS["compact"] = ("fused", torch.bfloat16, torch.uint8)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_shard_told_on_the_device_to_skip_is_left_as_it_was(kernel: str, monkeypatch) -> None:
    """The finding that a unit's gradient is not finite reaches the kernel as a tensor (``skip``,
    torch's ``found_inf``): the shard and its count are left as they were; a zero changes nothing."""
    monkeypatch.setattr(compact_update.ADAMW, "kernel", compact_update.compact_adamw_)
    name, master_dtype, moment_dtype = KERNELS[kernel]
    opt = compact_update.CompactAdamW(OptimConfig(kernel=name))
    numel = 1024
    moment_numel = packed_bytes(numel) if moment_dtype == torch.uint8 else numel

    def shard() -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        master = torch.randn(numel, generator=generator).to(master_dtype)
        return [master, torch.zeros(moment_numel, dtype=moment_dtype), torch.zeros(moment_numel, dtype=moment_dtype)]

    plain, told, skipped = shard(), shard(), shard()
    counters = [opt.new_step_counter(torch.device("cpu")) for _ in range(3)]
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        opt.update(plain[0], grad.clone(), *plain[1:], counters[0], 1e-2)
        opt.update(told[0], grad.clone(), *told[1:], counters[1], 1e-2, skip=torch.zeros(()), count=step)
    opt.update(skipped[0], grad.clone(), *skipped[1:], counters[2], 1e-2)
    before = [t.clone() for t in skipped]
    opt.update(skipped[0], torch.full((numel,), float("inf")), *skipped[1:], counters[2], 1e-2, skip=torch.ones(()))
    assert all(torch.equal(a, b) for a, b in zip(plain, told, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(skipped, before, strict=True))
    assert not torch.equal(skipped[0], shard()[0]), "the step before the skipped one moved it"
    if kernel != "compact":  # the compact form counts on the host (``UnitAdamW``), its tensor is a fallback
        assert counters[2].item() == 1
