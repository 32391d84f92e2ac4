"""Checkpoints of the memory tiers (``device``, ``cpu``), in the nvme tier's store layout.

The nvme tier keeps a checkpoint by renaming a generation it already wrote; the memory
tiers have no state on disk, so they write one. The layout is the same, so every tier
resumes from either's checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from engine.state.forms import FP32_STATE, ShardState, StateForm, create_state_arrays, state_groups
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.frozen import FrozenAdder, read_frozen
from engine.tiers.parameters import PARAM_STORE
from engine.tiers.step_record import check_step_record
from engine.tiers.store_checks import first_difference, naming_way_out
from engine.tiers.store_io import StoreIO
from offload import Generations, ShardStore, generation_prefix, read_shard, write_shard_async

logger = logging.getLogger(__name__)


class PendingCheckpoint:
    """A memory tier's checkpoint being written: each unit's state must stay as it is until its
    writes are done (``wait_unit``), and ``commit``, on every rank, makes it durable and keeps it."""

    def __init__(self, tag: str, writes: dict[str, tuple[ShardState, list[Future]]], keep: Callable[[], None]):
        self.tag = tag
        self._writes = writes  # the state is held too: the writes read from it
        self._keep = keep

    def wait_unit(self, name: str) -> None:
        """Block until the unit's state is written, so it may change."""
        _, futures = self._writes.pop(name, (None, []))
        for future in futures:
            future.result()

    def commit(self) -> None:
        """Wait for every write, fsync, and keep the checkpoint (collective: every rank calls it)."""
        for name in list(self._writes):
            self.wait_unit(name)
        self._keep()


FrozenShards = Callable[[], Iterator[tuple[UnitLayout, torch.Tensor]]]
"""This rank's shard of each frozen unit, as the parameters hold it (compute dtype)."""


class MemoryCheckpoints:
    """Checkpoints of the memory tiers (``device``, ``cpu``) in a store at ``offload.nvme_path``.

    Their state has no generation on disk to keep by rename, so ``save`` writes each rank's
    shards to a fresh generation and keeps it as ``checkpoints/<tag>`` as the nvme tier keeps
    a superseded one: the same arrays and record, so every tier resumes from either's
    checkpoints. The writes run in the background (``PendingCheckpoint``), overlapped with
    the next step's forward and backward; that step updates a unit only once its writes are done.
    The frozen units' values (``frozen``) are written once, with a run's first checkpoint,
    unless the run resumed from this store, which holds them already, or added them as it was
    built (``add_frozen``: the nvme parameter tier keeps no copy of its own); a run that starts
    afresh replaces the ones an earlier run left.
    """

    def __init__(
        self,
        path: Path,
        layout: ModelLayout,
        rank: int,
        io: StoreIO,
        *,
        create: bool,
        frozen: FrozenShards = lambda: iter(()),
        form: StateForm = FP32_STATE,
        overwrite: bool = False,
    ):
        """``create``: make the store if there is none; ``overwrite``: replace the one there."""
        self.layout, self.rank = layout, rank
        self._frozen, self._form = frozen, form
        self._adder = FrozenAdder(lambda: self.store, layout.frozen, rank, io)
        self._frozen_stored = not layout.frozen
        """This run's frozen values are in the store (none to store, written, or resumed from)."""
        self._barrier = io.barrier
        self._leader = io.leader
        if self._leader and create and (overwrite or not (path / "zarr.json").exists()):
            attrs = {"layout": layout.to_dict(), **form.attrs(), **io.host_attrs()}
            made = (
                ShardStore.create(  # beside the parameter tier's store, which offload.param = "nvme" puts there first
                    path,
                    attrs,
                    runner=io.runner,
                    checksum=io.checksum,
                    direct_io=io.direct_io,
                    overwrite=path.exists(),
                    beside=(PARAM_STORE,),
                    stripes=io.stripes,
                )
            )
            Generations(made).mark_new()
        io.barrier()
        self.store = ShardStore.open(path, runner=io.runner, direct_io=io.direct_io, costs=io.costs, stripes=io.stripes)
        first_difference(ModelLayout.from_dict(self.store.attrs["layout"]), layout, path)
        form.check_stored(self.store.attrs, path)  # its checkpoints are of one form
        self.generations = Generations(self.store)
        if self._leader:  # a checkpoint a crash left pending in a live store is kept before it is looked for
            self.generations.tidy()
            self.generations.keep_superseded()
        io.barrier()

    def read(self, tag: str) -> tuple[dict, Iterator[tuple[UnitLayout, ShardState]]]:
        """Checkpoint ``tag``'s record, and this rank's shard of each unit's state (host tensors,
        read as they are consumed), cut for this layout whatever world size wrote it."""
        with naming_way_out(self.generations):
            prefix, record = self.generations.checkpoint(tag)
            check_step_record(record, str(self.store.path / prefix / "COMMITTED"))
        logger.info("resuming from checkpoint %s (step %s) of %s", tag, record.get("step"), self.store.path)
        self._frozen_stored = True

        def shards() -> Iterator[tuple[UnitLayout, ShardState]]:
            for unit in self.layout.units:
                state = ShardState(*self._form.empty(unit))
                for geometry, views in state_groups(self._form, unit, state):
                    read_shard(self.store, prefix, geometry, self.rank, views)
                yield unit, state

        return record, shards()

    def read_frozen(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """This rank's shard of each frozen unit's values, as the store holds them."""
        return read_frozen(self.store, self.layout.frozen, self.rank)

    def add_frozen(self, unit: UnitLayout, values: torch.Tensor) -> None:
        """Store a frozen unit's values as a new run adds its units (every rank: it synchronises);
        its checkpoints then share them."""
        self._adder.add(unit, values)
        self._frozen_stored = True

    def _store_frozen(self) -> None:
        """Write this run's frozen values from the parameters, once (every rank: it synchronises)."""
        if not self._frozen_stored:
            for unit, values in self._frozen():
                self.add_frozen(unit, values)

    def save(
        self, tag: str, record: dict, states: Iterator[tuple[UnitLayout, ShardState]], keep: int
    ) -> PendingCheckpoint:
        """Start writing every unit's state as checkpoint ``tag`` with ``record``; the returned
        checkpoint is kept, and the oldest beyond ``keep`` (0 keeps all) deleted, by its ``commit``."""
        self.generations.check_free_tag(tag)  # on every rank, so that all of them raise or none
        self._store_frozen()  # made durable with the checkpoint
        generation = self.generations.next_free()
        prefix = generation_prefix(generation)
        self._barrier()
        if self._leader:
            self.generations.drop_uncommitted()
            self.store.nodes.build(
                prefix,
                lambda staging: create_state_arrays(self.store, staging, self.layout.units, self._form),
            )
        self._barrier()
        writes = {}
        for unit, state in states:
            host = ShardState(*(t.cpu() for t in state.tensors()))  # a copy only from an accelerator
            groups = state_groups(self._form, unit, host)
            futures = [f for g, views in groups for f in write_shard_async(self.store, prefix, g, self.rank, views)]
            writes[unit.name] = (host, futures)

        def keep_it() -> None:
            self.store.sync()
            self._barrier()
            if self._leader:
                self.generations.keep_generation(tag, {**record, "generation": generation}, retain=keep)
            self._barrier()

        return PendingCheckpoint(tag, writes, keep_it)
