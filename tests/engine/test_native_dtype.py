"""``precision.compute_dtype = "auto"``: bf16 where the device computes it natively, else fp32,
one choice for every rank; a dtype set in the config is kept, with a warning where it is slow.

Whether this CPU computes bf16 natively is the predicate torch takes for its oneDNN path, so the
tests set it both ways rather than depend on the machine they run on."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from engine.runtime.native_dtype import native_compute_dtype, settle_compute_dtype
from engine.state.dtypes import compute_dtype
from engine.tools.estimate.shape import run_shape
from tests.ranks import run_ranks
from tests.training import batches, config, tiny_gpt


def cpu_computes_bf16(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)


def auto(**sections: dict) -> Config:
    return config(precision={"compute_dtype": "auto"}, **sections)


@pytest.mark.parametrize(("native", "chosen"), [(True, "bf16"), (False, "fp32")])
def test_auto_is_bf16_where_the_cpu_computes_it_natively_else_fp32(monkeypatch, caplog, native, chosen) -> None:
    cpu_computes_bf16(monkeypatch, native)
    with caplog.at_level(logging.INFO, logger="engine.runtime.native_dtype"):
        settled = settle_compute_dtype(auto())
    assert settled.precision.compute_dtype == chosen
    assert f'compute dtype: {chosen} (precision.compute_dtype = "auto"' in caplog.text
    assert native_compute_dtype()[0] == chosen


def test_auto_is_the_default() -> None:
    assert Config().precision.compute_dtype == "auto"


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "fp32")])
def test_auto_follows_the_hardware_where_the_parameters_are_the_bf16_masters(monkeypatch, native, expected) -> None:
    """The gathers cast the bf16 masters to whatever the device computes fastest."""
    cpu_computes_bf16(monkeypatch, native)
    shared = auto(
        zero={"stage": 3},
        offload={"optimizer": "nvme", "param": "nvme", "nvme_path": "unused"},
        optim={"master_dtype": "bf16"},
    )
    assert settle_compute_dtype(shared).precision.compute_dtype == expected


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_low_precision_set_in_the_config_is_kept_and_warned_about_where_it_is_slow(monkeypatch, caplog, dtype):
    cpu_computes_bf16(monkeypatch, False)
    cfg = config(precision={"compute_dtype": dtype, "loss_scaling": "dynamic"})
    with caplog.at_level(logging.WARNING, logger="engine.runtime.native_dtype"):
        assert settle_compute_dtype(cfg) is cfg
    assert f'precision.compute_dtype = "{dtype}" is slow here' in caplog.text
    assert 'set it to "fp32" or "auto"' in caplog.text


def test_nothing_is_said_of_a_dtype_the_device_computes_natively(monkeypatch, caplog) -> None:
    cpu_computes_bf16(monkeypatch, True)
    with caplog.at_level(logging.WARNING, logger="engine.runtime.native_dtype"):
        settle_compute_dtype(config(precision={"compute_dtype": "bf16"}))
        settle_compute_dtype(config(precision={"compute_dtype": "fp32"}))
    assert caplog.text == ""


def test_an_unsettled_auto_is_refused_where_a_dtype_is_needed() -> None:
    with pytest.raises(ValueError, match='"auto" must be settled first'):
        compute_dtype("auto")


@pytest.mark.parametrize(("native", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_the_engine_and_the_estimate_compute_in_the_settled_dtype(monkeypatch, native, dtype) -> None:
    cpu_computes_bf16(monkeypatch, native)
    engine = Engine(tiny_gpt(), auto(), total_steps=1)
    try:
        assert engine.dtype == dtype
        assert {p.dtype for p in engine.module.parameters()} == {dtype}
        loss = engine(*batches(2).next())
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()
    assert run_shape(auto(), world_size=1).dtype == dtype


def _dtype_on_rank_disagreeing(native_on_rank0: bool) -> str:
    """This rank's settled dtype, once a step has run, where rank 0's CPU computes bf16 natively
    as ``native_on_rank0`` says and every other rank's says the opposite."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    native = native_on_rank0 if rank == 0 else not native_on_rank0
    torch.ops.mkldnn._is_mkldnn_bf16_supported = lambda: native  # this process's own torch
    engine = Engine(tiny_gpt(), auto(), total_steps=1)
    try:
        engine.backward(engine(*batches(2, rank, world_size).next()))
        engine.step()
        return engine.config.precision.compute_dtype
    finally:
        engine.close()


@pytest.mark.parametrize(("native", "chosen"), [pytest.param(True, "bf16", marks=pytest.mark.slow), (False, "fp32")])
def test_every_rank_takes_rank_0s_choice(native, chosen) -> None:
    """Ranks whose machines would choose apart compute in one dtype: their collectives move it."""
    settled = run_ranks(2, _dtype_on_rank_disagreeing, native)
    assert settled == [chosen, chosen]
