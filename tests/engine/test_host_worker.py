"""The host optimizer worker: AdamW on a thread of its own, the same numbers, errors where they belong.

With the optimizer on the host, each unit's AdamW runs on the worker while the training
thread goes on with backward; it waits for the gradient shard's copy event before reading
it. On the simulated device (copies landing late, at seeded random delays) every plan must
stay bit-identical to torch AdamW, with the update inside backward and after clipping (the
worker not waiting for the copy is caught in ``test_sim_device``); an exception on the worker must surface on
the training thread with its message, and ``close`` must join the thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import ConfigError
from engine.engine import Engine
from engine.runtime.device import SIM_ENV
from engine.runtime.host_worker import WORKER_THREAD
from engine.zero.step import UnitWork
from tests.training import batches, config, tiny_gpt, train_engine, train_reference

STEPS = 3
PLANS = [(1, "cpu", "device"), (2, "cpu", "device"), (2, "nvme", "device")]
PLANS += [(3, optimizer, param) for optimizer in ("cpu", "nvme") for param in ("device", "cpu", "nvme")]


def plan_config(stage: int, optimizer: str, param: str, store: str, **sections):
    offload = {"optimizer": optimizer, "param": param, "nvme_path": store, "host_worker": True}
    return config(zero={"stage": stage}, offload=offload, **sections)


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(WORKER_THREAD)]


def assert_bit_identical(cfg, steps: int = STEPS) -> None:
    ours = train_engine(cfg, steps)
    ref = train_reference(cfg, steps, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("stage", "optimizer", "param"), PLANS)
def test_every_plan_with_the_worker_is_bit_identical(stage, optimizer, param, seed, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, f"seed={seed},delay_ms=1")
    assert_bit_identical(plan_config(stage, optimizer, param, str(tmp_path / "store")))


@pytest.mark.parametrize(("stage", "optimizer", "param"), [(2, "nvme", "device"), (3, "cpu", "cpu")])
def test_the_worker_after_clipping_is_bit_identical(stage, optimizer, param, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, "seed=5,delay_ms=1")
    assert_bit_identical(plan_config(stage, optimizer, param, str(tmp_path / "store"), optim={"grad_clip": 0.05}))


def test_the_worker_on_the_cpu_device_is_bit_identical(tmp_path) -> None:
    assert_bit_identical(plan_config(3, "cpu", "cpu", str(tmp_path / "store")))


def test_an_error_on_the_worker_surfaces_on_the_training_thread(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=1")
    updated: list[str] = []
    compute = UnitWork.compute

    def failing(self, unit, state, grad, spilled) -> None:
        assert threading.current_thread().name.startswith(WORKER_THREAD), "AdamW runs on the worker"
        if updated:
            raise OSError(f"the update of unit {unit.name!r} failed")
        updated.append(unit.name)
        compute(self, unit, state, grad, spilled)

    monkeypatch.setattr(UnitWork, "compute", failing)
    before = set(worker_threads())  # an engine a failed test left open keeps its own
    eng = Engine(tiny_gpt(), plan_config(3, "cpu", "cpu", str(tmp_path / "store")), total_steps=STEPS)
    data = batches(4)
    with pytest.raises(OSError, match=r"the update of unit .* failed"):
        eng.backward(eng(*data.next()))
        eng.step()
    assert eng.phase.name == "FAILED"
    eng.close()
    assert set(worker_threads()) == before, "close joins the worker"


def test_the_switch(tmp_path) -> None:
    store = str(tmp_path / "store")
    eng = Engine(tiny_gpt(), config(offload={"optimizer": "cpu", "nvme_path": store}), total_steps=1)
    assert eng.step_control.worker is None, "auto: off where the device is the host"
    eng.close()
    with pytest.raises(ConfigError, match=r'offload.host_worker.*set offload.optimizer = "cpu" or "nvme"'):
        config(offload={"optimizer": "device", "host_worker": True})
