"""Where a rank's optimizer shards live between steps, behind one streaming interface.

The optimizer step asks for each unit's fp32 master and AdamW moments in a fixed order
and hands them back when updated. Held in memory (tier ``device`` or ``cpu``) the shards
are simply yielded; on the ``nvme`` tier the same calls read them ahead from the store
and write them back behind the update, so the step's code is the same on every tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.zero.partition import UnitLayout


@dataclass
class ShardState:
    """One unit's optimizer state on this rank (fp32, ``shard_numel`` elements each)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """Each kind's name (its store array's) with its tensor."""
        return list(zip(STATE_KINDS, self.tensors(), strict=True))


STATE_KINDS = tuple(field.name for field in dataclasses.fields(ShardState))
"""The kinds of optimizer state a unit has, by name: the names of its arrays in a store."""


class OptimizerState(Protocol):
    """The storage of every unit's ``ShardState`` on one tier."""

    resumed_from: dict | None
    """The committed record the state was restored from (None: a new run)."""

    def read_masters(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """Each unit's fp32 master shard, in layout order (to rebuild parameters on resume)."""
        ...

    def add_unit(self, unit: UnitLayout, master: torch.Tensor) -> None:
        """Take a unit's initial fp32 master shard (copied) with zero moments."""
        ...

    def seal(self) -> None:
        """Every unit is added: make the initial state durable where the tier can."""
        ...

    def stream(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        """Each unit's state, in ``units`` order, ready to update in place."""
        ...

    def done(self, unit: UnitLayout, state: ShardState) -> None:
        """The unit's state has been updated: persist it (or not, in memory)."""
        ...

    def finish(self, record: dict, *, defer: bool = False) -> None:
        """Every unit is done: wait until the whole step's state is stored, with ``record``
        (step count and the like) describing it; with ``defer``, a tier that stores it in the
        background may return first, and stores it before its next ``stream`` or ``close``."""
        ...

    @property
    def commit_pending(self) -> bool:
        """Whether a step's deferred ``finish`` still waits for ``settle``."""
        ...

    def settle(self) -> None:
        """Store a step whose ``finish`` was deferred now (nothing if none is): the engine
        calls it where the step must be committed, before the next step reads its state."""
        ...

    def discard_step(self) -> str:
        """The step in progress diverged and is given up: whatever it wrote must never become
        the state a run resumes from. Returns where a run can go on instead, for the error
        that stops this one."""
        ...

    def nbytes(self) -> int:
        """Bytes this tier holds for the optimizer state."""
        ...

    def take_io_bytes(self) -> tuple[int, int]:
        """Bytes the steps since the last call read and wrote to disk."""
        ...

    def close(self) -> None: ...


class MemoryOptimizerState:
    """Shards held in device or host memory for the whole run (tiers ``device`` and ``cpu``)."""

    def __init__(self, device: torch.device, pin_memory: bool = False):
        self._device, self._pin = device, pin_memory
        self._units: list[UnitLayout] = []
        self._states: dict[str, ShardState] = {}
        self.resumed_from: dict | None = None
        """The record of the checkpoint ``restore`` took the state from."""

    def _new_state(self, unit: UnitLayout) -> ShardState:
        """A unit's zeroed state, held on this tier."""
        zeros = (
            torch.zeros(unit.shard_numel, dtype=torch.float32, device=self._device, pin_memory=self._pin)
            for _ in range(3)
        )
        state = ShardState(*zeros)
        self._units.append(unit)
        self._states[unit.name] = state
        return state

    def add_unit(self, unit: UnitLayout, master: torch.Tensor) -> None:
        self._new_state(unit).master.copy_(master)

    def restore(self, record: dict, shards: Iterable[tuple[UnitLayout, ShardState]]) -> None:
        """Resume: take every unit's state as a checkpoint holds it, and the ``record`` it was
        saved with, instead of adding units."""
        for unit, loaded in shards:
            for held, value in zip(self._new_state(unit).tensors(), loaded.tensors(), strict=True):
                held.copy_(value)
        self.resumed_from = record

    def read_masters(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """Each unit's master shard (to rebuild parameters on resume)."""
        for unit in self._units:
            yield unit, self._states[unit.name].master

    def seal(self) -> None:
        return None

    def stream(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        for unit in units:
            yield unit, self._states[unit.name]

    def done(self, unit: UnitLayout, state: ShardState) -> None:
        return None

    def finish(self, record: dict, *, defer: bool = False) -> None:
        return None

    @property
    def commit_pending(self) -> bool:
        return False

    def settle(self) -> None:
        return None

    def discard_step(self) -> str:
        return (
            "the optimizer state is held in memory, so a run continues only from a checkpoint saved before this step "
            "(Engine.resume(model, config, checkpoint=TAG) or `python -m engine train --from-checkpoint TAG`)"
        )

    def nbytes(self) -> int:
        return sum(t.nbytes for s in self._states.values() for t in s.tensors())

    def take_io_bytes(self) -> tuple[int, int]:
        return 0, 0  # held in memory: no disk traffic

    def close(self) -> None:
        return None
