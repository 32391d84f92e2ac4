"""The host optimizer worker: AdamW on a thread of its own, the same numbers, errors where they belong.

With the optimizer on the host, each unit's AdamW runs on the worker while the training
thread goes on with backward; it waits for the gradient shard's copy event before reading
it. On the simulated device (copies landing late, at seeded random delays) every plan must
stay bit-identical to torch AdamW, with the update inside backward and after clipping (the
worker not waiting for the copy is caught in ``test_sim_device``); an exception on the worker must surface on
the training thread with its message, and ``close`` must join the thread. Beside an accelerator
(a fake device module here) the worker's thread binds the rank's device before anything else,
and the process's intra-op threads leave a core to the thread that launches kernels.
"""

from __future__ import annotations

import logging
import threading
import types

import pytest
import torch

from engine.config import ConfigError
from engine.engine import Engine
from engine.runtime.device import SIM_ENV
from engine.runtime.host_worker import WORKER_THREAD, HostWorker
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

    def failing(self, unit, state, grad) -> None:
        assert threading.current_thread().name.startswith(WORKER_THREAD), "AdamW runs on the worker"
        if updated:
            raise OSError(f"the update of unit {unit.name!r} failed")
        updated.append(unit.name)
        compute(self, unit, state, grad)

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
    offload = {"optimizer": "nvme", "param": "nvme", "nvme_path": store}
    spilled = config(offload=offload, zero={"stage": 3}, optim={"grad_clip": 1.0})
    eng = Engine(tiny_gpt(), spilled, total_steps=1)
    assert eng.step_control.spill is not None and eng.step_control.worker is not None, "auto: on where gradients spill"
    eng.close()
    with pytest.raises(ConfigError, match=r'offload.host_worker.*set offload.optimizer = "cpu" or "nvme"'):
        config(offload={"optimizer": "device", "host_worker": True})


@pytest.fixture
def three_threads():
    """The process's intra-op thread count at 3 for the test (the rank's share), then as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def test_beside_an_accelerator_the_worker_binds_the_ranks_device_and_leaves_a_core(
    three_threads, monkeypatch, caplog
) -> None:
    bound: list[tuple[str, str, torch.device]] = []

    def device_module(kind: str) -> types.SimpleNamespace:
        record = lambda device: bound.append((kind, threading.current_thread().name, device))  # noqa: E731
        return types.SimpleNamespace(set_device=record)

    monkeypatch.setattr(torch, "get_device_module", device_module)
    rank_device = torch.device("cuda", 1)
    with caplog.at_level(logging.INFO, logger="engine.runtime.host_worker"):
        worker = HostWorker(rank_device)
    threads_on_worker = worker.submit(torch.get_num_threads).result()
    assert bound == [("cuda", f"{WORKER_THREAD}_0", rank_device)], "bound on the worker's thread, before its job"
    assert threads_on_worker == torch.get_num_threads() == 2, "one of the rank's 3 cores left to the launching thread"
    assert [r.getMessage() for r in caplog.records] == [
        "host optimizer worker: torch intra-op threads 3 -> 2, leaving a core to the thread that launches the "
        "device's kernels"
    ]
    worker.close()
    assert torch.get_num_threads() == 3, "close gives the count back"


def test_on_the_host_the_worker_binds_nothing_and_keeps_the_count(three_threads, monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_device_module", lambda kind: pytest.fail(f"{kind} bound on the host"))
    worker = HostWorker(torch.device("cpu"))
    assert worker.submit(torch.get_num_threads).result() == torch.get_num_threads() == 3
    worker.close()


def test_the_engine_makes_its_worker_for_its_device(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=0.2")
    made: list[torch.device] = []
    monkeypatch.setattr("engine.build.HostWorker", lambda device: made.append(device) or HostWorker(device))
    eng = Engine(tiny_gpt(), plan_config(2, "cpu", "device", str(tmp_path / "store")), total_steps=1)
    assert made == [eng.device.device]
    eng.close()
