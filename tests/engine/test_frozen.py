"""Frozen parameters (``requires_grad=False``): no gradient, no optimizer state, values kept once.

A GPT with some parameters frozen (the token embedding, every attention, one whole block)
trains bit-identically (fp32, one rank) to ``torch.optim.AdamW`` over its trainable parameters
alone, on every stage and tier; its frozen values never change, survive a resume, and appear in
``consolidate``/``export``; the store holds optimizer state for the trainable units only.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import Config
from engine.engine import Engine
from engine.runtime.device import SIM_ENV
from engine.state.partition import FROZEN_SUFFIX
from engine.tiers.frozen import FROZEN
from engine.tiers.parameters import PARAM_KIND
from engine.tools.consolidate import consolidate
from engine.tools.export import export
from engine.tools.inspect import inspect_store
from offload import IORunner, ShardStore, generation_prefix, unit_arrays
from tests.engine.test_equivalence import BF16_TOLERANCE
from tests.ranks import run_ranks
from tests.training import (
    _snapshot,
    batches,
    change_error,
    config,
    reference_adamw,
    reference_schedule,
    rel_diff,
    tiny_gpt,
)

STEPS = 4
FROZEN_NAMES = ("tok_emb.weight", ".attn.", "blocks.1.")


def frozen_gpt(seed: int = 0) -> torch.nn.Module:
    model = tiny_gpt(seed)
    for name, param in model.named_parameters():
        if any(part in name for part in FROZEN_NAMES):
            param.requires_grad_(False)
    return model


def frozen_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def run_engine(eng: Engine, steps: int, micro_batch: int = 4, skip: int = 0) -> dict:
    """``steps`` steps of ``eng`` on the test data (after skipping ``skip`` steps' batches)."""
    data = batches(micro_batch, eng.comm.rank, eng.comm.world_size)
    for _ in range(skip * eng.config.zero.grad_accum_steps):
        data.next()
    losses, history = [], []
    for _ in range(steps):
        loss = eng(*data.next())
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        with eng.gathered():
            history.append(_snapshot(eng.module))
    return {"losses": losses, "params": history[-1], "history": history}


def train_engine(cfg: Config, steps: int = STEPS, micro_batch: int = 4) -> dict:
    eng = Engine(frozen_gpt(), cfg, total_steps=steps)
    try:
        return run_engine(eng, steps, micro_batch)
    finally:
        eng.close()


def train_engine_on_ranks(cfg: Config, steps: int, micro_batch: int) -> dict:
    return train_engine(cfg, steps, micro_batch)


def train_reference(cfg: Config, steps: int = STEPS, micro_batch: int = 4) -> dict:
    """Plain PyTorch: ``AdamW`` over the trainable parameters only, autocast for bf16."""
    model = frozen_gpt()
    o = cfg.optim
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = reference_adamw(model, o)
    schedule = reference_schedule(opt, o, steps)
    dtype = {"bf16": torch.bfloat16}.get(cfg.precision.compute_dtype)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    data = batches(micro_batch)
    losses, history = [], []
    for _ in range(steps):
        with autocast:
            loss = model(*data.next())
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, o.grad_clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        history.append(_snapshot(model))
    return {"losses": losses, "params": history[-1], "history": history}


def nvme_config(tmp_path: Path, stage: int = 3, **sections: dict) -> Config:
    offload = {"optimizer": "nvme", "param": "nvme" if stage == 3 else "device", "nvme_path": str(tmp_path / "store")}
    return config(zero={"stage": stage, "prefetch_mb": 1}, offload=offload, **sections)


def assert_bit_identical(ours: dict, ref: dict) -> None:
    assert ours["losses"] == ref["losses"]
    for step, (a, b) in enumerate(zip(ours["history"], ref["history"], strict=True)):
        differing = [name for name in b if not torch.equal(a[name], b[name])]
        assert not differing, f"step {step}: parameters differ from torch AdamW: {differing[:3]}"


CASES = [(1, "device", "device"), (1, "nvme", "device"), (2, "cpu", "device"), (2, "nvme", "device")]
CASES += [(3, "device", "device"), (3, "cpu", "cpu"), (3, "nvme", "cpu"), (3, "nvme", "nvme"), (3, "cpu", "nvme")]


@pytest.mark.parametrize(("stage", "optimizer", "param"), CASES)
def test_fp32_one_rank_is_bit_identical_to_adamw_over_the_trainable(stage, optimizer, param, tmp_path) -> None:
    offload = {"optimizer": optimizer, "param": param, "nvme_path": str(tmp_path / "store")}
    cfg = config(zero={"stage": stage, "prefetch_mb": 1}, offload=offload)
    ours = train_engine(cfg)
    ref = train_reference(cfg)
    assert_bit_identical(ours, ref)
    initial = _snapshot(frozen_gpt())
    names = frozen_names(frozen_gpt())
    assert len(names) > 10 and "blocks.2.mlp.fc.weight" not in names
    for snapshot in ours["history"]:
        assert all(torch.equal(snapshot[n], initial[n]) for n in names), "a frozen parameter changed"
    assert not torch.equal(ours["params"]["head.weight"], initial["head.weight"]), "the trainable ones train"


def test_clipping_over_the_trainable_is_bit_identical(tmp_path) -> None:
    cfg = nvme_config(tmp_path, optim={"grad_clip": 0.05})
    assert_bit_identical(train_engine(cfg), train_reference(cfg))


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])  # the default run keeps stage 3
def test_bf16_trains_frozen_parameters_close_to_autocast(stage: int, tmp_path) -> None:
    cfg = nvme_config(tmp_path, stage=stage, precision={"compute_dtype": "bf16"}, optim={"lr": 1e-3})
    ours = train_engine(cfg, steps=8)
    ref = train_reference(cfg, steps=8)
    initial = _snapshot(frozen_gpt())
    frozen = set(frozen_names(frozen_gpt()))
    trainable = [
        {k: v for k, v in params.items() if k not in frozen} for params in (ours["params"], ref["params"], initial)
    ]
    # bf16 parameters against autocast's fp32 ones: measured 0.0487 at stages 1 and 3, within
    # the bound of the unfrozen model (tests.engine.test_equivalence), 3 times over.
    error = change_error(*trainable)
    assert 0 < error < BF16_TOLERANCE, error
    assert ours["losses"][-1] < ours["losses"][0]
    for name in frozen_names(frozen_gpt()):  # held in bf16: the fp32 values rounded once, never changed
        assert torch.equal(ours["params"][name], initial[name].bfloat16().float()), name


def test_two_gloo_ranks_match_one_process(tmp_path) -> None:
    cfg = nvme_config(tmp_path)
    ranks = run_ranks(2, train_engine_on_ranks, cfg, STEPS, 2)
    ref = train_reference(cfg)
    for result in ranks:
        assert rel_diff(result["params"], ref["params"]) <= 1e-6
    initial = _snapshot(frozen_gpt())
    assert all(torch.equal(ranks[1]["params"][n], initial[n]) for n in frozen_names(frozen_gpt()))


def store_arrays(path: Path, prefix: str) -> dict[str, tuple[str, str]]:
    with IORunner(threads=1) as runner:
        return unit_arrays(ShardStore.open(path, runner=runner), prefix)


def test_the_store_holds_optimizer_state_for_the_trainable_only(tmp_path) -> None:
    cfg = nvme_config(tmp_path)
    eng = Engine(frozen_gpt(), cfg, total_steps=STEPS)
    run_engine(eng, 2)
    layout = eng.layout
    eng.close()
    store = tmp_path / "store"
    trainable = {u.name for u in layout.units}
    frozen = {u.name for u in layout.frozen}
    assert "blocks.1" not in trainable and f"blocks.1{FROZEN_SUFFIX}" in frozen
    assert trainable.isdisjoint(frozen) and len(frozen) == 5  # every block's attention, and the embedding
    report = inspect_store(store)
    generation = store_arrays(store, generation_prefix(report["committed"]["generation"]))
    assert {unit for unit, _ in generation.values()} == trainable
    assert sorted(kind for unit, kind in generation.values() if unit == "root") == ["exp_avg", "exp_avg_sq", "master"]
    kept = store_arrays(store, FROZEN)
    assert sorted(kept.values()) == sorted((name, PARAM_KIND) for name in frozen)
    fp32_state = 3 * 4 * sum(u.padded_numel for u in layout.units)
    assert sum(report["bytes_per_kind"].values()) == fp32_state
    assert report["frozen"]["numel"] == layout.frozen_numel > layout.numel // 2
    assert report["frozen"]["bytes"] == 4 * sum(u.padded_numel for u in layout.frozen)
    params = store_arrays(store / "params", "")  # the parameter tier holds the trained units: the frozen are in frozen/
    assert {unit for unit, _ in params.values()} == trainable
    # On disk, the frozen base is there once: the whole store is two generations of fp32 state,
    # the trained units' parameters and the frozen values (each file with a 4-byte CRC per chunk).
    chunks = [f for f in store.rglob("*") if f.is_file() and f.name != "zarr.json" and f.parent.name == "c"]
    expected = 2 * fp32_state + sum(4 * u.padded_numel for u in layout.all_units)  # fp32 compute dtype
    crcs = 4 * len(chunks)
    assert sum(f.stat().st_size for f in chunks) == expected + crcs


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_from_the_store_continues_bit_identically(stage: int, tmp_path) -> None:
    cfg = nvme_config(tmp_path, stage=stage)
    eng = Engine(frozen_gpt(), cfg, total_steps=STEPS)
    first = run_engine(eng, 2)
    eng.close()
    eng = Engine.resume(frozen_gpt(seed=1), cfg, total_steps=STEPS)  # other initial values: all come from the store
    assert eng.global_step == 2
    rest = run_engine(eng, STEPS - 2, skip=2)
    eng.close()
    ref = train_reference(cfg)
    assert_bit_identical({k: first[k] + rest[k] for k in ("losses", "history")}, ref)


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_resume_from_a_cpu_tier_checkpoint_restores_frozen_values(param: str, tmp_path) -> None:
    """With the parameters on nvme the frozen values go to the store as the run is built, and
    are read from there: the checkpoints, the resume and ``consolidate`` read that one copy."""
    cfg = config(zero={"stage": 3}, offload={"optimizer": "cpu", "param": param, "nvme_path": str(tmp_path / "store")})
    eng = Engine(frozen_gpt(), cfg, total_steps=STEPS)
    first = run_engine(eng, 2)
    eng.save("two")
    eng.close()
    eng = Engine.resume(frozen_gpt(seed=1), cfg, total_steps=STEPS, checkpoint="two")
    rest = run_engine(eng, STEPS - 2, skip=2)
    eng.save("four")  # a resumed run's checkpoint shares the frozen values it resumed from
    eng.close()
    assert_bit_identical({k: first[k] + rest[k] for k in ("losses", "history")}, train_reference(cfg))
    eng = Engine.resume(frozen_gpt(seed=1), cfg, total_steps=STEPS, checkpoint="four")
    with eng.gathered():
        assert all(torch.equal(p, rest["params"][n]) for n, p in eng.module.named_parameters())
    eng.close()
    consolidate(tmp_path / "store", tmp_path / "four.safetensors", checkpoint="four")
    weights = load_file(tmp_path / "four.safetensors")
    assert all(torch.equal(weights[n], rest["params"][n]) for n in weights)
    assert inspect_store(tmp_path / "store")["frozen"]["numel"] == eng.layout.frozen_numel


def test_consolidate_and_export_include_frozen_tensors(tmp_path) -> None:
    cfg = nvme_config(tmp_path)
    ours = train_engine(cfg, steps=2)
    store = tmp_path / "store"
    out = tmp_path / "weights.safetensors"
    model = frozen_gpt()
    assert consolidate(store, out) == len(list(model.named_parameters()))
    weights = load_file(out)
    assert weights.keys() == ours["params"].keys()
    assert all(torch.equal(weights[n], ours["params"][n]) for n in weights)
    hf = store / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "test"}))
    (hf / "source.json").write_text(json.dumps({"folder": str(tmp_path), "dtype": "fp32"}))
    [name] = export(store, tmp_path / "export")
    exported = load_file(tmp_path / "export" / name)
    assert all(torch.equal(exported[n], ours["params"][n]) for n in ours["params"])


def test_freezing_after_the_engine_is_built_is_refused(tmp_path) -> None:
    eng = Engine(frozen_gpt(), config(), total_steps=STEPS)
    data = batches(4)
    eng.module.head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"'head\.weight' is frozen since the engine was built"):
        eng.backward(eng(*data.next()))
    eng.close()


def test_a_model_with_nothing_to_train_is_refused() -> None:
    model = tiny_gpt()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter of the model requires grad"):
        Engine(model, config())


def test_a_store_of_two_ranks_resumes_on_one(tmp_path) -> None:
    cfg = nvme_config(tmp_path)
    [ranks_result, _] = run_ranks(2, train_engine_on_ranks, cfg, 2, 2)
    eng = Engine.resume(frozen_gpt(seed=1), cfg, total_steps=STEPS)  # frozen shards cut for two ranks, read by one
    with eng.gathered():
        restored = _snapshot(eng.module)
    assert all(torch.equal(restored[n], ranks_result["params"][n]) for n in restored)
    initial = _snapshot(frozen_gpt())
    assert all(torch.equal(restored[n], initial[n]) for n in frozen_names(frozen_gpt()))
    after = run_engine(eng, 1, skip=2)
    eng.close()
    assert rel_diff(after["params"], train_reference(cfg, steps=3)["params"]) <= 1e-6


@pytest.mark.parametrize(
    ("stage", "optimizer", "param"), [(1, "cpu", "device"), (3, "cpu", "device"), (3, "nvme", "nvme")]
)
def test_late_copies_save_and_resume_bit_identically(stage, optimizer, param, tmp_path, monkeypatch) -> None:
    """On the simulated device, whose copies land late: training, a checkpoint of the frozen
    values from the parameters, and their restore on resume."""
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=1")
    offload = {"optimizer": optimizer, "param": param, "nvme_path": str(tmp_path / "store")}
    cfg = config(zero={"stage": stage, "prefetch_mb": 1}, offload=offload)
    eng = Engine(frozen_gpt(), cfg, total_steps=STEPS)
    first = run_engine(eng, 2)
    eng.save("two")
    eng.close()
    eng = Engine.resume(frozen_gpt(seed=1), cfg, total_steps=STEPS, checkpoint="two")
    rest = run_engine(eng, STEPS - 2, skip=2)
    eng.close()
    assert_bit_identical({k: first[k] + rest[k] for k in ("losses", "history")}, train_reference(cfg))
