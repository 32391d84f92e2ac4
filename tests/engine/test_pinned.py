"""The one pinned pool: every host tensor a copy reads or fills is cut from one bounded slab.

Nothing can be pinned on a CPU build, so the pool's bound and accounting are proven on the
simulated device, which cuts the same slab from plain memory: the engine's own tensors come
from it and stay within ``offload.pinned_mb`` (``auto``: the plan's need, which ``estimate``
reports too), a bound below the need is refused at start with the size that fits, and a
freed tensor's bytes are reused. What a CUDA build would pin is recorded instead
(``tests.pins``): the slab at its size, and of the ``cpu`` optimizer tier's state the masters
alone, which the device copies (4 B/param fp32, not the 12 of masters and moments).
"""

from __future__ import annotations

import gc
import mmap
import time

import pytest
import torch

from engine.config import ConfigError, spills_gradients
from engine.engine import Engine
from engine.run.models.gpt import GPT, GPTConfig
from engine.runtime.device import SIM_ENV
from engine.runtime.pinned import PinnedMemoryError, PinnedPool, aligned
from engine.runtime.sizes import MIB
from engine.tiers.grad_spill import GradSpill
from engine.tiers.sizing import pinned_bytes
from engine.tools.estimate.memory import estimate
from engine.tools.estimate.shape import Plan, run_shape
from tests.pins import record_pins
from tests.training import SEQ_LEN, batches, config, tiny_gpt

PLANS = [(2, "cpu", "device"), (3, "cpu", "cpu"), (3, "nvme", "nvme"), (3, "device", "cpu")]


def plan_config(stage: int, optimizer: str, param: str, store: str, **offload):
    return config(zero={"stage": stage}, offload={"optimizer": optimizer, "param": param, "nvme_path": store} | offload)


def test_the_pool_cuts_reuses_and_refuses() -> None:
    pool = PinnedPool(4096, pin=False)
    pool.reserve(1024, "a staging pool")
    first = pool.empty(100, torch.float32, "a shard")  # 400 bytes, cut as 448
    second = pool.empty(10, torch.bfloat16, "another")
    assert first.numel() == 100 and second.dtype == torch.bfloat16
    assert pool.used_bytes == 1024 + aligned(400) + aligned(20)
    first.fill_(1.0)
    second.fill_(2.0)
    assert torch.equal(first, torch.ones(100)), "the pieces do not overlap"
    pool.free(first)
    again = pool.empty(100, torch.float32, "the next step's shard")
    assert again.data_ptr() == first.data_ptr() and pool.used_bytes == 1024 + aligned(400) + aligned(20)
    with pytest.raises(PinnedMemoryError, match=r"a big shard needs .* over offload.pinned_mb = .*: set offload"):
        pool.empty(1000, torch.float32, "a big shard")
    assert pool.peak_bytes == pool.used_bytes


def test_the_slab_is_pinned_once_at_its_size(monkeypatch) -> None:
    calls = record_pins(monkeypatch)
    pool = PinnedPool(3 * MIB + 100, pin=True)
    pool.reserve(MIB, "a staging pool")
    shard = pool.empty(100, torch.float32, "a shard")
    pool.empty(1000, torch.float32, "another")
    # The bound less the reservation, rounded up to the page (torch's pinned allocator: 4 MiB).
    assert calls == [("register", shard.data_ptr(), 2 * MIB + mmap.PAGESIZE)]
    del pool
    gc.collect()
    assert len(calls) == 1, "a tensor cut from the slab keeps it pinned"
    del shard
    gc.collect()
    assert calls[1][0] == "unregister" and calls[1][1] == calls[0][1]


def test_no_optimizer_state_is_pinned(tmp_path, monkeypatch) -> None:
    """A master reaches the device rounded to the compute dtype through the upload ring, so the
    cpu tier pins none of its state: the pool holds the ring, then the gradient shards too."""
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=0.2")
    cfg = plan_config(2, "cpu", "device", str(tmp_path / "store"))
    eng = Engine(tiny_gpt(), cfg, total_steps=1)
    pool = eng.device.pinned
    assert pool is not None
    need = pinned_bytes(cfg, eng.layout, eng.dtype)
    assert set(need) == {"gradient shards", "master uploads"}
    assert pool.used_bytes == need["master uploads"], "built: the upload ring alone is cut from the pool"
    slab = pool._slab_bytes()
    inside = range(slab.data_ptr(), slab.data_ptr() + slab.numel())
    for _, state in eng.optimizer_state.read(eng.layout.units):
        assert all(t.data_ptr() not in inside for t in state.tensors())
    eng.backward(eng(*batches(4).next()))
    eng.step()
    assert need["master uploads"] < pool.peak_bytes <= sum(need.values()), "and the gradient shards"
    eng.close()


def test_the_need_is_refused_before_anything_is_cut() -> None:
    pool = PinnedPool(MIB, pin=False)
    with pytest.raises(PinnedMemoryError, match=r"offload.pinned_mb = 1 is below the 2.00 MiB .* at least 2 "):
        pool.check_fits({"master uploads": MIB, "gradient shards": MIB})


@pytest.mark.parametrize(("stage", "optimizer", "param"), PLANS)
def test_the_engine_stays_within_the_plans_need(stage, optimizer, param, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=0.2")
    cfg = plan_config(stage, optimizer, param, str(tmp_path / "store"))
    eng = Engine(tiny_gpt(), cfg, total_steps=2)
    pool = eng.device.pinned
    assert pool is not None, "the simulated device has a pool"
    need = pinned_bytes(cfg, eng.layout, eng.dtype)
    assert pool.limit_bytes == sum(need.values()), "auto: what the plan needs"
    data = batches(4)
    for _ in range(2):
        eng.backward(eng(*data.next()))
        eng.step()
    assert need, "every plan here copies through host memory"
    assert 0 < pool.peak_bytes <= pool.limit_bytes
    eng.close()
    run = run_shape(cfg, 1, model=tiny_gpt())
    predicted = estimate(run, Plan(stage, optimizer, param), baseline_bytes=0, device_is_host=False)
    assert predicted.pinned_bytes == sum(need.values()), "estimate counts the same bytes"


def test_a_bound_below_the_need_is_refused_at_start(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=0.2")
    store = tmp_path / "store"
    with pytest.raises(PinnedMemoryError, match=r"offload.pinned_mb = 0.01 is below .* set offload.pinned_mb to at"):
        Engine(tiny_gpt(), plan_config(3, "cpu", "cpu", str(store), pinned_mb=0.01), total_steps=1)
    with pytest.raises(ConfigError, match=r"offload\.pinned_mb"):
        plan_config(3, "cpu", "cpu", str(store), pinned_mb=0)


def test_nothing_is_pooled_where_the_device_is_the_host(tmp_path) -> None:
    eng = Engine(tiny_gpt(), plan_config(3, "cpu", "cpu", str(tmp_path / "store"), pinned_mb=0.01), total_steps=1)
    assert eng.device.pinned is None, "copies are synchronous: nothing is pinned, no bound applies"
    eng.close()


def test_a_spilling_rank_pins_a_window_of_its_gradient(tmp_path, monkeypatch) -> None:
    """Spilled gradient shards leave the pool once in the spill's buffers, so the plan pins
    ``SPILL_HELD`` of each size, not the model's gradient (2 GiB of a 1B model's, on CUDA); with
    the disk behind backward (each spill slowed), backward waits for the oldest rather than
    cutting the pool past that, which would be refused."""
    monkeypatch.setenv(SIM_ENV, "seed=0,delay_ms=0.2")
    write = GradSpill.write

    def slow_write(self, unit, grad):
        time.sleep(0.02)
        return write(self, unit, grad)

    monkeypatch.setattr(GradSpill, "write", slow_write)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", seq_len=SEQ_LEN, n_layer=12), seed=0)
    store = str(tmp_path / "store")
    cfg = config(
        zero={"stage": 3}, offload={"optimizer": "nvme", "param": "nvme", "nvme_path": store}, optim={"grad_clip": 1.0}
    )
    eng = Engine(model, cfg, total_steps=2)
    assert spills_gradients(cfg) and eng.step_control.worker is not None, "spilled on the host worker"
    need = pinned_bytes(cfg, eng.layout, eng.dtype)
    every_shard = sum(aligned(u.shard_numel * eng.grads.dtype.itemsize) for u in eng.layout.units)
    assert need["gradient shards"] <= 0.5 * every_shard, "a window of the 13 units' shards"
    data = batches(4)
    for _ in range(2):
        eng.backward(eng(*data.next()))
        eng.step()
    assert eng.device.pinned is not None and eng.device.pinned.peak_bytes <= eng.device.pinned.limit_bytes
    eng.close()
