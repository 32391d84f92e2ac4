"""bf16 master weights (``optim.master_dtype = "bf16"``): they track torch's fp32 AdamW, move
on average by updates far below their ulp, resume bit-identically in their own form and are
refused in another; at stage 3 with the parameters on nvme the master is the parameter (cast
on its way to the device where the compute dtype is wider), so a store of int8 moments and bf16
masters holds and moves the fewest bytes; consolidate and export widen them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from engine.config import Config
from engine.engine import Engine
from engine.tools.consolidate import consolidate
from engine.tools.estimate import Plan, estimate_plans, plan_of, run_shape, store_bytes
from engine.tools.estimate.terms import step_io_bytes
from engine.tools.export import export
from engine.tools.inspect import format_report, inspect_store
from engine.zero.compact_update import CompactAdamW
from engine.zero.optim import ShardAdamW
from engine.zero.params import ShardedParams
from engine.zero.unit_params import UnitState
from tests.engine.test_crafted_stores import snapshot
from tests.engine.test_resume import params, run
from tests.engine.test_state_dtype import TRACKED, state_bytes
from tests.ranks import run_ranks
from tests.training import change_error, config, tiny_gpt, train_engine, train_reference

STEPS = 8
TRACK_TOLERANCE = 0.3
"""Largest ``||engine - torch|| / ||torch - initial||`` after ``STEPS`` steps with bf16 masters
(measured as ``tests.engine.test_state_dtype`` does). A bf16 master carries 8 significant bits:
the tiny GPT's LayerNorm gains sit at 1.0, whose ulp (2**-7) is 26 times a step at lr 3e-4, so
stochastic rounding moves each by a whole ulp with a probability of about 1/26 a step: unbiased,
but noisy over a few steps. Measured 0.197 on every tier and stage (the matrices, whose ulp is
below a step, follow torch within a few percent; the gains make the rest), 0.211 with int8
moments and bf16 compute at stage 3. 0.3 leaves room for the noise; masters never updated, or
updates never stored, are at 1.0."""


def shared(tmp_path: Path, mode: str = "in-place", **optim: object) -> Config:
    """Stage 3, optimizer and parameters on nvme, bf16 compute, int8 moments and bf16 masters
    (``optim`` overrides): the masters are the parameters."""
    return config(
        zero={"stage": 3},
        offload={"optimizer": "nvme", "param": "nvme", "nvme_path": str(tmp_path / "store")},
        precision={"compute_dtype": "bf16"},
        optim={"state_dtype": "int8", "master_dtype": "bf16"} | optim,
        store={"mode": mode},
    )


def tracking_error(cfg: Config) -> tuple[float, list[float]]:
    got = train_engine(cfg, STEPS)
    expected = train_reference(cfg, STEPS, micro_batch=4)
    initial = {n: p.detach().clone() for n, p in tiny_gpt().named_parameters()}
    return change_error(got["params"], expected["params"], initial), got["losses"]


@pytest.mark.parametrize(("tier", "stage"), TRACKED)
def test_bf16_masters_track_torch_adamw(tmp_path, stage: int, tier: str) -> None:
    offload = {"optimizer": tier, "nvme_path": str(tmp_path / "store")}
    error, losses = tracking_error(config(zero={"stage": stage}, offload=offload, optim={"master_dtype": "bf16"}))
    assert 0 < error < TRACK_TOLERANCE, error
    assert losses[-1] < losses[0]


@pytest.mark.slow  # bf16 compute on a CPU: about 25 s
def test_shared_bf16_masters_track_torch_adamw(tmp_path) -> None:
    error, losses = tracking_error(shared(tmp_path, "generations"))
    assert 0 < error < TRACK_TOLERANCE, error
    assert losses[-1] < losses[0]
    assert not (tmp_path / "store" / "params").exists(), "the parameters are the masters: no copy of their own"


def test_a_bf16_master_moves_on_average_by_updates_below_its_ulp() -> None:
    """Weights at 1.0 (ulp 2**-7) under a constant gradient, at an lr whose steps are 1/20 of an
    ulp: rounding to nearest would never move them; stochastically rounded, their mean follows
    fp32 AdamW's within 2% after 100 steps (about 5 ulps)."""
    n, lr, steps = 1 << 14, 4e-4, 100
    config = Config().optim
    fp32, bf16 = ShardAdamW(config), CompactAdamW(config)
    wide, narrow = torch.ones(n), torch.ones(n, dtype=torch.bfloat16)
    moments = [torch.zeros(n) for _ in range(4)]
    grad = torch.full((n,), 0.5)
    counters = [fp32.new_step_counter(torch.device("cpu")), bf16.new_step_counter(torch.device("cpu"))]
    for _ in range(steps):
        fp32.update(wide, grad, moments[0], moments[1], counters[0], lr)
        bf16.update(narrow, grad, moments[2], moments[3], counters[1], lr)
    moved = 1.0 - wide[0].item()
    assert moved > 4 * 2**-7
    assert abs((1.0 - narrow.float().mean().item()) / moved - 1) < 0.02
    assert narrow.unique().numel() > 1, "each weight rounds on its own draw"


@pytest.mark.parametrize(("optimizer", "compute"), [("cpu", "bf16"), ("nvme", "bf16"), ("nvme", "fp32")])
def test_parameters_read_from_the_masters_train_as_a_copy_does(tmp_path, optimizer: str, compute: str) -> None:
    """The parameter tier reading the bf16 masters (on the optimizer's tier, memory or store)
    gives the bits of parameters kept as a copy in memory (``offload.param = "cpu"``), in fp32
    too, where the copy to the device widens them."""
    results = []
    for param in ("nvme", "cpu"):
        cfg = shared(tmp_path / param).to_dict()
        cfg["offload"] |= {"optimizer": optimizer, "param": param}
        cfg["precision"]["compute_dtype"] = compute
        results.append(train_engine(Config.from_dict(cfg), 3))
    assert not (tmp_path / "nvme" / "store" / "params").exists(), "no copy on disk"
    shared_run, copied = results
    assert shared_run["losses"] == copied["losses"]
    assert all(torch.equal(shared_run["params"][k], copied["params"][k]) for k in copied["params"])


# The default run keeps in-place.
@pytest.mark.parametrize("mode", [pytest.param("generations", marks=pytest.mark.slow), "in-place"])
def test_shared_bf16_masters_resume_bit_identically(tmp_path, mode: str) -> None:
    straight = Engine(tiny_gpt(), shared(tmp_path / "a", mode), total_steps=4)
    expected_losses, expected = run(straight, 4), params(straight)
    straight.close()
    first = Engine(tiny_gpt(), shared(tmp_path / "b", mode), total_steps=4)
    losses = run(first, 2)
    first.close()
    resumed = Engine.resume(tiny_gpt(), shared(tmp_path / "b", mode), total_steps=4)
    losses += run(resumed, 2)
    got = params(resumed)
    resumed.close()
    assert losses == expected_losses
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def stop_and_resume_on_ranks(root: str, stop: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Entry point for ``run_ranks``: train ``steps`` steps, closing and resuming after ``stop``.

    Both engines join one process group made first (as ``tests.engine.test_reshard.run_tasks``
    does): each engine making its own group in turn re-runs the ``env://`` rendezvous on the
    same port in the same processes, where gloo's connection of the second group now and then
    waited forever (here about one run in two hung in ``ProcessGroupGloo``'s constructor)."""
    dist.init_process_group("gloo")
    try:
        eng = Engine(tiny_gpt(), shared(Path(root), "generations"), total_steps=steps)
        losses = run(eng, stop)
        if stop < steps:
            eng.close()
            eng = Engine.resume(tiny_gpt(), shared(Path(root), "generations"), total_steps=steps)
            losses += run(eng, steps - stop)
        got = params(eng)
        eng.close()
        return losses, got
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes computing in bf16 on a CPU: about 25 s
def test_two_ranks_of_shared_bf16_masters_resume_bit_identically(tmp_path) -> None:
    straight = run_ranks(2, stop_and_resume_on_ranks, str(tmp_path / "a"), 4, 4)
    resumed = run_ranks(2, stop_and_resume_on_ranks, str(tmp_path / "b"), 2, 4)
    for (losses, got), (expected_losses, expected) in zip(resumed, straight, strict=True):
        assert losses == expected_losses
        assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.slow  # kept out of the default run's 10 minutes; CI runs it with the slow ones
def test_a_store_of_two_ranks_resumes_on_one_reading_its_masters_range_by_range(tmp_path) -> None:
    """The parameters of one rank resuming a store cut for two are read from the masters as
    they are stored (shards of the other layout) until its first step writes its own."""
    [(_, trained), _] = run_ranks(2, stop_and_resume_on_ranks, str(tmp_path), 2, 2)
    resumed = Engine.resume(tiny_gpt(), shared(tmp_path, "generations"), total_steps=3)
    got = params(resumed)
    assert all(torch.equal(got[k], trained[k]) for k in trained)
    run(resumed, 1)
    resumed.close()


def test_bf16_masters_resume_bit_identically_at_stage_2(tmp_path) -> None:
    def cfg(name: str) -> Config:
        offload = {"optimizer": "nvme", "nvme_path": str(tmp_path / name)}
        return config(zero={"stage": 2}, offload=offload, optim={"master_dtype": "bf16"})

    straight = Engine(tiny_gpt(), cfg("a"), total_steps=4)
    expected_losses, expected = run(straight, 4), params(straight)
    straight.close()
    first = Engine(tiny_gpt(), cfg("b"), total_steps=4)
    losses = run(first, 2)
    first.close()
    resumed = Engine.resume(tiny_gpt(), cfg("b"), total_steps=4)
    losses += run(resumed, 2)
    got = params(resumed)
    resumed.close()
    assert losses == expected_losses
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize(("written", "asked"), [("bf16", "fp32"), ("fp32", "bf16")])
def test_resume_with_another_master_dtype_is_refused_untouched(tmp_path, written: str, asked: str) -> None:
    eng = Engine(tiny_gpt(), shared(tmp_path, master_dtype=written), total_steps=2)
    run(eng, 1)
    eng.close()
    before = snapshot(tmp_path)
    expected = rf"master_dtype = '{written}', this run asks for '{asked}': set optim.master_dtype = '{written}'"
    with pytest.raises(ValueError, match=expected) as refused:
        Engine.resume(tiny_gpt(), shared(tmp_path, master_dtype=asked), total_steps=2)
    assert "\n" not in str(refused.value)
    assert snapshot(tmp_path) == before


def test_estimate_counts_a_shared_master_once_in_any_compute_dtype(tmp_path) -> None:
    """Against fp32 masters with their copy: 2 B/param less master and no 2 B/param copy on
    disk; in a step's I/O 2 x 2 less state and no copy written. Computing in fp32, the gathers
    still read the 2-byte masters: the step moves the same bytes as in bf16."""
    plan = Plan(3, "nvme", "nvme")
    (bf16, fp32) = (run_shape(shared(tmp_path, master_dtype=m), 1, model=tiny_gpt()) for m in ("bf16", "fp32"))
    numel = bf16.layout.numel
    padded = sum(u.padded_numel for u in bf16.layout.units)
    assert store_bytes(fp32, plan) - store_bytes(bf16, plan) == 2 * padded + 2 * padded
    shards = sum(u.shard_numel for u in bf16.layout.units)
    assert step_io_bytes(fp32, plan) - step_io_bytes(bf16, plan) == 2 * 2 * shards + 2 * shards
    assert 12 < step_io_bytes(bf16, plan) / numel < 12.5  # gathers read 4, the state 2 x 4.03, padding aside
    raw = shared(tmp_path).to_dict()
    raw["precision"]["compute_dtype"] = "fp32"
    wide = run_shape(Config.from_dict(raw), 1, model=tiny_gpt())
    assert step_io_bytes(wide, plan) == step_io_bytes(bf16, plan)
    assert store_bytes(wide, plan) == store_bytes(bf16, plan)
    [estimate] = estimate_plans(wide, baseline_bytes=0, plans=[plan])
    assert estimate.refused == ""


def on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_int8_moments_and_shared_bf16_masters_store_and_move_the_fewest_bytes(tmp_path) -> None:
    """Stage 3, optimizer and parameters on nvme, in place, no clipping: at most 5 B/param stored
    (2 master + 2 x 1.02 moments, padding aside) and 12 moved per step (the state read and
    written, 2 x 4.03, and a parameter read per gather, 2 each; none written). The separate
    copy of fp32 masters is beside it for comparison (8 stored, 18 moved, less the first units'
    reads: they go up for the next forward from the copy's writes, in memory)."""
    sizes, sent_ahead = {}, 0
    for master in ("bf16", "fp32"):
        cfg = shared(tmp_path / master, master_dtype=master)
        eng = Engine(tiny_gpt(), cfg, total_steps=3)
        run(eng, 2)
        stats, numel = eng.last_step_stats, eng.layout.numel
        params = eng.params
        assert isinstance(params, ShardedParams)
        ahead = [n for n, s in params.state.items() if s is not UnitState.SHARDED and not params.unit(n).persistent]
        assert bool(ahead) == (master == "fp32"), "a shared master is never sent ahead: its write is the optimizer's"
        sent_ahead += sum(2 * eng.layout.unit(n).shard_numel for n in ahead) / numel
        eng.close()
        store = tmp_path / master / "store"
        stored = state_bytes(store) + on_disk(store / "params") if (store / "params").exists() else state_bytes(store)
        moved = stats.bytes_read + stats.bytes_written
        sizes[master] = stored / numel, moved / numel
        assert stored <= 1.01 * store_bytes(run_shape(cfg, 1, model=tiny_gpt()), plan_of(cfg))  # CRCs aside
        assert moved <= step_io_bytes(run_shape(cfg, 1, model=tiny_gpt()), plan_of(cfg))
    (stored_bf16, moved_bf16), (stored_fp32, moved_fp32) = sizes["bf16"], sizes["fp32"]
    assert stored_bf16 <= 5 and moved_bf16 <= 12, sizes
    assert stored_fp32 - stored_bf16 > 3.9, "2 B/param of master and the 2 B/param copy are gone"
    assert moved_fp32 + sent_ahead - moved_bf16 > 5.9, "2 B/param less state read and written, no copy written"


def test_computing_in_fp32_the_gathers_read_the_2_byte_masters(tmp_path) -> None:
    """The masters are read as they are stored and widened in the copy to the device: a step
    moves what it moves computing in bf16 (at most 12 B/param, as above), not 4-byte shards."""
    raw = shared(tmp_path).to_dict()
    raw["precision"]["compute_dtype"] = "fp32"
    cfg = Config.from_dict(raw)
    eng = Engine(tiny_gpt(), cfg, total_steps=3)
    run(eng, 2)
    stats, numel = eng.last_step_stats, eng.layout.numel
    eng.close()
    moved = stats.bytes_read + stats.bytes_written
    assert moved <= step_io_bytes(run_shape(cfg, 1, model=tiny_gpt()), plan_of(cfg))
    assert moved / numel <= 12
    assert not (tmp_path / "store" / "params").exists()


def test_inspect_consolidate_and_export_widen_bf16_masters(tmp_path) -> None:
    eng = Engine(tiny_gpt(), shared(tmp_path), total_steps=2)
    run(eng, 2)
    trained = params(eng)
    eng.close()
    store = tmp_path / "store"
    report = inspect_store(store)
    assert report["master_dtype"] == "bf16" and report["state_dtype"] == "int8"
    assert report["bytes_per_kind"]["master"] == report["bytes_per_kind"]["exp_avg"] * 2 * 256 / 260
    assert "master_dtype = 'bf16'" in format_report(report)
    assert consolidate(store, tmp_path / "model.safetensors") == len(trained)
    weights = load_file(tmp_path / "model.safetensors")
    assert all(weights[n].dtype == torch.float32 and torch.equal(weights[n], trained[n].float()) for n in trained)
    hf = store / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "test"}))
    (hf / "source.json").write_text(json.dumps({"folder": str(tmp_path), "dtype": "bf16"}))
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        [name] = export(store, tmp_path / dtype, dtype=dtype)
        exported = load_file(tmp_path / dtype / name)
        assert all(torch.equal(exported[n], trained[n].to(torch_dtype)) for n in trained)
