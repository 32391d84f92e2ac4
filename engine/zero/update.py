"""One optimizer step over every unit, applied as each unit's gradient becomes final.

The step's optimizer state is read in the order the gradient shards completed in the
last step (``GradientShards.order``), and the read-ahead starts before backward so its
first reads overlap backward's compute. Without clipping or loss scaling nothing needs
every gradient first, so each unit is updated as soon as its shard is final and the ones
before it in the order are done: the update runs inside backward, hidden behind the
backward of the units still to come. Otherwise the units wait for ``apply_remaining``, after
clipping; with the optimizer on nvme their gradient shards wait on disk meanwhile, and are
read back beside the state (``read_grads``, ``engine.tiers.grad_spill``). Every unit sees the
same arithmetic either way, so the result is the same.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from engine.config import Config
from engine.tiers.optimizer import OptimizerState, ShardState
from engine.zero.partition import ROOT_UNIT, ModelLayout, UnitLayout


def overlaps_backward(config: Config) -> bool:
    """Whether each unit is updated as its gradient is reduced on the step's last micro-batch:
    asked for, and nothing (clipping, loss scaling) needs every gradient first. Stage 1 reduces
    at the step, so it has nothing to overlap."""
    return (
        config.optim.overlap
        and config.optim.grad_clip == 0
        and config.zero.stage >= 2
        and config.precision.loss_scaling == "none"
    )


def spills_gradients(config: Config) -> bool:
    """Whether each unit's final gradient shard goes to the store's scratch folder during
    backward and comes back with its optimizer state at the step (``offload.grad_spill``): on
    ``auto``, whenever the optimizer is on nvme and the update waits for every gradient at stage
    2 or 3 (the config refuses ``true`` elsewhere)."""
    if config.offload.grad_spill != "auto":
        return bool(config.offload.grad_spill)
    return config.offload.optimizer == "nvme" and config.zero.stage >= 2 and not overlaps_backward(config)


def update_order(recorded: Sequence[str], layout: ModelLayout) -> list[UnitLayout]:
    """The units in the order their gradients completed last step (``recorded``). Before one is
    recorded, the order backward usually takes: the last unit first, the root (embeddings,
    head) last. A wrong guess costs memory, not correctness: shards wait for the units due
    before them."""
    if sorted(recorded) == sorted(u.name for u in layout.units):
        return [layout.unit(name) for name in recorded]
    units = layout.units
    return [u for u in reversed(units) if u.name != ROOT_UNIT] + [u for u in units if u.name == ROOT_UNIT]


class Update:
    """The units of one step, updated in a fixed order as they become ready."""

    def __init__(
        self,
        order: Sequence[UnitLayout],
        optimizer_state: OptimizerState,
        apply: Callable[[UnitLayout, ShardState, torch.Tensor | None], None],
    ):
        self.order = list(order)
        self._pending = collections.deque(order)
        self._ready: set[str] = set()
        self._state = optimizer_state
        self._apply = apply
        self._grads: Iterator[tuple[UnitLayout, torch.Tensor]] | None = None
        """Spilled gradient shards read back in ``order`` (``read_grads``), else None: the
        gradient shards are in memory."""
        self.wait_s = 0.0
        """Seconds blocked on the optimizer tier: reads not ready, writes backed up."""
        self.compute_s = 0.0
        """Seconds in the update itself."""
        start = time.perf_counter()
        self._reads = optimizer_state.read(order)  # its first reads start now
        self.wait_s += time.perf_counter() - start

    def ready(self, unit_name: str) -> None:
        """The unit's gradient shard is final: update it and any after it that were waiting."""
        self._ready.add(unit_name)
        while self._pending and self._pending[0].name in self._ready:
            self._update_next()

    def read_grads(self, grads: Iterator[tuple[UnitLayout, torch.Tensor]]) -> None:
        """Take each unit's gradient shard from ``grads`` (spilled ones read back in ``order``)
        beside its optimizer state, rather than from memory."""
        self._grads = grads

    def apply_remaining(self) -> None:
        """Every gradient is final: update the units still pending."""
        while self._pending:
            self._update_next()
        self._close(self._grads)

    def abandon(self) -> None:
        """Skip the step (overflowed gradients): drop the reads, touch nothing."""
        self._pending.clear()
        self._close(self._reads)
        self._close(self._grads)

    @staticmethod
    def _close(reads: Iterator | None) -> None:
        """End a read-ahead early, giving back the buffers of the reads still out."""
        close = getattr(reads, "close", None)
        if close is not None:
            close()

    def _update_next(self) -> None:
        unit = self._pending.popleft()
        start = time.perf_counter()
        arrived, state = next(self._reads)
        assert arrived is unit, f"the optimizer state read {arrived.name!r} where {unit.name!r} was due"
        grad = None
        if self._grads is not None:
            arrived, grad = next(self._grads)
            assert arrived is unit, f"the spilled gradient read {arrived.name!r} where {unit.name!r} was due"
        computed = time.perf_counter()
        self._apply(unit, state, grad)
        applied = time.perf_counter()
        self._state.write_back(unit, state)
        self.compute_s += applied - computed
        self.wait_s += (computed - start) + (time.perf_counter() - applied)
