"""Where a rank's optimizer shards live between steps, behind one lifecycle (add, read, write_back, commit, flush, save, close).

The optimizer step asks for each unit's master and AdamW moments in a fixed order
and hands them back when updated. Held in memory (tier ``device`` or ``cpu``) the shards
are simply yielded; on the ``nvme`` tier the same calls read them ahead from the store
and write them back behind the update, so the step's code is the same on every tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

import torch

from engine.state.forms import FP32_STATE, ShardState, StateForm
from engine.state.partition import UnitLayout
from offload import ShardStore

if TYPE_CHECKING:
    from engine.tiers.checkpoint import MemoryCheckpoints, PendingCheckpoint


class OptimizerState(Protocol):
    """The storage of every unit's ``ShardState`` on one tier, through one step's lifecycle:
    ``add`` every unit (a new run) and ``commit`` them as step 0; each step ``read`` the
    units, ``write_back`` each once updated and ``commit`` the step; ``flush`` what a tier
    left in the background; ``save`` a checkpoint; ``close``."""

    resumed_from: dict | None
    """The committed record the state was restored from (None: a new run)."""

    durable: bool
    """Whether the committed state is on disk, apart from the state a step updates: it
    survives a failed step, so a checkpoint can still be saved from it."""

    def add(self, unit: UnitLayout, master: torch.Tensor) -> None:
        """Take a unit's initial master shard (fp32, or already of the form's master dtype;
        copied, in that dtype) with zero moments. A frozen unit (``unit.trainable`` False) gives
        its compute-dtype shard instead: no moments, no master updated each step, just its
        values kept once (``engine.tiers.frozen``)."""
        ...

    def lend(self, unit: UnitLayout, dtype: torch.dtype) -> torch.Tensor | None:
        """Memory to build a trained unit's full initial values in (``dtype``, the master's), if
        ``add`` takes its master from there with no copy; None where it would copy anyway or has
        none to spare. The tier reuses it once ``add`` has stored the unit."""
        ...

    def read_masters(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """Each unit's committed master shard, in layout order, then each frozen unit's
        values (to rebuild parameters on resume)."""
        ...

    def read_master_async(self, unit: UnitLayout, values: torch.Tensor) -> Future | None:
        """Start reading this rank's newest master shard of a trained unit into ``values``
        (the master's dtype), once the last ``write_back`` of it can be read; None if read
        already. The nvme parameter tier reads bf16 masters as its shards this way
        (``engine.config.shares_master``), keeping no copy of its own."""
        ...

    def frozen_store(self) -> ShardStore:
        """The store holding the frozen units' values, once they are added or the state is
        restored (the nvme parameter tier reads them there)."""
        ...

    def read(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        """Each unit's state, in ``units`` order, read ahead where it is not in memory, ready to
        update in place."""
        ...

    def write_back(self, unit: UnitLayout, state: ShardState) -> None:
        """The unit's state has been updated: store it (behind the update, or not at all in memory)."""
        ...

    def commit(self, record: dict, *, defer: bool = False) -> None:
        """Every unit is written back: make the step's state the one a run resumes from, with
        ``record`` (step count and the like) describing it; with ``defer``, a tier that stores
        it in the background may return first, and commits before its next ``read``, ``save``
        or ``close``, or at ``flush``."""
        ...

    @property
    def commit_pending(self) -> bool:
        """Whether a step's deferred ``commit`` still waits for ``flush``."""
        ...

    def flush(self) -> None:
        """Complete what the tier left in the background (a deferred commit) now: the engine
        calls it where the step must be committed, before the next step reads its state."""
        ...

    def discard_step(self) -> str:
        """The step in progress diverged and is given up: whatever it wrote must never become
        the state a run resumes from. Returns where a run can go on instead, for the error
        that stops this one."""
        ...

    def save(self, tag: str, record: Callable[[], dict], keep: int) -> PendingCheckpoint | None:
        """Keep the committed state as checkpoint ``tag`` in the store at ``offload.nvme_path``,
        then delete the oldest beyond ``keep`` (0 keeps all). ``record`` makes the step's record
        (collective), for a tier that writes one. A checkpoint still being written is returned:
        the caller commits it at a point every rank reaches (the tier keeps each unit's state
        unchanged until its own writes are done)."""
        ...

    def nbytes(self) -> int:
        """Bytes this tier holds for the optimizer state."""
        ...

    def held_bytes(self) -> dict[str, int]:
        """Bytes this tier holds for the optimizer state off the device, by where they are
        (``cpu``: host memory, ``nvme``: the store); what it holds on the device is in the
        device budget."""
        ...

    def take_io_bytes(self) -> tuple[int, int]:
        """Bytes the steps since the last call read and wrote to disk."""
        ...

    def close(self) -> None:
        """Complete what is pending (``flush``) and release what the tier holds."""
        ...


class MemoryOptimizerState:
    """Shards held in device or host memory for the whole run (tiers ``device`` and ``cpu``);
    their checkpoints are written to a store (``engine.tiers.checkpoint``)."""

    durable = False  # a failed step may have updated part of the state it holds

    def __init__(
        self,
        device: torch.device,
        checkpoints: Callable[[bool], MemoryCheckpoints],
        store_frozen: bool = False,
        form: StateForm = FP32_STATE,
        on_device: bool = False,
    ):
        self._device, self._form = device, form
        self._on_device = on_device
        """Whether this is the ``device`` tier, whose bytes the device budget counts."""
        self._checkpoints = checkpoints
        """Opens the store of checkpoints (creating it if asked), on first use."""
        self._store_frozen = store_frozen
        """Whether the frozen units' values go to that store as they are added: the parameters
        keep none in memory (``offload.param = "nvme"``), and read them there."""
        self._units: list[UnitLayout] = []
        self._states: dict[str, ShardState] = {}
        self._saving: PendingCheckpoint | None = None
        self.resumed_from: dict | None = None
        """The record of the checkpoint ``restore`` took the state from."""

    def _new_state(self, unit: UnitLayout) -> ShardState:
        """A unit's zeroed state, held on this tier."""
        state = ShardState(*self._form.empty(unit, device=self._device))
        for tensor in state.tensors():
            tensor.zero_()
        self._units.append(unit)
        self._states[unit.name] = state
        return state

    def add(self, unit: UnitLayout, master: torch.Tensor) -> None:
        """A frozen unit's values are held by the parameters alone (the first checkpoint stores
        them), unless ``store_frozen``."""
        if unit.trainable:
            self._new_state(unit).master.copy_(master)
        elif self._store_frozen:
            self._checkpoints(True).add_frozen(unit, master)

    def lend(self, unit: UnitLayout, dtype: torch.dtype) -> None:
        return None  # a unit's state is made per unit and kept: nothing to build in

    def restore(self, tag: str) -> None:
        """Resume: take every unit's state as checkpoint ``tag`` holds it, and the record it was
        saved with, instead of adding units."""
        record, shards = self._checkpoints(False).read(tag)
        for unit, loaded in shards:
            for held, value in zip(self._new_state(unit).tensors(), loaded.tensors(), strict=True):
                held.copy_(value)
        self.resumed_from = record

    def read_masters(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """Each unit's master shard, then (resumed from a checkpoint) each frozen unit's values
        from its store (to rebuild parameters on resume)."""
        for unit in self._units:
            yield unit, self._states[unit.name].master
        if self.resumed_from is not None:
            yield from self._checkpoints(False).read_frozen()

    def read_master_async(self, unit: UnitLayout, values: torch.Tensor) -> None:
        """A copy of the held master (updated in place, so always the newest)."""
        values.copy_(self._states[unit.name].master)
        return None

    def frozen_store(self) -> ShardStore:
        return self._checkpoints(False).store

    def read(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        """The held state, each unit's once a checkpoint being saved has written it."""
        for unit in units:
            if self._saving is not None:
                self._saving.wait_unit(unit.name)
            yield unit, self._states[unit.name]

    def write_back(self, unit: UnitLayout, state: ShardState) -> None:
        return None

    def commit(self, record: dict, *, defer: bool = False) -> None:
        return None

    @property
    def commit_pending(self) -> bool:
        return False

    def flush(self) -> None:
        return None

    def discard_step(self) -> str:
        return (
            "the optimizer state is held in memory, so a run continues only from a checkpoint saved before this step "
            "(Engine.resume(model, config, checkpoint=TAG) or `python -m engine train --from-checkpoint TAG`)"
        )

    def save(self, tag: str, record: Callable[[], dict], keep: int) -> PendingCheckpoint:
        """Start writing every unit's state in the background (``MemoryCheckpoints.save``)."""
        states = ((unit, self._states[unit.name]) for unit in self._units)
        self._saving = self._checkpoints(True).save(tag, record(), states, keep=keep)
        return self._saving

    def nbytes(self) -> int:
        return sum(t.nbytes for s in self._states.values() for t in s.tensors())

    def held_bytes(self) -> dict[str, int]:
        return {} if self._on_device else {"cpu": self.nbytes()}

    def take_io_bytes(self) -> tuple[int, int]:
        return 0, 0  # held in memory: no disk traffic

    def close(self) -> None:
        return None
