"""Spilled gradient shards stored as bfloat16 (``offload.grad_spill_dtype = "bf16"``): they track
the in-memory clipped run, resume bit-identically, take half the scratch disk and spill I/O,
are counted so by ``estimate``, and are refused where nothing is spilled."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import Config, ConfigError
from engine.engine import Engine
from engine.tiers.grad_spill import GRAD, scratch_path
from engine.tools.estimate import Plan, estimate_plans, plan_of, run_shape
from engine.tools.estimate.terms import scratch_bytes, spill_staging_bytes, step_io_bytes
from offload import TOP, ShardStore, array_name
from tests.engine.test_grad_spill import nvme
from tests.engine.test_resume import params, run
from tests.engine.test_state_dtype import change_error
from tests.training import batches, tiny_gpt, train_engine

STEPS = 8
TRACK_TOLERANCE = 0.01
"""Largest ``||bf16 spill - in memory|| / ||in memory - initial||`` after ``STEPS`` clipped steps.
A bf16 gradient carries 8 significant bits, rounded to nearest, so each step's gradient is
off by at most 2**-9 relative, and Adam's ``m / sqrt(v)`` passes that on; measured here,
0.079% at stages 2 and 3 (0.11% when the spill rounded stochastically). 1% leaves room for the
error to add up differently, while rounding the update's gradient wrongly (say, a truncation
that biases every value) or clipping with a norm taken after rounding would not show as an
error this small in the masters' bits."""


def bf16(tmp_path, spill: bool | str = True, **sections: dict) -> Config:
    """``nvme`` (clipped, spilled unless ``spill`` is False) with bf16 spilled shards."""
    offload = sections.pop("offload", {})
    return nvme(tmp_path, spill, offload={"grad_spill_dtype": "bf16"} | offload, **sections)


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # the default run keeps stage 3
def test_bf16_spill_tracks_the_in_memory_clipped_run(stage: int, tmp_path) -> None:
    got = train_engine(bf16(tmp_path / "a", zero={"stage": stage}), STEPS)
    expected = train_engine(nvme(tmp_path / "b", False, zero={"stage": stage}), STEPS)
    initial = {n: p.detach().clone() for n, p in tiny_gpt().named_parameters()}
    error = change_error(got["params"], expected["params"], initial)
    assert 0 < error < TRACK_TOLERANCE, error
    assert got["losses"][-1] < got["losses"][0]


def test_fp32_spill_is_the_default() -> None:
    assert Config().offload.grad_spill_dtype == "fp32"


def test_bf16_spill_resumes_bit_identically(tmp_path) -> None:
    straight = Engine(tiny_gpt(), bf16(tmp_path / "a"), total_steps=6)
    expected_losses, expected = run(straight, 6), params(straight)
    straight.close()
    first = Engine(tiny_gpt(), bf16(tmp_path / "b"), total_steps=6)
    losses = run(first, 3)
    first.close()
    resumed = Engine.resume(tiny_gpt(), bf16(tmp_path / "b"), total_steps=6)
    losses += run(resumed, 3)
    got = params(resumed)
    resumed.close()
    assert losses == expected_losses
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def spilled_step(cfg: Config) -> dict:
    """One step's bytes read and written, the scratch store's bytes on disk after backward,
    the first unit's spilled shard as stored, and the rank's shard elements."""
    eng = Engine(tiny_gpt(), cfg, total_steps=2)
    eng.backward(eng(*batches(4).next()))
    assert eng.step_control.spill is not None
    _ = eng.step_control.found_inf  # every shard handed to the spill (on a GPU its host worker spills them)
    eng.step_control.spill.pipeline.drain()  # the spill's writes have landed
    root = scratch_path(cfg.offload.nvme_path, 0)
    unit = eng.layout.units[0]
    store = ShardStore.open(root, runner=eng.io.runner)
    stored = torch.empty(unit.shard_numel, dtype=store.array_info(array_name(TOP, unit.name, GRAD)).dtype)
    store.read_into(array_name(TOP, unit.name, GRAD), 0, stored)
    meta = json.loads((root / array_name(TOP, unit.name, GRAD) / "zarr.json").read_text())
    out = {
        "zarr_dtype": meta["data_type"],
        "disk": sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and f"/{GRAD}/" in str(f)),
        "shard": stored,
        "numel": sum(u.shard_numel for u in eng.layout.units),
    }
    eng.step()
    stats = eng.last_step_stats
    out |= {"read": stats.bytes_read, "written": stats.bytes_written, "norm": eng.step_control.last_grad_norm}
    eng.close()
    return out


def test_bf16_scratch_holds_bfloat16_in_half_the_bytes(tmp_path) -> None:
    fp32, half = spilled_step(nvme(tmp_path / "a")), spilled_step(bf16(tmp_path / "b"))
    assert fp32["shard"].dtype == torch.float32 and half["shard"].dtype == torch.bfloat16
    assert fp32["zarr_dtype"] == "float32" and half["zarr_dtype"] == "uint16"  # bfloat16's bits, as zarr stores them
    assert half["shard"].view(torch.uint16).any()
    # each stored value is the fp32 gradient moved by less than one bf16 step
    step = fp32["shard"].abs() * 2**-7
    assert ((half["shard"].float() - fp32["shard"]).abs() <= step).all()
    assert half["norm"] == fp32["norm"], "the norm is taken from the fp32 shard, before it is rounded"
    assert half["disk"] == pytest.approx(fp32["disk"] / 2, rel=0.01), (half["disk"], fp32["disk"])  # CRCs aside
    # the step reads and writes the same optimizer state; the spill 2 B/param each way, not 4
    assert fp32["read"] - half["read"] == fp32["written"] - half["written"] == 2 * half["numel"]


def test_estimate_counts_two_bytes_a_parameter(tmp_path) -> None:
    cfgs = {dtype: nvme(tmp_path, offload={"grad_spill_dtype": dtype}) for dtype in ("fp32", "bf16")}
    runs = {dtype: run_shape(cfg, 1, model=tiny_gpt()) for dtype, cfg in cfgs.items()}
    plan = plan_of(cfgs["fp32"])
    padded = runs["fp32"].padded
    assert scratch_bytes(runs["fp32"], plan) == 4 * padded and scratch_bytes(runs["bf16"], plan) == 2 * padded
    assert step_io_bytes(runs["fp32"], plan) - step_io_bytes(runs["bf16"], plan) == 2 * 2 * padded
    assert spill_staging_bytes(runs["bf16"]) * 2 == spill_staging_bytes(runs["fp32"]) > 0
    # a plan that cannot spill is sized and judged as the fp32 run's, not refused for the key
    estimates = {
        dtype: {e.plan: e for e in estimate_plans(shape, baseline_bytes=0, device_is_host=True)}
        for dtype, shape in runs.items()
    }
    assert estimates["bf16"][Plan(2, "cpu")] == estimates["fp32"][Plan(2, "cpu")]
    assert not estimates["bf16"][Plan(2, "cpu")].refused and not estimates["bf16"][Plan(2, "nvme")].refused


@pytest.mark.parametrize(
    "sections",
    [
        {"offload": {"optimizer": "cpu"}},
        {"offload": {"grad_spill": False}},
        {"zero": {"stage": 1}},
        {"optim": {"grad_clip": 0.0}},
    ],
)
def test_bf16_where_nothing_is_spilled_is_refused(sections: dict, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r'^offload.grad_spill_dtype = .bf16.: .*set grad_spill_dtype = "fp32"$'):
        bf16(tmp_path, "auto", **sections)
