"""Every rank charges the device budget in the same order, whenever its reductions complete.

With the gradient shards on the device (``offload.optimizer = "device"``), folding a reduced
shard charges the budget for it, and at stage 3 the budget's room decides which parameters
are copied and gathered next (``ShardedParams._prefetch``). Whether a reduction has completed
(``is_completed``) is each rank's own timing: if it decided when a shard is folded, two NCCL
ranks could issue their all-gathers in different orders and hang, or gather the wrong units.
Here one rank is told every reduction has completed at once, the other that none has: the
budget's charges (the gathers among them) must still come in the same order on both.
"""

from __future__ import annotations

import os

from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm, Work
from tests.ranks import run_ranks
from tests.training import config, train_engine

LIMIT_MB = 1.5
"""Room for the tiny GPT's optimizer state, shards and running unit, not for every prefetch:
the budget's answers decide the gathers."""


class Answering:
    """A collective whose ``is_completed`` gives a set answer (waiting still waits for it)."""

    def __init__(self, work: Work, answer: bool):
        self._work, self._answer = work, answer

    def wait(self) -> object:
        return self._work.wait()

    def is_completed(self) -> bool:
        return self._answer


def charges_when_completion_differs() -> list[str]:
    """Entry point for ``run_ranks``: one step at stage 3 with the optimizer on the device,
    rank 0's reductions all reported complete, rank 1's none; the budget's charges in order."""
    completed = int(os.environ["RANK"]) == 0
    charges: list[str] = []
    charge, reduce_scatter = DeviceBudget.charge, Comm.reduce_scatter

    def logged(budget: DeviceBudget, nbytes: int, what: str) -> None:
        charges.append(f"{what}: {nbytes}")
        charge(budget, nbytes, what)

    def answering(comm: Comm, full, shard_numel: int):
        work, shard = reduce_scatter(comm, full, shard_numel)
        return Answering(work, completed), shard

    DeviceBudget.charge = logged  # type: ignore[method-assign]
    Comm.reduce_scatter = answering  # type: ignore[method-assign]
    cfg = config(
        zero={"stage": 3, "device_memory_limit_mb": LIMIT_MB, "prefetch_mb": 1}, offload={"optimizer": "device"}
    )
    train_engine(cfg, steps=1)
    return charges


def test_ranks_charge_the_budget_in_one_order_whatever_completes_first() -> None:
    first, second = run_ranks(2, charges_when_completion_differs)
    assert any(what.startswith("gathering unit") for what in first), "the gathers are charged"
    assert first == second
