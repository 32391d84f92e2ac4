"""The ``nvme`` optimizer tier: same bits as the ``cpu`` tier, a plain zarr store on disk,
and I/O failures that name what failed and never commit a half-written generation."""

from __future__ import annotations

import errno
import json

import pytest
import torch
import zarr

from engine.engine import Engine
from engine.state.partition import flatten_into
from offload.chunks import FileOps
from offload.io import OffloadIOError
from tests.ranks import run_ranks
from tests.training import batches, config, tiny_gpt, train_engine_on_ranks


def nvme_config(tmp_path, **sections):
    offload = {"optimizer": "nvme", "nvme_path": str(tmp_path / "store")} | sections.pop("offload", {})
    return config(offload=offload, **sections)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 2])  # the default run keeps stage 2
def test_two_ranks_nvme_bit_identical_to_cpu(stage: int, tmp_path) -> None:
    cpu = run_ranks(2, train_engine_on_ranks, config(zero={"stage": stage}, offload={"optimizer": "cpu"}), 5, 2)
    nvme = run_ranks(2, train_engine_on_ranks, nvme_config(tmp_path, zero={"stage": stage}), 5, 2)
    for rank in range(2):
        assert cpu[rank]["losses"] == nvme[rank]["losses"]
        assert all(torch.equal(cpu[rank]["params"][k], nvme[rank]["params"][k]) for k in cpu[rank]["params"])


def train_steps(eng: Engine, steps: int) -> None:
    data = batches(4)
    for _ in range(steps):
        eng.backward(eng(*data.next()))
        eng.step()


def test_store_is_plain_zarr_holding_the_engine_masters(tmp_path) -> None:
    eng = Engine(tiny_gpt(), nvme_config(tmp_path), total_steps=3)
    train_steps(eng, 3)
    eng.flush()
    committed = json.loads((tmp_path / "store" / "COMMITTED").read_text())
    assert committed["step"] == 3
    group = zarr.open_group(str(tmp_path / "store"), mode="r")
    params = dict(eng.module.named_parameters())
    for unit in eng.layout.units:
        expected = torch.zeros(unit.padded_numel)
        flatten_into(expected, unit, {name: params[name].detach() for name in (s.name for s in unit.params)})
        stored = torch.from_numpy(group[f"gen-{committed['generation']}/{unit.name}/master"][:])
        assert torch.equal(stored, expected), unit.name  # fp32 compute: parameters are the masters
    eng.close()


class FailingOps(FileOps):
    """Fails every positional write (or read) once armed."""

    def __init__(self, fail: str, err: int):
        self.fail, self.err, self.armed = fail, err, False

    def pwrite(self, fd, buf, offset):
        if self.armed and self.fail == "write":
            raise OSError(self.err, "injected")
        return super().pwrite(fd, buf, offset)

    def preadv(self, fd, buf, offset):
        if self.armed and self.fail == "read":
            raise OSError(self.err, "injected")
        return super().preadv(fd, buf, offset)


@pytest.mark.parametrize(("fail", "err"), [("write", errno.ENOSPC), ("read", errno.EIO)])
def test_io_error_names_unit_kind_range_and_keeps_last_commit(tmp_path, fail: str, err: int) -> None:
    eng = Engine(tiny_gpt(), nvme_config(tmp_path), total_steps=3)
    train_steps(eng, 1)
    eng.flush()
    committed_params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    ops = FailingOps(fail, err)
    eng.optimizer_state.store._ops = ops
    ops.armed = True
    before = (tmp_path / "store" / "COMMITTED").read_text()
    with pytest.raises(OffloadIOError) as info:
        train_steps(eng, 1)
        eng.flush()  # a write that fails behind the step surfaces here at the latest
    message = str(info.value)
    assert info.value.errno == err
    assert "gen-" in message and "elements [" in message, message
    assert any(f"/{kind}" in message for kind in ("master", "exp_avg", "exp_avg_sq")), message
    assert (tmp_path / "store" / "COMMITTED").read_text() == before, "a failed step must not commit"
    eng.close()
    resumed = Engine.resume(tiny_gpt(), nvme_config(tmp_path), total_steps=3)
    assert resumed.global_step == 1
    assert all(torch.equal(p, committed_params[n]) for n, p in resumed.module.named_parameters())
    train_steps(resumed, 1)  # and training goes on from there
    resumed.close()


def test_existing_store_is_not_overwritten(tmp_path) -> None:
    Engine(tiny_gpt(), nvme_config(tmp_path), total_steps=1).close()
    with pytest.raises(FileExistsError, match="already holds a store"):
        Engine(tiny_gpt(), nvme_config(tmp_path), total_steps=1)


def test_budget_smaller_than_a_unit_is_refused(tmp_path) -> None:
    cfg = nvme_config(tmp_path, offload={"buffer_mb": 3, "chunk_mb": 1})
    torch.manual_seed(0)
    from engine.run.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, d_model=512, n_head=8, seq_len=32))
    with pytest.raises(ValueError, match=r"unit 'blocks.0' needs .* set offload.buffer_mb >= \d+"):
        Engine(model, cfg, total_steps=1)


def test_read_only_path_is_refused(tmp_path, monkeypatch) -> None:
    # As root every folder is writable, so the kernel's answer is simulated.
    monkeypatch.setattr("engine.tiers.store_checks.os.access", lambda path, mode: False)
    with pytest.raises(PermissionError, match="is not writable; choose a writable folder"):
        Engine(tiny_gpt(), nvme_config(tmp_path), total_steps=1)


def test_too_little_disk_is_refused(tmp_path, monkeypatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    with pytest.raises(OSError, match=r"the store needs .* GiB .* but only 0\.00 GiB are free"):
        Engine(tiny_gpt(), nvme_config(tmp_path), total_steps=1)
