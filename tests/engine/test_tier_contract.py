"""The contract every tier keeps, checked on every tier through the same cases (as zarr's
``StoreTests`` checks every store): optimizer tiers (``device``, ``cpu``, ``nvme`` by
generations, ``nvme`` in place), parameter tiers (``device``, ``cpu``, ``nvme``) and the gradient
spill.

A new tier joins by adding a ``Kind`` below; it then passes these or it is not a tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.runtime.budget import DeviceBudget
from engine.runtime.detect import detect_device
from engine.runtime.sizes import MIB
from engine.state.forms import FP32_STATE, STATE_KINDS, ShardState
from engine.state.partition import ModelLayout, UnitLayout, build_layout
from engine.tiers.checkpoint import FrozenShards, MemoryCheckpoints
from engine.tiers.frozen import FrozenAdder, read_frozen, read_frozen_async
from engine.tiers.optimizer import MemoryOptimizerState, OptimizerState
from engine.tiers.optimizer_store import StoreOptimizerState
from engine.tiers.parameters import PARAM_KIND, MemoryParamTier, ParamTier, StoreParamTier
from engine.tiers.store_io import StoreIO
from offload import TOP, IORunner, ShardStore, read_shard, unit_arrays

SIZES = (3000, 1000, 5000)  # elements per unit: shards padded to their chunks


def small_layout() -> ModelLayout:
    units = {f"unit{i}": [("weight", nn.Parameter(torch.empty(n, device="meta")))] for i, n in enumerate(SIZES)}
    return build_layout(units, world_size=1, max_chunk_numel=MIB // 4)


def master_of(unit: UnitLayout, seed: int) -> torch.Tensor:
    """A unit's master shard, distinct per unit and per seed (padding zero, as the engine's)."""
    values = torch.zeros(unit.shard_numel)
    values[: unit.numel] = torch.arange(unit.numel, dtype=torch.float32) * 0.5 + seed + SIZES.index(unit.numel)
    return values


@pytest.fixture
def io() -> Iterator[StoreIO]:
    store_io = StoreIO(IORunner(threads=2), checksum=True, direct_io=False, barrier=lambda: None)
    yield store_io
    store_io.close()


# ------------------------------------------------------------------ optimizer tiers


@dataclass(frozen=True)
class OptimizerKind:
    """How to open one optimizer tier over the store at ``path``."""

    name: str

    @property
    def on_disk(self) -> bool:
        return self.name.startswith("nvme")

    def open(
        self,
        path: Path,
        layout: ModelLayout,
        io: StoreIO,
        checkpoint: str | None = None,
        resume: bool = False,
        frozen: FrozenShards = lambda: iter(()),
    ):
        if self.on_disk:
            mode = "in-place" if self.name == "nvme in-place" else "generations"
            return StoreOptimizerState(
                path,
                layout,
                0,
                io,
                buffer_bytes=4 * MIB,
                resume=resume or checkpoint is not None,
                checkpoint=checkpoint,
                mode=mode,
            )

        def checkpoints(create: bool) -> MemoryCheckpoints:
            return MemoryCheckpoints(path, layout, 0, io, create=create, frozen=frozen)

        state = MemoryOptimizerState(torch.device("cpu"), checkpoints)
        if checkpoint is not None:
            state.restore(checkpoint)
        return state


OPTIMIZER_KINDS = [OptimizerKind(n) for n in ("device", "cpu", "nvme generations", "nvme in-place")]


@pytest.fixture(params=OPTIMIZER_KINDS, ids=lambda k: k.name)
def kind(request) -> OptimizerKind:
    return request.param


def new_tier(kind: OptimizerKind, path: Path, layout: ModelLayout, io: StoreIO) -> OptimizerState:
    """A tier with every unit added (``master_of(unit, 0)``) and committed as step 0."""
    tier = kind.open(path, layout, io)
    for unit in layout.units:
        tier.add(unit, master_of(unit, 0))
    tier.commit({"step": 0})
    return tier


def step(tier: OptimizerState, layout: ModelLayout, seed: int) -> None:
    """Read every unit, set its state from ``seed`` and write it back (no commit)."""
    for unit, state in tier.read(layout.units):
        state.master.copy_(master_of(unit, seed))
        state.exp_avg.fill_(seed)
        state.exp_avg_sq.fill_(seed * 2)
        tier.write_back(unit, state)


def held(tier: OptimizerState, layout: ModelLayout, record: dict) -> dict[str, list[torch.Tensor]]:
    """Every unit's state as a read gives it (copied), in a step that changes nothing, committed
    with ``record``."""
    values = {}
    for unit, state in tier.read(layout.units):
        values[unit.name] = [t.clone() for t in state.tensors()]
        tier.write_back(unit, state)
    tier.commit(record)
    return values


def assert_reopens(kind, path, layout, io, seed: int, *, step: int | None = None, **how) -> None:
    """The tier reopened at ``path`` (``resume=True`` or ``checkpoint=tag``) holds the state of
    ``seed``, and says it resumed from ``step`` when one is given."""
    resumed = kind.open(path, layout, io, **how)
    if step is not None:
        assert resumed.resumed_from is not None and resumed.resumed_from["step"] == step
    assert_state(held(resumed, layout, {"step": 99}), expected(layout, seed))
    resumed.close()


def expected(layout: ModelLayout, seed: int) -> dict[str, list[torch.Tensor]]:
    moments = (float(seed), float(seed * 2))
    return {u.name: [master_of(u, seed), *(torch.full((u.shard_numel,), m) for m in moments)] for u in layout.units}


def assert_state(got: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        for kind_name, a, b in zip(STATE_KINDS, got[name], want[name], strict=True):
            assert torch.equal(a, b), f"{name}/{kind_name}"


def test_added_units_read_back_with_zero_moments(kind, tmp_path, io) -> None:
    layout = small_layout()
    tier = new_tier(kind, tmp_path / "store", layout, io)
    assert_state(held(tier, layout, {"step": 99}), expected(layout, 0))
    assert [u.name for u, _ in tier.read_masters()] == [u.name for u in layout.units]
    tier.close()


def test_written_back_state_reads_back_after_the_commit(kind, tmp_path, io) -> None:
    layout = small_layout()
    tier = new_tier(kind, tmp_path / "store", layout, io)
    step(tier, layout, seed=3)
    tier.commit({"step": 1})
    assert_state(held(tier, layout, {"step": 99}), expected(layout, 3))
    masters = {unit.name: master.clone() for unit, master in tier.read_masters()}
    assert all(torch.equal(masters[u.name], master_of(u, 3)) for u in layout.units)
    tier.close()


def test_units_are_read_in_the_order_asked(kind, tmp_path, io) -> None:
    layout = small_layout()
    tier = new_tier(kind, tmp_path / "store", layout, io)
    order = [layout.units[2], layout.units[0], layout.units[1]]
    seen = []
    for unit, state in tier.read(order):
        seen.append(unit.name)
        assert torch.equal(state.master, master_of(unit, 0))
        tier.write_back(unit, state)
    tier.commit({"step": 1})
    assert seen == [u.name for u in order]
    tier.close()


def test_a_saved_checkpoint_resumes_with_its_values_on_a_new_tier(kind, tmp_path, io) -> None:
    layout = small_layout()
    path = tmp_path / "store"
    tier = new_tier(kind, path, layout, io)
    step(tier, layout, seed=4)
    tier.commit({"step": 1})
    pending = tier.save("one", lambda: {"step": 1}, keep=0)
    step(tier, layout, seed=5)  # the next step: the checkpoint keeps step 1
    if pending is not None:
        pending.commit()
    tier.commit({"step": 2})
    tier.close()
    assert_reopens(kind, path, layout, io, 4, step=1, checkpoint="one")


def test_frozen_units_are_kept_once_without_state_and_read_back_on_resume(kind, tmp_path, io) -> None:
    frozen = {"unit1.frozen": [("bias", nn.Parameter(torch.empty(2500, device="meta"), requires_grad=False))]}
    units = {"unit0": [("weight", nn.Parameter(torch.empty(3000, device="meta")))]}
    layout = build_layout(units, world_size=1, max_chunk_numel=MIB // 4, frozen=frozen)
    [unit], [fixed] = layout.units, layout.frozen
    assert not fixed.trainable and layout.all_units == (unit, fixed)
    values = torch.arange(fixed.shard_numel, dtype=torch.bfloat16)
    path = tmp_path / "store"
    tier = kind.open(path, layout, io, frozen=lambda: iter([(fixed, values)]))
    tier.add(unit, master_of(unit, 0))
    tier.add(fixed, values)  # the compute-dtype shard: no master, no moments
    tier.commit({"step": 0})
    pending = tier.save("zero", lambda: {"step": 0}, keep=0)
    if pending is not None:
        pending.commit()
    tier.close()
    resumed = kind.open(path, layout, io, checkpoint="zero")
    read = {u.name: t.clone() for u, t in resumed.read_masters()}
    assert list(read) == ["unit0", "unit1.frozen"]
    assert read["unit1.frozen"].dtype == torch.bfloat16 and torch.equal(read["unit1.frozen"], values)
    resumed.close()


def test_a_durable_tier_resumes_from_its_last_commit(kind, tmp_path, io) -> None:
    layout = small_layout()
    path = tmp_path / "store"
    tier = new_tier(kind, path, layout, io)
    assert tier.durable is kind.on_disk
    if not kind.on_disk:
        assert tier.resumed_from is None
        return  # held in memory: only a checkpoint outlives the tier
    step(tier, layout, seed=6)
    tier.commit({"step": 1})
    step(tier, layout, seed=7)
    tier.commit({"step": 2})
    tier.close()
    assert_reopens(kind, path, layout, io, 7, step=2, resume=True)


def test_a_deferred_commit_lands_at_flush(kind, tmp_path, io) -> None:
    layout = small_layout()
    path = tmp_path / "store"
    tier = new_tier(kind, path, layout, io)
    step(tier, layout, seed=8)
    tier.commit({"step": 1}, defer=True)
    assert tier.commit_pending is kind.on_disk
    tier.flush()
    assert not tier.commit_pending
    if not kind.on_disk:
        assert_state(held(tier, layout, {"step": 2}), expected(layout, 8))
    tier.close()
    if kind.on_disk:
        assert_reopens(kind, path, layout, io, 8, step=1, resume=True)


def test_close_commits_a_deferred_step(kind, tmp_path, io) -> None:
    layout = small_layout()
    path = tmp_path / "store"
    tier = new_tier(kind, path, layout, io)
    step(tier, layout, seed=9)
    tier.commit({"step": 1}, defer=True)
    tier.close()
    assert not tier.commit_pending
    if kind.on_disk:
        assert_reopens(kind, path, layout, io, 9, step=1, resume=True)


def test_discard_step_never_commits_the_step(kind, tmp_path, io) -> None:
    layout = small_layout()
    path = tmp_path / "store"
    tier = new_tier(kind, path, layout, io)
    step(tier, layout, seed=10)
    tier.commit({"step": 1})
    pending = tier.save("before", lambda: {"step": 1}, keep=0)
    if pending is not None:
        pending.commit()
    step(tier, layout, seed=11)
    where = tier.discard_step()
    assert isinstance(where, str) and where
    tier.close()
    if kind.name == "nvme generations":  # the store still holds step 1 as its last commit
        assert "its last committed step" in where
        assert_reopens(kind, path, layout, io, 10, step=1, resume=True)
    assert_reopens(kind, tmp_path / "store", layout, io, 10, checkpoint="before")  # every tier: its checkpoint


def test_io_counters_count_a_step_and_reset_when_taken(kind, tmp_path, io) -> None:
    layout = small_layout()
    tier = new_tier(kind, tmp_path / "store", layout, io)
    tier.take_io_bytes()
    step(tier, layout, seed=12)
    tier.commit({"step": 1})
    state_bytes = sum(FP32_STATE.unit_bytes(u) for u in layout.units)
    assert tier.take_io_bytes() == ((state_bytes, state_bytes) if kind.on_disk else (0, 0))
    assert tier.take_io_bytes() == (0, 0)
    tier.close()


def test_nbytes_is_the_state_held(kind, tmp_path, io) -> None:
    layout = small_layout()
    tier = new_tier(kind, tmp_path / "store", layout, io)
    state_bytes = sum(FP32_STATE.unit_bytes(u) for u in layout.units)
    live = {"nvme generations": 2, "nvme in-place": 1}.get(kind.name, 1)
    assert tier.nbytes() == live * state_bytes
    tier.close()


def test_close_completes_the_tier_and_leaves_the_shared_runner_to_its_owner(kind, tmp_path, io) -> None:
    layout = small_layout()
    path = tmp_path / "store"
    tier = new_tier(kind, path, layout, io)
    pending = tier.save("kept", lambda: {"step": 0}, keep=0)
    step(tier, layout, seed=13)
    if pending is not None:
        pending.commit()
    tier.commit({"step": 1})  # by generations, the checkpoint is kept when a commit supersedes it
    tier.close()
    tier.close()  # a second close does nothing more
    assert (path / "checkpoints" / "kept").is_dir()
    assert io.runner.submit(lambda: 1, what="after close").result() == 1  # the engine closes it, once


# ------------------------------------------------------------------ parameter tiers


PARAM_KINDS = ("device", "cpu", "nvme")
DTYPE = torch.bfloat16


@pytest.fixture(params=PARAM_KINDS)
def param_kind(request) -> str:
    return request.param


def no_frozen(unit: UnitLayout, values: torch.Tensor) -> None:
    raise AssertionError(f"unit {unit.name} is not frozen: its shard is the tier's own")


def new_param_tier(kind: str, path: Path, layout: ModelLayout, io: StoreIO) -> ParamTier:
    device = detect_device()
    if kind == "nvme":
        return StoreParamTier(path / "params", layout, 0, DTYPE, io, buffer_bytes=MIB, read_frozen=no_frozen)
    return MemoryParamTier(kind == "device", device, DTYPE, DeviceBudget(), uploads=None)


def read_all(tier: ParamTier, layout: ModelLayout) -> dict[str, torch.Tensor]:
    fetches = {u.name: tier.read(u) for u in layout.units}  # all asked early, waited for late
    values = {}
    for name, fetch in fetches.items():
        values[name] = fetch.wait().cpu().clone()
        fetch.release()
    return values


def added_param_tier(param_kind: str, tmp_path, io: StoreIO) -> tuple[ParamTier, ModelLayout]:
    """A parameter tier of ``param_kind`` holding ``master_of(unit, 1)`` of every unit, flushed."""
    layout = small_layout()
    tier = new_param_tier(param_kind, tmp_path, layout, io)
    for unit in layout.units:
        tier.add(unit, master_of(unit, 1).to(DTYPE))
    tier.flush()
    return tier, layout


def test_added_shards_read_back(param_kind, tmp_path, io) -> None:
    tier, layout = added_param_tier(param_kind, tmp_path, io)
    got = read_all(tier, layout)
    assert all(torch.equal(got[u.name], master_of(u, 1).to(DTYPE)) for u in layout.units)
    tier.close()


def test_written_back_masters_read_back_cast_after_flush(param_kind, tmp_path, io) -> None:
    tier, layout = added_param_tier(param_kind, tmp_path, io)
    for unit in layout.units:
        tier.write_back(unit, master_of(unit, 2))  # fp32: the tier casts
    tier.flush()
    got = read_all(tier, layout)
    assert all(torch.equal(got[u.name], master_of(u, 2).to(DTYPE)) for u in layout.units)
    tier.close()


def test_written_back_shards_are_handed_back_in_memory(param_kind, tmp_path, io) -> None:
    """What the next forward's first units go up from during the update: the new values, before
    any flush; the nvme tier's staging buffer goes back to its pool once the write has landed
    and the caller has let go, in either order."""
    tier, layout = added_param_tier(param_kind, tmp_path, io)
    assert tier.hands_back_writes
    first, *rest = layout.units
    kept = tier.write_back(first, master_of(first, 2))
    for unit in rest:
        fresh = tier.write_back(unit, master_of(unit, 2))
        assert fresh is not None and fresh.in_memory
        assert torch.equal(fresh.wait().cpu(), master_of(unit, 2).to(DTYPE))
        fresh.release()
    tier.flush()
    assert kept is not None and torch.equal(kept.wait().cpu(), master_of(first, 2).to(DTYPE))
    kept.release()
    if isinstance(tier, StoreParamTier):
        assert tier.pool.in_use_bytes == 0
    tier.close()


def test_param_io_counters_count_and_reset_when_taken(param_kind, tmp_path, io) -> None:
    tier, layout = added_param_tier(param_kind, tmp_path, io)
    shard_bytes = sum(u.shard_numel for u in layout.units) * DTYPE.itemsize
    assert tier.take_io_bytes() == ((0, shard_bytes) if param_kind == "nvme" else (0, 0))
    read_all(tier, layout)
    assert tier.take_io_bytes() == ((shard_bytes, 0) if param_kind == "nvme" else (0, 0))
    assert tier.take_io_bytes() == (0, 0)
    tier.close()


def test_host_bytes_are_the_host_memory_held(param_kind, tmp_path, io) -> None:
    tier, layout = added_param_tier(param_kind, tmp_path, io)
    shard_bytes = sum(u.shard_numel for u in layout.units) * DTYPE.itemsize
    on_cpu_device = detect_device().device.type == "cpu"
    if param_kind == "cpu" or (param_kind == "device" and on_cpu_device):
        assert tier.host_bytes() == (0 if param_kind == "device" else shard_bytes)
    if param_kind == "nvme":  # staged through a bounded pool: at most its budget, never the model
        largest = max(u.shard_numel for u in layout.units) * DTYPE.itemsize
        assert 0 < tier.host_bytes() <= MIB + 2 * largest
    tier.close()


def test_param_close_lets_the_runner_finish(param_kind, tmp_path, io) -> None:
    layout = small_layout()
    tier = new_param_tier(param_kind, tmp_path, layout, io)
    for unit in layout.units:
        tier.add(unit, master_of(unit, 1).to(DTYPE))
    tier.close()  # writes may still be in flight: the shared runner lands them
    io.runner.close()
    if param_kind == "nvme":
        with IORunner(threads=1) as runner:
            store = ShardStore.open(tmp_path / "params", runner=runner)
            for unit in layout.units:
                stored = torch.empty(unit.shard_numel, dtype=DTYPE)
                read_shard(store, TOP, unit, 0, [(PARAM_KIND, stored)])
                assert torch.equal(stored, master_of(unit, 1).to(DTYPE))


def test_every_tier_is_a_protocol_tier() -> None:
    """The memory and store classes provide every verb of their protocol."""
    for cls, protocol in [
        (MemoryOptimizerState, OptimizerState),
        (StoreOptimizerState, OptimizerState),
        (MemoryParamTier, ParamTier),
        (StoreParamTier, ParamTier),
    ]:
        verbs = {n for n in vars(protocol) if not n.startswith("_")} - {"resumed_from", "durable"}
        assert verbs <= set(dir(cls)), f"{cls.__name__} misses {sorted(verbs - set(dir(cls)))}"


def test_shard_state_kinds_are_the_store_arrays() -> None:
    state = ShardState(torch.zeros(1), torch.ones(1), torch.full((1,), 2.0))
    assert [name for name, _ in state.views()] == list(STATE_KINDS) == ["master", "exp_avg", "exp_avg_sq"]


def test_the_nvme_parameter_tier_reads_frozen_values_where_the_run_keeps_them(tmp_path, io) -> None:
    """No second copy in ``params/``: a frozen unit's add writes nothing, its read goes to ``frozen/``."""
    frozen = {"unit1.frozen": [("bias", nn.Parameter(torch.empty(2500, device="meta"), requires_grad=False))]}
    units = {"unit0": [("weight", nn.Parameter(torch.empty(3000, device="meta")))]}
    layout = build_layout(units, world_size=1, max_chunk_numel=MIB // 4, frozen=frozen)
    [unit], [fixed] = layout.units, layout.frozen
    values = torch.arange(fixed.shard_numel, dtype=DTYPE)
    home = ShardStore.create(tmp_path / "store", {}, runner=io.runner)
    adder = FrozenAdder(lambda: home, layout.frozen, 0, io)
    adder.add(fixed, values)
    tier = StoreParamTier(
        tmp_path / "store" / "params", layout, 0, DTYPE, io, buffer_bytes=MIB,
        read_frozen=lambda u, shard: read_frozen_async(home, u, 0, shard),
    )  # fmt: skip
    tier.add(unit, master_of(unit, 1).to(DTYPE))
    tier.add(fixed, torch.zeros(fixed.shard_numel, dtype=DTYPE))  # not written anywhere
    tier.flush()
    assert sorted(unit_arrays(tier.store, "").values()) == [("unit0", PARAM_KIND)]
    fetch = tier.read(fixed)
    assert torch.equal(fetch.wait(), values)
    fetch.release()
    assert torch.equal(read_all(tier, layout)["unit0"], master_of(unit, 1).to(DTYPE))
    tier.close()


def test_frozen_values_go_to_each_host_store_made_by_its_own_leader(tmp_path) -> None:
    """With a store on each host, rank 1 leads its own store: it makes the frozen arrays there,
    where global rank 0 never writes."""
    frozen = {"unit1.frozen": [("bias", nn.Parameter(torch.empty(2500, device="meta"), requires_grad=False))]}
    units = {"unit0": [("weight", nn.Parameter(torch.empty(3000, device="meta")))]}
    layout = build_layout(units, world_size=2, max_chunk_numel=MIB // 4, frozen=frozen)
    [fixed] = layout.frozen
    values = torch.arange(fixed.shard_numel, dtype=DTYPE)
    host_io = StoreIO(IORunner(threads=2), checksum=True, direct_io=False, barrier=lambda: None, leader=True, node=1)
    try:
        home = ShardStore.create(tmp_path / "node-1", {}, runner=host_io.runner)
        FrozenAdder(lambda: home, layout.frozen, 1, host_io).add(fixed, values)
        home.sync()
        [(unit, stored)] = list(read_frozen(home, layout.frozen, 1))
        assert unit is fixed and torch.equal(stored, values)
    finally:
        host_io.close()


# ------------------------------------------------- the gradient spill tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_spilled_gradients_read_back_in_the_order_asked_and_leave_nothing(dtype, tmp_path, io) -> None:
    """The spill tier's contract: nothing on disk before the first step; each unit's final shard
    written behind backward reads back in the order the update asks, in the spill's dtype
    (rounded once), its bytes counted both ways; closing removes every file it made."""
    from engine.tiers.grad_spill import GradSpill

    layout = small_layout()
    spill = GradSpill(tmp_path, layout, rank=0, io=io, buffer_bytes=4 * MIB, dtype=dtype)
    assert not any(tmp_path.iterdir()), "a start makes no scratch folder"
    grads = {u.name: master_of(u, seed=3) for u in layout.units}
    for step in range(2):  # a second step's spill replaces the first's
        spill.begin()
        for unit in layout.units:
            spill.write(unit, grads[unit.name] * (step + 1))
        asked = list(reversed(layout.units))
        got = [(unit.name, values.clone()) for unit, values in spill.read(asked)]
        assert [name for name, _ in got] == [u.name for u in asked]
        for name, values in got:
            assert values.dtype == dtype and torch.equal(values, (grads[name] * (step + 1)).to(dtype))
        nbytes = sum(u.shard_numel for u in layout.units) * dtype.itemsize
        assert spill.take_io_bytes() == (nbytes, nbytes)
    spill.close()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "closing leaves no file of the spill"
