"""After clipping every gradient is final before any unit is updated, so the units are updated
in the order the next forward uses them, and at stage 3 the first ones start on their way to
the device while the rest are updated: the next forward finds them there. Only from a tier
whose reads see its writes in flight (in memory, or on nvme from the write's own buffer; not
where the shards are read from masters the optimizer tier writes), and only units whose new
values are stored: one started earlier would carry the old values, which the comparison with
torch catches (the last tests take that check out)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.runtime.device import SIM_ENV
from engine.tiers import parameters
from engine.tiers.parameters import StoreParamTier
from engine.zero.params import ShardedParams
from engine.zero.unit_params import UnitState
from engine.zero.update import first_use_order
from tests.ranks import run_ranks
from tests.training import (
    batches,
    config,
    rel_diff,
    tiny_gpt,
    train_engine,
    train_engine_on_ranks,
    train_reference,
)

STEPS = 3


def clipped(tmp_path: Path, param: str, **sections):
    return config(
        zero={"stage": 3},
        offload={"optimizer": "cpu", "param": param, "nvme_path": str(tmp_path / "store")},
        **{"optim": {"grad_clip": 0.05}} | sections,
    )


def steps_watched(cfg) -> tuple[list[list[str]], list[list[str]], list[str], list[str], list[int]]:
    """Each step's order of write-backs, the units on their way (not sharded) when it ended, the
    first-use order of the units and of those gathered on demand (not persistent), and each
    step's prefetch misses."""
    eng = Engine(tiny_gpt(), cfg, total_steps=STEPS)
    written: list[list[str]] = []
    write_back = eng.params.write_back
    eng.params.write_back = lambda unit, master: written[-1].append(unit.name) or write_back(unit, master)
    params = eng.params
    assert isinstance(params, ShardedParams)
    data, ahead, misses = batches(4), [], []
    try:
        for _ in range(STEPS):
            written.append([])
            eng.backward(eng(*data.next()))
            eng.step()
            misses.append(eng.last_step_stats.prefetch_misses)
            ahead.append(
                [n for n, s in params.state.items() if s is not UnitState.SHARDED and not params.unit(n).persistent]
            )
        first_use = first_use_order(params.order.iteration(), eng.layout)
        assert first_use is not None
        names = [u.name for u in first_use]
        return written, ahead, names, [n for n in names if not params.unit(n).persistent], misses
    finally:
        eng.close()


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_clipped_units_are_updated_in_first_use_order_and_the_first_go_up_at_once(param: str, tmp_path) -> None:
    written, ahead, first_use, gathered, misses = steps_watched(clipped(tmp_path, param))
    assert all(order == first_use for order in written)
    assert ahead[0] and all(set(a) == set(ahead[0]) for a in ahead), "the same units go ahead every step"
    assert set(ahead[0]) == set(gathered[: len(ahead[0])]), "the first units the next forward gathers"
    assert misses[1:] == [0] * (STEPS - 1)


def test_shards_read_from_their_masters_are_not_sent_ahead(tmp_path) -> None:
    written, ahead, first_use, _, _ = steps_watched(
        clipped(
            tmp_path, "nvme", optim={"grad_clip": 0.05, "master_dtype": "bf16"}, precision={"compute_dtype": "bf16"}
        )
    )
    assert ahead == [[]] * STEPS
    assert all(order != first_use for order in written), "updated in the order the gradients completed"


@pytest.mark.parametrize("param", ["cpu", "device", "nvme"])
def test_units_sent_ahead_carry_the_new_values(param: str, tmp_path) -> None:
    cfg = clipped(tmp_path, param)
    ours, ref = train_engine(cfg, STEPS), train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])


def test_units_sent_ahead_before_their_update_are_caught(tmp_path, monkeypatch) -> None:
    """The check above, shown able to fail: every unit of the iteration sent ahead at the first
    write-back, before most are updated, leaves them with the old values. (From host memory the
    tier would not store a unit's new values while its old ones are on their way: it waits.)"""

    def all_ahead(self: ShardedParams) -> None:
        names = self.order.iteration()
        self._advance(names)
        self._ahead |= {n for n in names if self._units[n].state is not UnitState.SHARDED}

    monkeypatch.setattr(ShardedParams, "_prefetch_updated", all_ahead)
    cfg = clipped(tmp_path, "device")
    ours, ref = train_engine(cfg, STEPS), train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"][1:] != pytest.approx(ref["losses"][1:], rel=1e-4)


def late_param_writes(monkeypatch) -> None:
    """Each parameter shard's write starts 50 ms late, on a thread of its own: a read of the
    shard from disk meanwhile would get the values it had before."""
    threads = ThreadPoolExecutor(4)
    write = parameters.write_shard_async

    def late(*args, **kwargs):
        def written():
            time.sleep(0.05)
            return [future.result() for future in write(*args, **kwargs)]

        return [threads.submit(written)]

    monkeypatch.setattr(parameters, "write_shard_async", late)


def test_units_sent_ahead_from_nvme_carry_the_values_still_being_written(tmp_path, monkeypatch) -> None:
    late_param_writes(monkeypatch)
    cfg = clipped(tmp_path, "nvme")
    ours, ref = train_engine(cfg, STEPS), train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])


def test_units_read_from_disk_while_written_are_caught(tmp_path, monkeypatch) -> None:
    """The check above, shown able to fail: with each new shard read back from disk rather than
    taken from its write's buffer, the units sent ahead get the values from before the update."""
    write_back = StoreParamTier.write_back

    def read_instead(self: StoreParamTier, unit, master):
        fresh = write_back(self, unit, master)
        if fresh is None:
            return None
        fresh.release()
        return self.read(unit)

    monkeypatch.setattr(StoreParamTier, "write_back", read_instead)
    late_param_writes(monkeypatch)
    cfg = clipped(tmp_path, "nvme")
    ours, ref = train_engine(cfg, STEPS), train_reference(cfg, STEPS, micro_batch=4)
    assert ours["losses"][1:] != pytest.approx(ref["losses"][1:], rel=1e-4)


@pytest.mark.parametrize("sim", [pytest.param(False, marks=pytest.mark.slow), True], ids=["cpu", "late-copies"])
def test_two_ranks_send_the_same_units_ahead(sim: bool, tmp_path, monkeypatch) -> None:
    """Every rank sends ahead and gathers in the same order: gathers started during the update
    (copies done at once, on the CPU) or one a pass in the next forward (copies landing late)."""
    if sim:
        monkeypatch.setenv(SIM_ENV, "seed=6,delay_ms=1")  # the ranks inherit it
    cfg = clipped(tmp_path, "cpu")
    ranks = run_ranks(2, train_engine_on_ranks, cfg, STEPS, 2)
    ref = train_reference(cfg, STEPS, micro_batch=4)
    assert all(rel_diff(result["params"], ref["params"]) <= 1e-6 for result in ranks)
