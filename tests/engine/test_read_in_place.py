"""Stage 3 on a host device reads a unit's shard from disk straight into its place in the full
buffer (``UnitParams._read_in_place``): no pool buffer and no copy after it, the same bits as the
run through the pool; a unit freed with its read in flight lets the read land before its memory
goes. A tiny model's buffers are seldom page-aligned, so the tests take any address (the store
reads an unaligned one through the page cache); a real unit's are (torch's huge-page buffers)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from engine.tiers.parameters import StoreParamTier
from engine.zero import unit_params
from engine.zero.params import ShardedParams
from engine.zero.unit_params import UnitState
from tests.engine.test_master_dtype import shared
from tests.training import config, tiny_gpt, train_engine

NAME = "blocks.0"


def nvme_params(tmp_path: Path, form: str) -> Config:
    """Stage 3 with the parameters on nvme: their own compute-dtype copy (fp32), or read from
    the bf16 masters that are the parameters (``shared``)."""
    if form == "bf16 masters":
        return shared(tmp_path)
    offload = {"optimizer": "nvme", "param": "nvme", "nvme_path": str(tmp_path / "store")}
    return config(zero={"stage": 3}, offload=offload)


@pytest.fixture
def any_address(monkeypatch) -> None:
    monkeypatch.setattr(unit_params, "DIRECT_ALIGN", 1)


@pytest.mark.parametrize("form", ["fp32", "bf16 masters"])
def test_reads_in_place_train_as_the_pool_does_with_no_copy(tmp_path, monkeypatch, any_address, form: str) -> None:
    reads: dict[str, int] = {"in place": 0, "pooled": 0}
    read_into, read = StoreParamTier.read_into, StoreParamTier.read

    def counted(way: str, call):
        def run(*args):
            reads[way] += 1
            return call(*args)

        return run

    monkeypatch.setattr(StoreParamTier, "read_into", counted("in place", read_into))
    monkeypatch.setattr(StoreParamTier, "read", counted("pooled", read))
    in_place = train_engine(nvme_params(tmp_path / "in-place", form), 3)
    assert reads["in place"] > 0 and reads["pooled"] == 0, "every read went in place"
    monkeypatch.setattr(StoreParamTier, "reads_into", lambda self, unit, dtype: False)
    pooled = train_engine(nvme_params(tmp_path / "pooled", form), 3)
    assert in_place["losses"] == pooled["losses"]
    assert all(torch.equal(in_place["params"][k], pooled["params"][k]) for k in pooled["params"])


def test_a_read_in_place_leaves_the_pool_and_the_copies_alone(tmp_path, any_address) -> None:
    eng = Engine(tiny_gpt(), nvme_params(tmp_path, "fp32"), total_steps=2)
    sharded = eng.params
    assert isinstance(sharded, ShardedParams)
    unit, used, pooled = sharded.unit(NAME), eng.budget.used, sharded.host_bytes()
    eng.device.take_copied_bytes()
    unit.start_fetch(in_place=True)
    assert unit.in_place and eng.budget.used == used + unit.nbytes, "the full buffer is charged from the read"
    unit.complete()
    assert unit.state is UnitState.GATHERED and eng.device.take_copied_bytes() == 0
    assert sharded.host_bytes() == pooled, "no pool buffer was taken"
    sharded.release(NAME)
    assert eng.budget.used == used and unit.flat.untyped_storage().nbytes() == 0
    eng.close()


def test_a_unit_freed_while_its_read_is_in_flight_waits_for_the_read(tmp_path, monkeypatch, any_address) -> None:
    eng = Engine(tiny_gpt(), nvme_params(tmp_path, "fp32"), total_steps=2)
    sharded = eng.params
    assert isinstance(sharded, ShardedParams)
    unit, used, landed = sharded.unit(NAME), eng.budget.used, threading.Event()
    read_into = StoreParamTier.read_into

    def held(self: StoreParamTier, layout, into: torch.Tensor):
        fetch = read_into(self, layout, into)
        wait = fetch.wait

        def late() -> torch.Tensor:
            landed.wait(timeout=0.2)  # the read not landed yet when the unit is freed
            landed.set()
            return wait()

        fetch.wait = late  # type: ignore[method-assign]
        return fetch

    monkeypatch.setattr(StoreParamTier, "read_into", held)
    unit.start_fetch(in_place=True)
    assert not landed.is_set()
    unit.free()
    assert landed.is_set(), "the memory went only once the read had landed"
    assert unit.state is UnitState.SHARDED and eng.budget.used == used and unit.flat.untyped_storage().nbytes() == 0
    eng.close()
