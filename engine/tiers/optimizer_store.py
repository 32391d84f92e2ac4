"""The ``nvme`` optimizer tier: masters and AdamW moments live in the store between steps.

Each step reads every unit's three shards (master, exp_avg, exp_avg_sq) from the committed generation into pooled host
buffers ahead of the update, and writes them to the step's target generation behind it; host memory for the state is
bounded by the pool's budget, whatever the model's size. When every rank's writes are durable the leader commits the
target, so the store is always a valid checkpoint. Which generation a step writes, and how a checkpoint is kept, is
the store mode's (``engine.tiers.store_modes``); what is checked before any work, and the errors that name a way out,
are ``engine.tiers.store_checks``'.

A store resumes on any world size. A unit's content is the first ``numel`` elements of its arrays whatever their
padding, so a generation cut for other shards is read range by range (each rank's new shard from the chunks that cover
it, padding zeroed), and the first step writes a generation cut for this run's shards; once it is committed the store
records this layout and is an ordinary store of the new world size.

A run can also resume from a checkpoint (``checkpoint=`` tag): its first step reads the checkpoint and writes the
store's next live generation, so the checkpoint itself is never modified and can be resumed from again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from engine.state.forms import FP32_STATE, STATE_KINDS, ShardState, StateForm, create_state_arrays, state_groups
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.frozen import FrozenAdder, read_frozen
from engine.tiers.sizing import read_ahead_bytes
from engine.tiers.step_record import check_step_record
from engine.tiers.store_checks import (
    GENERATIONS,
    MODE_ATTR,
    Continuation,
    check_buffer,
    check_clean,
    check_new,
    check_nvme_path,
    first_difference,
    how_to_continue,
    naming_way_out,
    way_out,
)
from engine.tiers.store_io import StoreIO
from engine.tiers.store_modes import store_mode
from offload import (
    BufferPool,
    Generations,
    HostBuffer,
    IORunner,
    Pipeline,
    PipelineStats,
    ReadAhead,
    ShardStore,
    array_in_layout,
    array_name,
    generation_prefix,
    read_shard,
    read_shard_async,
    shard_bytes,
    write_shard,
)

logger = logging.getLogger(__name__)


class StoreOptimizerState:
    """Optimizer shards in a zarr store, read ahead and written back through a byte-bounded pipeline."""

    durable = True  # its committed generation is on disk, untouched by a step that fails

    def __init__(
        self,
        path: Path,
        layout: ModelLayout,
        rank: int,
        io: StoreIO,
        *,
        buffer_bytes: int,
        resume: bool = False,
        checkpoint: str | None = None,
        mode: str = GENERATIONS,
        scratch_bytes: int = 0,
        form: StateForm = FP32_STATE,
        overwrite: bool = False,
    ):
        """``scratch_bytes``: the disk the run's spilled gradients take beside the store, all ranks
        (``engine.tiers.grad_spill``), checked with the store's own before a new store is made;
        ``form``: the optimizer state's (its staging is not pinned: a master reaches the device
        rounded, through ``engine.runtime.staging``); ``overwrite``: a new run replaces whatever store is at ``path`` (else only one that never
        held a trained step: ``check_new``)."""
        if io.hosts > 1 and mode != GENERATIONS:
            raise ValueError(
                f'store.mode = "{mode}" keeps one generation, so hosts whose stores a crash left one step apart '
                f'could not agree on a step to resume: use store.mode = "{GENERATIONS}" with a store on each host'
            )
        self.mode = store_mode(mode)
        self.hosts = io.hosts
        self.form = form
        check_buffer(layout, buffer_bytes, form)
        self.layout, self.rank = layout, rank
        self.barrier, self.leader, self.runner = io.barrier, io.leader, io.runner
        self.pool = BufferPool(buffer_bytes, pin=False)
        self.pipeline: Pipeline[UnitLayout] = Pipeline(self.pool, self.runner, read_ahead_bytes(buffer_bytes))
        self.last_stats = PipelineStats()
        self._held: dict[str, HostBuffer] = {}
        self._lent: HostBuffer | None = None  # ``lend``'s buffer, until ``add`` writes from it
        if self.leader and not resume:
            self._create(path, layout, io, mode, scratch_bytes, overwrite)
        self.barrier()
        self.store = ShardStore.open(
            path, runner=self.runner, direct_io=io.direct_io, costs=io.costs, stripes=io.stripes
        )
        self.generations = Generations(self.store)
        self.committed_generation = 0  # the live committed generation
        self.target_generation = 0  # the generation the next step writes (the mode's choice)
        self._read_prefix = generation_prefix(0)  # where the next step reads: it, or a checkpoint
        self._generation_zero_ready = False
        self._frozen = FrozenAdder(lambda: self.store, layout.frozen, rank, io)
        self._layout_adopted = True  # the store's attributes and committed arrays are this layout
        self._deferred: dict | None = None  # the record of a step whose commit waits for ``flush``
        self._bytes_read = self._bytes_written = 0  # by the steps since ``take_io_bytes``
        self._written: dict[str, tuple[str, Future]] = {}  # where and how this step wrote each unit
        self.resumed_from: dict | None = None
        self._opening: dict | None = None  # the live record, between a resume's checks and its first change
        self._writable = not resume  # the store is ready for the steps' writes (``_open_for_writes``)
        if resume:
            with naming_way_out(self.generations):
                self.resumed_from = self._open_existing(path, layout, checkpoint)

    def _create(
        self, path: Path, layout: ModelLayout, io: StoreIO, mode: str, scratch_bytes: int, overwrite: bool
    ) -> None:
        """Make the store of a new run (replacing one that never held a trained step, or any with
        ``overwrite``), once its folders are known to hold it; marked new until its first commit."""
        check_nvme_path(path, layout, mode, scratch_bytes, self.form, io.stripes)
        attrs = {"layout": layout.to_dict(), MODE_ATTR: mode, **self.form.attrs(), **io.host_attrs()}
        abandoned = check_new(path, self.runner, overwrite)
        store = ShardStore.create(
            path,
            attrs,
            runner=self.runner,
            checksum=io.checksum,
            direct_io=io.direct_io,
            overwrite=abandoned,
            stripes=io.stripes,
        )
        Generations(store).mark_new()

    # ------------------------------------------------------------ resuming

    def _open_existing(self, path: Path, layout: ModelLayout, checkpoint: str | None) -> dict:
        """The record to resume from (the committed one, or checkpoint ``checkpoint``'s) of an
        existing store of this model, as this world size resumes it; the next generation made
        ready to write, cut for this layout. Every check that can refuse the store runs before
        anything in it changes, so a refused run leaves it as it was."""
        live = self.generations.committed()
        if live is None and checkpoint is None:
            found = Continuation(self.generations)
            raise FileNotFoundError(
                f"store {path} has no committed step to resume: it never committed its first step, so start afresh "
                f"(--overwrite replaces it)"
                if found.nothing
                else f"store {path} has no committed step to resume: {how_to_continue(found, path)}"
            )
        self.generations.checkpoints()  # every kept record is checked before retention or a fallback relies on it
        stored = ModelLayout.from_dict(self.store.attrs["layout"])
        first_difference(stored, layout, path)
        self.form.check_stored(self.store.attrs, path)
        if checkpoint is None:
            check_clean(self.generations)
        elif self.generations.dirty():
            logger.warning("store %s is dirty: the first step rewrites it from checkpoint %s", path, checkpoint)
        # Without a live generation the run starts its own above the checkpoints' numbers.
        self.committed_generation = live["generation"] if live else self.generations.next_free() - 1
        record = self._read_from(path, checkpoint)
        self._check_chunks()
        self._layout_adopted = stored == layout and self.in_layout(self._read_prefix)
        if not self._layout_adopted:
            cut = f"for {stored.world_size} rank(s)" if stored.world_size != layout.world_size else "into other chunks"
            logger.info(
                "store %s holds shards cut %s: read as this run cuts them until its first step commits", path, cut
            )
        self._opening = live  # the store changes only once the resume has read its masters: ``_open_for_writes``
        return record

    def _open_for_writes(self) -> None:
        """Once the resume has read every master (each chunk's checksum verified) on every rank,
        or at the first step's reads at the latest: tidy the store and make the next step's
        target ready. Nothing in the store changes before, so a store refused while resuming is
        left as it was."""
        if self._writable:
            return
        live, self._opening, self._writable = self._opening, None, True
        self.barrier()
        if self.leader:
            self._tidy(self.store.path)
        self.barrier()
        self.target_generation = self.mode.open(self, live)
        self.barrier()

    def _check_chunks(self) -> None:
        """Refuse a step to resume from whose chunk files of this rank's shards are missing or
        cut short: a look at each file's size, no read (a flipped byte is found by its checksum
        when it is read). Only this rank's: a host's own store holds only its ranks' chunks."""
        for unit in self.layout.units:
            for kind, geometry in zip(STATE_KINDS, self.form.geometries(unit), strict=True):
                name = array_name(self._read_prefix, unit.name, kind)
                start = geometry.shard_slice(self.rank).start
                end = min(start + geometry.shard_numel, geometry.numel)
                chunk = self.store.array_info(name).chunk_elems
                for index in range(start // chunk, -(-end // chunk)):
                    self.store.check_chunk_file(name, index)

    def _tidy(self, path: Path) -> None:
        """The leader's changes once the store is known good: what an interrupted run left
        removed, this run's mode noted, a checkpoint a crash left pending kept, and every other
        generation but the committed one dropped. Those are scratch, whatever state a crash (or
        a bad copy) left them in: the next step's target is made afresh, never trusted."""
        self.generations.tidy()
        self._record_mode(path)
        self.generations.drop_uncommitted()

    def _read_from(self, path: Path, checkpoint: str | None) -> dict:
        """Point the first step's reads at the committed generation or at ``checkpoint``; its record."""
        self._read_prefix = generation_prefix(self.committed_generation)
        if checkpoint is None:
            record = self.generations.own_record()  # the step's own, not the store's bookkeeping
            check_step_record(record, str(path / "COMMITTED"))
            return record
        self._read_prefix, record = self.generations.checkpoint(checkpoint)
        check_step_record(record, str(path / self._read_prefix / "COMMITTED"))
        logger.info("resuming from checkpoint %s (step %s) of %s", checkpoint, record.get("step"), path)
        return record

    def _record_mode(self, path: Path) -> None:
        """Note this run's mode in the store's attributes, if it differs from the last run's:
        either way round is safe (a dirty store is refused before, a pending keep is taken by
        copy when the in-place mode opens it)."""
        previous = self.store.attrs.get(MODE_ATTR, GENERATIONS)
        if previous != self.mode.name:
            logger.info("store %s was written with store.mode = %r; continuing with %r", path, previous, self.mode.name)
            self.store.update_attrs({MODE_ATTR: self.mode.name})

    # ------------------------------------------- what the store modes use

    def in_layout(self, prefix: str) -> bool:
        """Whether every array of the generation at ``prefix`` is cut for this layout."""
        return all(
            array_in_layout(self.store, array_name(prefix, unit.name, kind), geometry)
            for unit in self.layout.units
            for kind, geometry in zip(STATE_KINDS, self.form.geometries(unit), strict=True)
        )

    def drop_other_layouts(self, committed: int) -> None:
        """Delete the uncommitted generations not cut for this layout (another world size's):
        recycling one as the next write target would hand the step arrays of the wrong shape,
        so ``Generations.prepare`` creates that generation afresh instead."""
        for generation in self.generations.on_disk():
            if generation != committed and not self.in_layout(generation_prefix(generation)):
                self.store.nodes.delete(generation_prefix(generation))

    def create_arrays(self, prefix: str) -> None:
        create_state_arrays(self.store, prefix, self.layout.units, self.form)

    def keep_by_copy(self, tag: str, record: dict, retain: int) -> None:
        """Copy the committed generation to a fresh one, each rank its share of the chunks
        through one pool buffer, then keep that as ``checkpoints/<tag>`` with ``record`` (it
        appears whole or not at all) and apply ``retain``."""
        generation = self.generations.next_free()  # on every rank before the leader creates it
        source, copy = generation_prefix(self.committed_generation), generation_prefix(generation)
        self.barrier()
        if self.leader:
            self.generations.create_like(source, copy)
        self.barrier()
        with self.pool.acquire(self.pipeline.window_bytes) as buf:  # room for it beside a read-ahead's window
            part = (self.rank, self.layout.world_size)
            self.generations.copy(source, copy, buf.view(torch.uint8, buf.nbytes), part=part)
        self.store.sync()
        self.barrier()
        if self.leader:
            self.generations.keep_generation(tag, {**record, "generation": generation}, retain=retain)
        self.barrier()

    # ------------------------------------------------------- the lifecycle

    def add(self, unit: UnitLayout, master: torch.Tensor) -> None:
        """Write the unit's initial master and zero moments to generation 0; a frozen unit's
        values once, outside the generations (``engine.tiers.frozen``)."""
        if not unit.trainable:
            self._frozen.add(unit, master)  # durable with generation 0's commit
            return
        if not self._generation_zero_ready:
            if self.leader:
                self.generations.prepare(0, self.create_arrays)
            self.barrier()
            self._generation_zero_ready = True
        master_dtype = self.form.dtypes()[0]
        buf, self._lent = self._lent or self.pool.acquire(shard_bytes(unit, master_dtype)), None
        staged = buf.view(master_dtype, unit.shard_numel)
        if staged.data_ptr() != master.data_ptr():  # not built in ``lend``'s buffer
            staged.copy_(master)
        # Behind the next unit's build, as a step's write-backs are; generation 0's commit waits.
        self.pipeline.write_back(
            unit, buf, lambda u, _: self._save_new(u, staged), describe=lambda u: f"optimizer state of unit {u.name}"
        )

    def lend(self, unit: UnitLayout, dtype: torch.dtype) -> torch.Tensor | None:
        """One rank's build makes a trained unit in a pool buffer its master is written from, if
        one is spare: taken before the unit is built, a new one could outgrow what ``add`` needs."""
        fits = unit.trainable and dtype == self.form.dtypes()[0] and unit.shard_numel == unit.padded_numel
        self._lent = self.pool.acquire_spare(shard_bytes(unit, dtype)) if fits else None
        return None if self._lent is None else self._lent.view(dtype, unit.shard_numel)

    def _save_new(self, unit: UnitLayout, master: torch.Tensor) -> None:
        prefix = generation_prefix(self.target_generation)
        IORunner.gather(self.form.write_new(self.store, prefix, unit, self.rank, master)).result()

    def _views(self, unit: UnitLayout, buf: HostBuffer) -> ShardState:
        form = self.form
        layout = zip(form.geometries(unit), form.dtypes(), form.offsets(unit), strict=True)
        return ShardState(*(buf.view(dtype, geometry.shard_numel, offset) for geometry, dtype, offset in layout))

    def _load(self, unit: UnitLayout, buf: HostBuffer) -> None:
        with naming_way_out(self.generations):
            for geometry, views in state_groups(self.form, unit, self._views(unit, buf)):
                read_shard(self.store, self._read_prefix, geometry, self.rank, views)

    def _save(self, unit: UnitLayout, buf: HostBuffer) -> None:
        prefix = generation_prefix(self.target_generation)
        for geometry, views in state_groups(self.form, unit, self._views(unit, buf)):
            write_shard(self.store, prefix, geometry, self.rank, views)

    def read_masters(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """Each unit's committed master shard, read ahead, then each frozen unit's values (to
        rebuild parameters on resume); on a resume, once all are read, the store is opened for
        the steps' writes (``_open_for_writes``)."""
        for unit, buf in self.pipeline.read_ahead(
            self.layout.units,
            nbytes=self.form.unit_bytes,
            load=self._load,
            describe=lambda u: f"master of unit {u.name}",
        ):
            try:
                yield unit, self._views(unit, buf).master
            finally:
                self.pipeline.release(buf)
        self.pipeline.drain()  # its reads are the resume's, not the next step's
        with naming_way_out(self.generations):
            yield from read_frozen(self.store, self.layout.frozen, self.rank)
        self._open_for_writes()

    def frozen_store(self) -> ShardStore:
        return self.store

    def read(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        """The units' state in order; the first reads are issued now, not at the first ``next``.
        They read the last step's generation, so a deferred commit of it is made first (the
        engine has made it already, at the top of the step's last backward; a direct caller
        such as ``benchmarks.optimizer`` relies on this)."""
        self._open_for_writes()
        self.flush()
        reads = self.pipeline.read_ahead(
            units, nbytes=self.form.unit_bytes, load=self._load, describe=lambda u: f"optimizer state of unit {u.name}"
        )
        return self._hand_over(reads)

    def _hand_over(self, reads: ReadAhead[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        with reads:
            for unit, buf in reads:
                self._held[unit.name] = buf
                self._bytes_read += buf.nbytes
                yield unit, self._views(unit, buf)

    def write_back(self, unit: UnitLayout, state: ShardState) -> None:
        """Write the unit's updated state to the step's target generation, behind the update."""
        self.mode.before_write(self)
        buf = self._held.pop(unit.name)
        self._bytes_written += buf.nbytes
        written = self.pipeline.write_back(
            unit, buf, self._save, describe=lambda u: f"optimizer state of unit {u.name}"
        )
        self._written[unit.name] = (generation_prefix(self.target_generation), written)

    def read_master_async(self, unit: UnitLayout, values: torch.Tensor) -> Future | None:
        """From the generation this step wrote the unit to (once that write has landed: a
        deferred commit leaves it landing behind the next forward), else from the one the step
        reads; one cut for another world size is read at once, range by range."""
        prefix, written = self._written.get(unit.name, (self._read_prefix, None))
        if written is not None:
            written.result()
        views = [("master", values)]
        with naming_way_out(self.generations):
            if array_in_layout(self.store, array_name(prefix, unit.name, "master"), unit):
                [future] = read_shard_async(self.store, prefix, unit, self.rank, views)
                return future
            read_shard(self.store, prefix, unit, self.rank, views)
        return None

    def commit(self, record: dict, *, defer: bool = False) -> None:
        """Wait for the step's writes, make them durable on every rank, then commit the target
        generation with ``record`` (the first commit, of the added units, makes generation 0 a
        checkpoint). With ``defer`` the writes go on in the background and the commit waits for
        ``flush`` (called by the engine at the next step's last backward, and by ``read``,
        ``save`` and ``close``): the next step's forward then hides them. Until then the
        store's last commit is the step before this one."""
        if defer:
            self._deferred = record
            return
        self.last_stats = self.pipeline.drain()
        self._commit(self.target_generation, record)

    @property
    def commit_pending(self) -> bool:
        return self._deferred is not None

    def flush(self) -> None:
        """Commit a deferred step now (every rank calls this at the same point: it synchronises)."""
        record, self._deferred = self._deferred, None
        if record is not None:
            self.commit(record)

    def _commit(self, generation: int, record: dict) -> None:
        """Every rank's writes durable, then the commit; with a store on each host
        (``engine.tiers.hosts``) each host commits only once all are durable, and the
        superseded generation goes only once all have committed."""
        self.store.sync()
        self.barrier()
        if self.leader:
            self.generations.commit(generation, record, together=self.hosts > 1)
        if self.hosts > 1:
            self.barrier()
        if self.leader:
            if not self._layout_adopted:
                self._adopt_layout(generation)
            self.mode.after_commit(self, generation)
        self.barrier()
        self.committed_generation = generation
        self.target_generation = self.mode.next_target(generation)
        self._read_prefix = generation_prefix(generation)
        self._written.clear()  # every unit's newest state is the committed generation's
        self._layout_adopted = True

    def _adopt_layout(self, committed: int) -> None:
        """Once generation ``committed``, of this layout, is committed: record the layout, so the
        store describes what it holds, and drop the superseded generation cut for the old one."""
        self.store.update_attrs({"layout": self.layout.to_dict()})
        self.drop_other_layouts(committed)
        self.store.sync()

    def discard_step(self) -> str:
        """The step in progress diverged: let the writes it issued land, so that none lands
        behind a later run's reads (a failed one raises its own error), and never commit them:
        ``commit`` is not called for the step, and the step before it was committed when this
        one first read its state. Says where a run can go on: the last committed step, unless
        this step has already rewritten it in place, which leaves the store dirty."""
        self.pipeline.drain()
        path, committed = self.store.path, self.generations.committed()
        if committed is not None and self.generations.dirty() is not None:
            return (
                f'its updates were already written over step {committed["step"]} (store.mode = "in-place"), so '
                f"store {path} is dirty and will not resume; {way_out(self.generations)}"
            )
        if committed is None:  # a run resumed from a checkpoint into a store holding only checkpoints
            return f"store {path} has no committed step; {way_out(self.generations)}"
        return (
            f"store {path} still holds step {committed['step']}, its last committed step, which a resume continues from"
        )

    def save(self, tag: str, record: Callable[[], dict], keep: int) -> None:
        """Keep the committed step as checkpoint ``tag`` as the store mode does (its own
        committed record, so ``record`` is not asked for); then delete the oldest checkpoints
        beyond ``keep`` (0 keeps all). Done when it returns: nothing is left pending."""
        self.flush()
        if self._read_prefix != generation_prefix(self.committed_generation):
            raise ValueError(
                f"cannot keep checkpoint {tag!r} yet: this run resumed from {self._read_prefix} and has not "
                f"stepped since, so its state is that checkpoint, not the store's committed step; take a step first"
            )
        self.mode.keep(self, tag, keep)

    def take_io_bytes(self) -> tuple[int, int]:
        """Bytes the steps since the last call read and handed to write-back: a step's own
        traffic even while its writes are still landing (``commit(defer=True)``)."""
        counts = self._bytes_read, self._bytes_written
        self._bytes_read = self._bytes_written = 0
        return counts

    def nbytes(self) -> int:
        """This rank's share of the store's live generations on disk (checkpoints aside)."""
        return self.mode.live_generations * sum(self.form.unit_bytes(u) for u in self.layout.units)

    def held_bytes(self) -> dict[str, int]:
        return {"nvme": self.nbytes()}

    def close(self) -> None:
        """Commit a deferred step (the shared I/O runner is the engine's to close)."""
        self.flush()
