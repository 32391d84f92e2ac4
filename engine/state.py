"""Where a rank's optimizer shards live between steps, behind one streaming interface.

The optimizer step asks for each unit's fp32 master and AdamW moments in a fixed order
and hands them back when updated. Held in memory (tier ``device`` or ``cpu``) the shards
are simply yielded; on the ``nvme`` tier the same calls read them ahead from the store
and write them back behind the update, so the step's code is the same on every tier.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.partition import UnitLayout


@dataclass
class ShardState:
    """One unit's optimizer state on this rank (fp32, ``shard_numel`` elements each)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq


class OptimizerState(Protocol):
    """The storage of every unit's ``ShardState`` on one tier."""

    def stream(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        """Each unit's state, in ``units`` order, ready to update in place."""
        ...

    def done(self, unit: UnitLayout, state: ShardState) -> None:
        """The unit's state has been updated: persist it (or not, in memory)."""
        ...

    def finish(self) -> None:
        """Every unit is done: wait until the whole step's state is stored."""
        ...

    def nbytes(self) -> int:
        """Bytes this tier holds for the optimizer state."""
        ...


class MemoryOptimizerState:
    """Shards held in device or host memory for the whole run (tiers ``device`` and ``cpu``)."""

    def __init__(self, masters: dict[str, torch.Tensor]):
        self._states = {
            name: ShardState(master, torch.zeros_like(master), torch.zeros_like(master))
            for name, master in masters.items()
        }

    def stream(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        for unit in units:
            yield unit, self._states[unit.name]

    def done(self, unit: UnitLayout, state: ShardState) -> None:
        return None

    def finish(self) -> None:
        return None

    def nbytes(self) -> int:
        return sum(t.nbytes for s in self._states.values() for t in s.tensors())
