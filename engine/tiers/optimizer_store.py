"""The ``nvme`` optimizer tier: masters and AdamW moments live in the store between steps.

Each step streams every unit's three shards (master, exp_avg, exp_avg_sq, fp32) from the
committed generation into pooled host buffers ahead of the update, and writes them to the
next generation behind it; host memory for the state is bounded by the pool's budget,
whatever the model's size. When every rank's writes are durable the leader commits the
new generation, so the store is always a valid checkpoint.

A store resumes on any world size. A unit's content is the first ``numel`` elements of its
arrays whatever their padding, so a generation cut for other shards is read range by range
(each rank's new shard from the chunks that cover it, padding zeroed), and the first step
writes a generation cut for this run's shards; once it is committed the store records this
layout and is an ordinary store of the new world size.

A step can also be kept as a checkpoint (``save``), by rename when a later commit supersedes
its generation (see ``offload.generations``), and resumed from (``checkpoint=`` tag): its
first step reads the checkpoint and writes the store's next live generation, so the
checkpoint itself is never modified and can be resumed from again.

``store.mode = "in-place"`` halves the disk: each step rewrites the one committed generation,
unit by unit as it updates them, instead of writing the next. The first write of a step
marks the store dirty (durably, on every rank before its own first write), and the commit
clears the mark; a crash in between leaves the generation mixing two steps, so a dirty
store is refused and the error names its last checkpoint. Nothing supersedes the
generation, so ``save`` copies it to ``checkpoints/<tag>`` at once, each rank its own
chunks through one pool buffer. A store's mode is one of its attributes and may change
between runs: a pending keep is then taken by copy, and a generation cut for another world
size is replaced, never rewritten (its shards fall elsewhere), by writing a fresh one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from engine.runtime.sizes import FP32
from engine.tiers.optimizer import STATE_KINDS, ShardState
from engine.tiers.step_record import check_step_record
from engine.zero.partition import ModelLayout, UnitLayout
from offload import (
    KEEP,
    BufferPool,
    ChecksumError,
    Generations,
    HostBuffer,
    IORunner,
    ManifestError,
    Pipeline,
    PipelineStats,
    ShardStore,
    Stream,
    array_bytes,
    array_in_layout,
    array_name,
    create_arrays,
    generation_prefix,
    read_shard,
    shard_bytes,
    write_shard,
)

logger = logging.getLogger(__name__)

KINDS = STATE_KINDS
GENERATIONS = "generations"
IN_PLACE = "in-place"
MODES = (GENERATIONS, IN_PLACE)
MODE_ATTR = "store_mode"
"""Group attribute: the ``store.mode`` the store was last opened with (absent: generations)."""
GENERATIONS_ON_DISK = {GENERATIONS: 2, IN_PLACE: 1}
"""Live generations each mode keeps: the committed one and the one being written, or the one
rewritten in place (checkpoints come on top)."""


class DirtyStoreError(ValueError):
    """A store whose committed generation was being rewritten in place when its run stopped."""


def unit_state_bytes(unit: UnitLayout) -> int:
    """Host bytes to stage one unit's optimizer state on one rank."""
    return len(KINDS) * shard_bytes(unit, torch.float32)


def store_bytes(layout: ModelLayout, mode: str = GENERATIONS) -> int:
    """Disk the optimizer state takes for all ranks, in the live generations of ``mode``."""
    return GENERATIONS_ON_DISK[mode] * len(KINDS) * sum(array_bytes(u, torch.float32) for u in layout.units)


def check_mode(mode: str) -> None:
    """Refuse an unknown mode by name (the config checks it too, but the class is also used directly)."""
    if mode not in MODES:
        raise ValueError(f"store.mode = {mode!r}: use one of {', '.join(map(repr, MODES))}")


def check_nvme_path(path: Path, layout: ModelLayout, mode: str = GENERATIONS) -> None:
    """Refuse, before any work, a path that cannot hold the store (missing rights or space)."""
    parent = path if path.exists() else path.parent
    if not parent.exists():
        raise FileNotFoundError(
            f"offload.nvme_path = {str(path)!r}: its parent folder {parent} does not exist; create it"
        )
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"offload.nvme_path = {str(path)!r}: {parent} is not writable; choose a writable folder")
    need, free = store_bytes(layout, mode), shutil.disk_usage(parent).free
    if need > free:
        in_place = store_bytes(layout, IN_PLACE)
        hint = (
            f'; store.mode = "in-place" needs {in_place / 2**30:.2f} GiB (one generation rewritten each step; '
            f"after a crash mid-step only an explicit checkpoint resumes)"
            if mode != IN_PLACE and in_place <= free
            else "; free some space or choose another nvme_path"
        )
        raise OSError(
            f"offload.nvme_path = {str(path)!r}: the store needs {need / 2**30:.2f} GiB "
            f"({GENERATIONS_ON_DISK[mode]} generation(s) of fp32 master, exp_avg and exp_avg_sq, store.mode = {mode!r}) "
            f"but only {free / 2**30:.2f} GiB are free there{hint}"
        )


def way_out(generations: Generations) -> str:
    """What a user does with a store whose live state cannot be read: resume from its last
    checkpoint (named, with the command), or, without one, start afresh."""
    try:
        latest = generations.latest_checkpoint()
    except ValueError:  # the checkpoints' own records are damaged too
        return "restore the damaged file from a backup"
    if latest:
        return (
            f"resume from its last checkpoint, {latest!r}: `python -m engine train --from-checkpoint {latest}` "
            f"(in Python: Engine.resume(model, config, checkpoint={latest!r}))"
        )
    return (
        f"it holds no checkpoint to resume from, so remove {generations.store.path} and start afresh, or restore it "
        f"from a backup (checkpoint.interval keeps checkpoints to fall back to)"
    )


@contextlib.contextmanager
def naming_way_out(generations: Generations) -> Iterator[None]:
    """Add ``way_out`` to a damaged-store error (a bad record, a bad chunk) raised inside."""
    try:
        yield
    except (ManifestError, ChecksumError) as err:
        raise type(err)(f"{err}; {way_out(generations)}") from None


def check_clean(generations: Generations) -> None:
    """Refuse a dirty store (its committed generation mixes two steps), naming the way out:
    its last checkpoint, or removing it."""
    mark = generations.dirty()
    if mark is None:
        return
    raise DirtyStoreError(
        f'store {generations.store.path} is dirty: its run (store.mode = "in-place") stopped while rewriting generation '
        f"{mark['generation']}, committed at step {mark['step']}, so that generation mixes two steps and cannot be "
        f"read; {way_out(generations)}"
    )


def resume_point(path: Path) -> tuple[bool, str | None]:
    """Where a run continues the store at ``path`` unaided: ``(True, None)`` from its last
    committed step; ``(True, tag)`` from its last checkpoint, when it was stopped mid-step
    while rewritten in place; ``(False, None)`` when there is nothing to continue (no store,
    no committed step, or a store stopped mid-step in place that keeps no checkpoint: its
    state is lost, and a new run replaces it)."""
    if not (path / "COMMITTED").is_file():
        return False, None
    with IORunner(threads=1) as runner:
        generations = Generations(ShardStore.open(path, runner=runner))
        with naming_way_out(generations):
            if not generations.dirty():
                return True, None
            latest = generations.latest_checkpoint()
    return latest is not None, latest


def first_difference(stored: ModelLayout, current: ModelLayout, path: Path) -> None:
    """Refuse a store written for another model, naming the first difference. Another world
    size (or chunk size) is no difference: only the shards are cut differently."""
    stored_params = [(u.name, p.name, p.shape) for u in stored.units for p in u.params]
    current_params = [(u.name, p.name, p.shape) for u in current.units for p in u.params]
    for old, new in zip(stored_params, current_params, strict=False):  # a longer side is reported below
        if old != new:
            raise ValueError(
                f"store {path} does not match this model: the store has parameter {old[1]!r} with shape "
                f"{list(old[2])} in unit {old[0]!r} where the model has {new[1]!r} with shape {list(new[2])} "
                f"in unit {new[0]!r}; resume with the model the store was trained with"
            )
    if len(stored_params) != len(current_params):
        longer, which = (
            (stored_params, "store") if len(stored_params) > len(current_params) else (current_params, "model")
        )
        raise ValueError(
            f"store {path} does not match this model: the {which} has {len(longer) - min(len(stored_params), len(current_params))} "
            f"more parameter(s), first {longer[min(len(stored_params), len(current_params))][1]!r}"
        )


class StoreOptimizerState:
    """Optimizer shards in a zarr store, streamed through a byte-bounded pipeline."""

    def __init__(
        self,
        path: Path,
        layout: ModelLayout,
        rank: int,
        *,
        buffer_bytes: int,
        io_threads: int,
        checksum: bool,
        direct_io: bool,
        barrier: Callable[[], None],
        resume: bool = False,
        checkpoint: str | None = None,
        mode: str = GENERATIONS,
    ):
        check_mode(mode)
        largest = max(layout.units, key=unit_state_bytes)
        if buffer_bytes < 2 * unit_state_bytes(largest):
            need_mb = -(-2 * unit_state_bytes(largest) // 2**20)
            raise ValueError(
                f"offload.buffer_mb = {buffer_bytes // 2**20}: unit {largest.name!r} needs "
                f"{unit_state_bytes(largest) / 2**20:.1f} MiB of host buffer to stage its optimizer state, "
                f"twice that to read one unit while writing another; set offload.buffer_mb >= {need_mb}"
            )
        self.layout, self.rank, self.mode = layout, rank, mode
        self._barrier = barrier
        self._leader = rank == 0
        self.runner = IORunner(threads=io_threads)
        self.pool = BufferPool(buffer_bytes)
        self.pipeline: Pipeline[UnitLayout] = Pipeline(self.pool, self.runner, window_bytes=buffer_bytes // 2)
        self.last_stats = PipelineStats()
        self._held: dict[str, HostBuffer] = {}
        self._copy_bytes = buffer_bytes // 2  # a checkpoint copy's buffer: room for it beside a stream's window
        if self._leader and not resume:
            check_nvme_path(path, layout, mode)
            attrs = {"layout": layout.to_dict(), MODE_ATTR: mode}
            abandoned = self._check_new(path)
            ShardStore.create(
                path, attrs, runner=self.runner, checksum=checksum, direct_io=direct_io, overwrite=abandoned
            )
        barrier()
        self.store = ShardStore.open(path, runner=self.runner, direct_io=direct_io)
        self.generations = Generations(self.store)
        if self._leader and resume:
            with naming_way_out(self.generations):
                self.generations.tidy()
        self._committed = 0  # the live committed generation
        self._target = 0  # the generation the next step writes: the one after it, or itself in place
        self._marked = False  # this step has marked the store dirty
        self._read_prefix = generation_prefix(0)  # where the next step reads: it, or a checkpoint
        self._generation_zero_ready = False
        self._layout_adopted = True  # the store's attributes and committed arrays are this layout
        self._deferred: dict | None = None  # the record of a step whose commit waits for ``settle``
        self._bytes_read = self._bytes_written = 0  # by the steps since ``take_io_bytes``
        self.resumed_from: dict | None = None
        if resume:
            with naming_way_out(self.generations):
                self.resumed_from = self._check_resumable(path, layout, checkpoint)

    def _check_new(self, path: Path) -> bool:
        """Whether a new store may be made at ``path``: nothing there (False), or a store that
        keeps no checkpoint and either never committed its first step or was stopped mid-step
        while rewritten in place (True: nothing in it can be resumed, so it is replaced)."""
        if not (path / "zarr.json").exists():
            return False
        existing = ShardStore.open(path, runner=self.runner)
        generations = Generations(existing)
        with naming_way_out(generations):
            live, kept = generations.committed(), generations.checkpoints()
            lost = live is not None and generations.dirty() is not None
        if (live is None or lost) and not kept:
            why = (
                "was stopped mid-step while rewritten in place and keeps no checkpoint"
                if lost
                else "never committed its first step"
            )
            logger.warning("%s holds a store that %s: nothing in it can be resumed, starting afresh", path, why)
            return True
        how = (
            "resume from it (run the same command again: `python -m engine train` continues a store), "
            if live
            else f"it holds only checkpoints ({', '.join(kept)}): resume from one with --from-checkpoint TAG, "
        )
        raise FileExistsError(
            f"offload.nvme_path = {str(path)!r} already holds a store: {how}or remove it, or choose another nvme_path"
        )

    def _check_resumable(self, path: Path, layout: ModelLayout, checkpoint: str | None) -> dict:
        """The record to resume from (the committed one, or checkpoint ``checkpoint``'s) of an
        existing store of this model, as this world size resumes it; the next generation made
        ready to write, cut for this layout."""
        live = self.generations.committed()
        if live is None and checkpoint is None:
            tags = list(self.generations.checkpoints())
            raise FileNotFoundError(
                f"store {path} holds only checkpoints written from memory ({', '.join(tags)}): resume from "
                f"one of those (checkpoint=, or --from-checkpoint)"
                if tags
                else f"store {path} has no COMMITTED record: its first step never finished, so there is nothing "
                f"to resume; remove it and start afresh"
            )
        self.generations.checkpoints()  # every kept record is checked before retention or a fallback relies on it
        stored = ModelLayout.from_dict(self.store.attrs["layout"])
        first_difference(stored, layout, path)
        if checkpoint is None:
            check_clean(self.generations)
        elif self.generations.dirty():
            logger.warning("store %s is dirty: the first step rewrites it from checkpoint %s", path, checkpoint)
        if self._leader:
            self._record_mode(path)
            # A crash between a commit and the keeping of the generation it superseded leaves
            # that generation to keep: before any of it is dropped or recycled. A store of
            # checkpoints only has no live generation: whatever else is there is a leftover.
            if live:
                self.generations.keep_superseded()
            else:
                self.generations.drop_uncommitted()
        self._barrier()
        # Without a live generation the run starts its own above the checkpoints' numbers.
        self._committed = live["generation"] if live else self.generations.next_free() - 1
        self._read_prefix = generation_prefix(self._committed)
        if checkpoint is None:
            record = self.generations.own_record()  # the step's own, not the store's bookkeeping
            check_step_record(record, str(path / "COMMITTED"))
        else:
            self._read_prefix, record = self.generations.checkpoint(checkpoint)
            check_step_record(record, str(path / self._read_prefix / "COMMITTED"))
            logger.info("resuming from checkpoint %s (step %s) of %s", checkpoint, record.get("step"), path)
        self._layout_adopted = stored == layout and self._in_layout(self._read_prefix)
        if not self._layout_adopted:
            logger.info(
                "store %s holds shards cut for %d rank(s): read as shards of %d until the first step commits its own",
                path,
                stored.world_size,
                layout.world_size,
            )
        if self.mode == IN_PLACE:
            self._open_in_place(live)
        else:
            self._target = self._committed + 1
            if self._leader:
                self._drop_other_layouts(committed=self._committed)
                self.generations.prepare(self._target, self._create_arrays)
        self._barrier()
        return record

    def _record_mode(self, path: Path) -> None:
        """Note this run's mode in the store's attributes, if it differs from the last run's:
        either way round is safe (a dirty store is refused before, a pending keep is taken by
        copy in ``_open_in_place``)."""
        previous = self.store.attrs.get(MODE_ATTR, GENERATIONS)
        if previous != self.mode:
            logger.info("store %s was written with store.mode = %r; continuing with %r", path, previous, self.mode)
            self.store.update_attrs({MODE_ATTR: self.mode})

    def _open_in_place(self, live: dict | None) -> None:
        """Make the next step's target ready in place: the committed generation if it is cut for
        this layout, else (another world size, or no live generation) a fresh one, which the
        commit then makes the only one. A keep still pending from the generations mode is
        taken now, by copy, since no step will supersede the generation it names."""
        request = live.get(KEEP) if live else None
        if request:
            if request["tag"] not in self.generations.checkpoints():  # else a crash came after the copy
                self._keep_by_copy(request["tag"], self.generations.own_record(), request["retain"])
            if self._leader:
                self.generations.drop_keep_request()
        in_place = live is not None and self._in_layout(generation_prefix(self._committed))
        self._target = self._committed if in_place else self._committed + 1
        if self._leader:
            self.generations.drop_uncommitted()  # leftovers: a generations-mode target, a copy cut short
            if not in_place:
                self.generations.prepare(self._target, self._create_arrays)

    def _in_layout(self, prefix: str) -> bool:
        return all(
            array_in_layout(self.store, array_name(prefix, unit.name, kind), unit)
            for unit in self.layout.units
            for kind in KINDS
        )

    def _drop_other_layouts(self, committed: int) -> None:
        """Delete the uncommitted generations not cut for this layout (another world size's):
        recycling one as the next write target would hand the step arrays of the wrong shape,
        so ``Generations.prepare`` creates that generation afresh instead."""
        for generation in self.generations.on_disk():
            if generation != committed and not self._in_layout(generation_prefix(generation)):
                self.store.delete(generation_prefix(generation))

    def _create_arrays(self, prefix: str) -> None:
        create_arrays(self.store, prefix, self.layout.units, KINDS, torch.float32)

    def add_unit(self, unit: UnitLayout, master: torch.Tensor) -> None:
        """Write the unit's initial master and zero moments to generation 0."""
        if not self._generation_zero_ready:
            if self._leader:
                self.generations.prepare(0, self._create_arrays)
            self._barrier()
            self._generation_zero_ready = True
        with self.pool.acquire(unit_state_bytes(unit)) as buf:
            state = self._views(unit, buf)
            state.master.copy_(master)
            state.exp_avg.zero_()
            state.exp_avg_sq.zero_()
            self._save(unit, buf, generation=0)

    def seal(self) -> None:
        """Commit generation 0: from here on the store is a valid checkpoint."""
        self._commit(0, {"step": 0})

    def _views(self, unit: UnitLayout, buf: HostBuffer) -> ShardState:
        n = unit.shard_numel
        return ShardState(*(buf.view(torch.float32, n, i * n * FP32) for i in range(len(KINDS))))

    def _load(self, unit: UnitLayout, buf: HostBuffer) -> None:
        with naming_way_out(self.generations):
            read_shard(self.store, self._read_prefix, unit, self.rank, self._views(unit, buf).views())

    def _save(self, unit: UnitLayout, buf: HostBuffer, generation: int | None = None) -> None:
        prefix = generation_prefix(self._target if generation is None else generation)
        write_shard(self.store, prefix, unit, self.rank, self._views(unit, buf).views())

    def read_masters(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """Each unit's committed master shard, streamed (to rebuild parameters on resume)."""
        for unit, buf in self.pipeline.stream(
            self.layout.units, nbytes=unit_state_bytes, load=self._load, describe=lambda u: f"master of unit {u.name}"
        ):
            try:
                yield unit, self._views(unit, buf).master
            finally:
                self.pipeline.release(buf)
        self.pipeline.drain()  # its reads are the resume's, not the next step's

    def stream(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        """The units' state in order; the first reads are issued now, not at the first ``next``.
        They read the last step's generation, so a deferred commit of it is made first (the
        engine has made it already, at the top of the step's last backward; a direct caller
        such as ``benchmarks.optimizer`` relies on this)."""
        self.settle()
        stream = self.pipeline.stream(
            units, nbytes=unit_state_bytes, load=self._load, describe=lambda u: f"optimizer state of unit {u.name}"
        )
        return self._hand_over(stream)

    def _hand_over(self, stream: Stream[UnitLayout]) -> Iterator[tuple[UnitLayout, ShardState]]:
        with stream:
            for unit, buf in stream:
                self._held[unit.name] = buf
                self._bytes_read += buf.nbytes
                yield unit, self._views(unit, buf)

    def done(self, unit: UnitLayout, state: ShardState) -> None:
        if self._target == self._committed and not self._marked:
            # The first write over the committed generation: from here until the commit a
            # crash leaves it mixing two steps, which the durable mark lets every reader see.
            self.generations.mark_dirty()
            self._marked = True
        buf = self._held.pop(unit.name)
        self._bytes_written += buf.nbytes
        self.pipeline.write_back(unit, buf, self._save, describe=lambda u: f"optimizer state of unit {u.name}")

    def finish(self, record: dict, *, defer: bool = False) -> None:
        """Wait for the step's writes, make them durable on every rank, then commit. With
        ``defer`` the writes go on in the background and the commit waits for ``settle``
        (called by the engine at the next step's last backward, and by ``stream``, ``save`` and
        ``close``): the next step's forward then hides them. Until then the store's last commit is the step before this one."""
        if defer:
            self._deferred = record
            return
        self.last_stats = self.pipeline.drain()
        self._commit(self._target, record)

    def discard_step(self) -> str:
        """The step in progress diverged: let the writes it issued land, so that none lands
        behind a later run's reads (a failed one raises its own error), and never commit them:
        ``finish`` is not called for the step, and the step before it was committed when this
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

    @property
    def commit_pending(self) -> bool:
        return self._deferred is not None

    def settle(self) -> None:
        """Commit a deferred step now (every rank calls this at the same point: it synchronises)."""
        record, self._deferred = self._deferred, None
        if record is not None:
            self.finish(record)

    def _commit(self, generation: int, record: dict) -> None:
        self.store.sync()
        self._barrier()
        if self._leader:
            self.generations.commit(generation, record)
            if not self._layout_adopted:
                self._adopt_layout(generation)
            if self.mode == IN_PLACE:
                if generation != self._committed:
                    self.generations.drop_uncommitted()  # the generation a fresh target replaced
            else:
                self.generations.prepare(generation + 1, self._create_arrays)
        self._barrier()
        self._committed = generation
        self._target = generation if self.mode == IN_PLACE else generation + 1
        self._marked = False
        self._read_prefix = generation_prefix(generation)
        self._layout_adopted = True

    def save(self, tag: str, keep: int) -> None:
        """Keep the committed step as checkpoint ``tag``: by rename once the next commit
        supersedes it (the request is in ``COMMITTED``, so it survives a crash), or in place,
        where nothing supersedes it, by a copy now; then delete the oldest checkpoints beyond
        ``keep`` (0 keeps all)."""
        self.settle()
        if self._read_prefix != generation_prefix(self._committed):
            raise ValueError(
                f"cannot keep checkpoint {tag!r} yet: this run resumed from {self._read_prefix} and has not "
                f"stepped since, so its state is that checkpoint, not the store's committed step; take a step first"
            )
        if self.mode == IN_PLACE:
            check_clean(self.generations)  # after a failed step: a copy would keep a mix of two steps
            self.generations.check_free_tag(tag)  # on every rank, so that all of them raise or none
            self._keep_by_copy(tag, self.generations.own_record(), keep)
            return
        self.generations.check_new_tag(tag)  # on every rank, so that all of them raise or none
        self._barrier()
        if self._leader:
            self.generations.keep(tag, retain=keep)
        self._barrier()

    def _keep_by_copy(self, tag: str, record: dict, retain: int) -> None:
        """Copy the committed generation to a fresh one, each rank its share of the chunks
        through one pool buffer, then keep that as ``checkpoints/<tag>`` with ``record`` (it
        appears whole or not at all) and apply ``retain``."""
        generation = self.generations.next_free()  # on every rank before the leader creates it
        source, copy = generation_prefix(self._committed), generation_prefix(generation)
        self._barrier()
        if self._leader:
            self.generations.create_like(source, copy)
        self._barrier()
        with self.pool.acquire(self._copy_bytes) as buf:
            part = (self.rank, self.layout.world_size)
            self.generations.copy(source, copy, buf.view(torch.uint8, buf.nbytes), part=part)
        self.store.sync()
        self._barrier()
        if self._leader:
            self.generations.keep_generation(tag, {**record, "generation": generation}, retain=retain)
        self._barrier()

    def _adopt_layout(self, committed: int) -> None:
        """Once generation ``committed``, of this layout, is committed: record the layout, so the
        store describes what it holds, and drop the superseded generation cut for the old one."""
        self.store.update_attrs({"layout": self.layout.to_dict()})
        self._drop_other_layouts(committed)
        self.store.sync()

    def take_io_bytes(self) -> tuple[int, int]:
        """Bytes the steps since the last call read and handed to write-back: a step's own
        traffic even while its writes are still landing (``finish(defer=True)``)."""
        counts = self._bytes_read, self._bytes_written
        self._bytes_read = self._bytes_written = 0
        return counts

    def nbytes(self) -> int:
        """This rank's share of the store's live generations on disk (checkpoints aside)."""
        return GENERATIONS_ON_DISK[self.mode] * sum(unit_state_bytes(u) for u in self.layout.units)

    def close(self) -> None:
        """Commit a deferred step, then stop the I/O threads."""
        try:
            self.settle()
        finally:
            self.runner.close()
