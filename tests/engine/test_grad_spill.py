"""Gradient shards spilled to the store while the update waits for the global norm: the same
bits as keeping them in memory (and as torch's AdamW with ``clip_grad_norm_``), no shard of
the whole model in memory at the step, a scratch store that no commit or checkpoint holds, and
a crash in it that leaves the last commit to resume from."""

from __future__ import annotations

import errno

import pytest
import torch

from engine.config import ConfigError, spills_gradients
from engine.engine import Engine
from engine.tiers.grad_spill import scratch_path
from engine.tiers.store_checks import store_bytes
from offload import OffloadIOError, ShardStore
from tests.engine.test_nvme_tier import FailingOps
from tests.ranks import run_ranks
from tests.training import batches, config, tiny_gpt, train_engine, train_engine_on_ranks, train_reference

STEPS = 4


def nvme(tmp_path, spill: bool | str = True, **sections: dict):
    """An nvme config with clipping that bites at this model's size, gradients spilled or not."""
    offload = {"optimizer": "nvme", "nvme_path": str(tmp_path / "store"), "grad_spill": spill}
    return config(
        offload=offload | sections.pop("offload", {}),
        optim={"grad_clip": 0.05} | sections.pop("optim", {}),
        **sections,
    )


def assert_same(a: dict, b: dict, what: str) -> None:
    for step, (x, y) in enumerate(zip(a["history"], b["history"], strict=True)):
        differing = [name for name in y if not torch.equal(x[name], y[name])]
        assert not differing, f"step {step}: parameters differ from {what}: {differing[:3]}"


@pytest.mark.parametrize("stage", [2, 3])
def test_spilled_clipping_is_bit_identical_to_clip_grad_norm(stage: int, tmp_path) -> None:
    cfg = nvme(tmp_path, zero={"stage": stage})
    ours = train_engine(cfg, STEPS)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    assert_same(ours, ref, "torch AdamW + clip_grad_norm_")
    assert not (tmp_path / "store" / "scratch" / "rank-0").exists(), "close removes the spilled gradients"


def test_spilled_accumulation_matches_in_memory(tmp_path) -> None:
    """Shards accumulate in memory over the window and are spilled on its last micro-batch."""
    runs = [
        train_engine(nvme(tmp_path / str(spill), spill, zero={"grad_accum_steps": 2}), 3, 2) for spill in (True, False)
    ]
    assert runs[0]["losses"] == runs[1]["losses"]
    assert_same(runs[0], runs[1], "the in-memory clipped run")


@pytest.mark.parametrize("worker", [False, True])
def test_no_gradient_shard_is_in_memory_at_the_step(worker: bool, tmp_path) -> None:
    """Each shard leaves memory once spilled: inline as backward finishes it, on the host worker
    as the worker gets to it (the step waits for the last); at the step none is left, and the
    step's I/O holds each written and read back once."""
    eng = Engine(tiny_gpt(), nvme(tmp_path, offload={"host_worker": worker}), total_steps=2)
    assert (eng.step_control.worker is not None) == worker and eng.step_control.spill is not None
    data = batches(4)
    eng.backward(eng(*data.next()))
    if not worker:
        assert eng.grads.nbytes() == 0
    eng.step()
    assert eng.grads.nbytes() == 0
    spilled = sum(u.shard_numel * 4 for u in eng.layout.units)
    state = 3 * spilled
    assert eng.last_step_stats.bytes_read == state + spilled
    assert eng.last_step_stats.bytes_written == state + spilled
    eng.close()


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # the default run keeps stage 3
def test_two_gloo_ranks_spilled_match_in_memory_bit_for_bit(stage: int, tmp_path) -> None:
    """(The clip threshold bites on two ranks too: ``test_equivalence``.)"""
    spilled = run_ranks(2, train_engine_on_ranks, nvme(tmp_path / "a", zero={"stage": stage}), STEPS, 2)
    in_memory = run_ranks(2, train_engine_on_ranks, nvme(tmp_path / "b", False, zero={"stage": stage}), STEPS, 2)
    for ours, theirs in zip(spilled, in_memory, strict=True):
        assert ours["losses"] == theirs["losses"]
        assert_same(ours, theirs, "the in-memory clipped run")


def fp16_run(tmp_path, spill: bool, clip: float) -> tuple[list[dict[str, torch.Tensor]], float, int]:
    """fp16 with dynamic loss scaling, a step poisoned with inf in the middle: the parameters
    after each step, the final scale and the skipped steps."""
    precision = {"compute_dtype": "fp16", "loss_scaling": "dynamic", "initial_scale": 1024.0, "growth_interval": 2}
    cfg = nvme(tmp_path, spill, precision=precision, optim={"grad_clip": clip, "lr": 1e-3})
    eng = Engine(tiny_gpt(), cfg, total_steps=5)
    data = batches(4)
    history = []
    for step in range(5):
        poison = eng.module.blocks[1].mlp.fc.weight.register_hook(lambda g: g * float("inf")) if step == 2 else None
        eng.backward(eng(*data.next()))
        if poison is not None:
            poison.remove()
        assert eng.step() == (step != 2)
        history.append({n: p.detach().clone() for n, p in eng.module.named_parameters()})
    scale, skipped = eng.scaler.scale, eng.skipped_steps
    eng.close()
    return history, scale, skipped


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_fp16_loss_scaling_with_an_overflow_spilled_matches_in_memory(clip: float, tmp_path) -> None:
    spilled, scale, skipped = fp16_run(tmp_path / "a", True, clip)
    in_memory, scale_mem, skipped_mem = fp16_run(tmp_path / "b", False, clip)
    assert skipped == skipped_mem == 1 and scale == scale_mem
    assert all(torch.equal(spilled[2][n], spilled[1][n]) for n in spilled[1]), "the overflowed step is skipped"
    for step, (a, b) in enumerate(zip(spilled, in_memory, strict=True)):
        assert all(torch.equal(a[n], b[n]) for n in b), f"step {step} differs from the in-memory run"


def test_scratch_is_in_no_commit_nor_checkpoint_and_a_leftover_is_swept(tmp_path) -> None:
    cfg = nvme(tmp_path)
    eng = Engine(tiny_gpt(), cfg, total_steps=4)
    data = batches(4)
    for _ in range(2):
        eng.backward(eng(*data.next()))
        eng.step()
    eng.save("kept")
    scratch = scratch_path(cfg.offload.nvme_path, 0)
    assert any(scratch.rglob("c/*")), "the step's gradients were spilled there"
    names = ShardStore.open(tmp_path / "store", runner=eng.io.runner).array_names()
    assert names and not [n for n in names if "scratch" in n or n.endswith("/grad")]
    eng.close()
    leftover = scratch_path(cfg.offload.nvme_path, 3) / "junk"  # as a crashed 4-rank run leaves it
    leftover.mkdir(parents=True)
    resumed = Engine.resume(tiny_gpt(), cfg, total_steps=4)
    assert not leftover.parent.exists()
    resumed.close()
    assert not (tmp_path / "store" / "scratch").exists(), "close removes the scratch folder it left empty"


def test_a_failed_spill_keeps_the_last_commit(tmp_path) -> None:
    cfg = nvme(tmp_path, store={"defer_commit": False})
    eng = Engine(tiny_gpt(), cfg, total_steps=3)
    data = batches(4)
    eng.backward(eng(*data.next()))
    eng.step()
    committed = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    assert eng.step_control.spill is not None
    ops = FailingOps("write", errno.ENOSPC)
    eng.step_control.spill.store._ops = ops
    ops.armed = True
    with pytest.raises(OffloadIOError, match="grad"):
        eng.backward(eng(*data.next()))
        eng.step()
    eng.close()
    resumed = Engine.resume(tiny_gpt(), cfg, total_steps=3)
    assert resumed.global_step == 1
    assert all(torch.equal(p, committed[n]) for n, p in resumed.module.named_parameters())
    resumed.close()


@pytest.mark.parametrize(
    ("sections", "spills"),
    [
        ({}, True),
        ({"zero": {"stage": 1}}, False),
        ({"offload": {"optimizer": "cpu"}}, False),
        ({"optim": {"grad_clip": 0.0}}, False),
        ({"optim": {"grad_clip": 0.0, "overlap": False}}, True),
        ({"optim": {"grad_clip": 0.0}, "precision": {"compute_dtype": "fp16", "loss_scaling": "dynamic"}}, True),
        ({"offload": {"grad_spill": False}}, False),
    ],
)
def test_auto_spills_where_the_update_waits_on_nvme(sections: dict, spills: bool, tmp_path) -> None:
    assert spills_gradients(nvme(tmp_path, "auto", **sections)) is spills


@pytest.mark.parametrize(
    ("sections", "says"),
    [
        ({"offload": {"optimizer": "cpu"}}, 'offload.optimizer = "cpu"'),
        ({"zero": {"stage": 1}}, "zero.stage >= 2"),
        ({"optim": {"grad_clip": 0.0}}, "nothing to spill"),
    ],
)
def test_spill_true_where_it_cannot_is_refused(sections: dict, says: str, tmp_path) -> None:
    with pytest.raises(ConfigError, match=rf"^offload.grad_spill = True: .*{says}"):
        nvme(tmp_path, True, **sections)


def test_the_disk_check_counts_the_spilled_gradients(tmp_path, monkeypatch) -> None:
    import shutil
    from collections import namedtuple

    probe = Engine(tiny_gpt(), nvme(tmp_path / "probe", False), total_steps=1)
    free = store_bytes(probe.layout) + 4096  # the store fits, its spilled gradients do not
    probe.close()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free))
    with pytest.raises(OSError, match=r"spilled gradients \(offload.grad_spill; false keeps them in memory\)"):
        Engine(tiny_gpt(), nvme(tmp_path / "a"), total_steps=1)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    Engine(tiny_gpt(), nvme(tmp_path / "b", False), total_steps=1).close()
