"""Generations of a store: the one a step reads, the one it writes, the flip between them,
and the ones kept as checkpoints.

Step N reads generation ``g`` and writes ``g + 1``; only once every write is durable does
``COMMITTED`` name ``g + 1``. A crash at any instant leaves ``COMMITTED`` naming a complete
generation, so the store is always a valid checkpoint. The superseded generation's
directory is then renamed to be the next write target: a rename costs nothing, and its
arrays' metadata (which holds no path) stays valid, so no step pays for creating arrays.

Keeping a checkpoint is the same rename to another name. The committed generation is still
the live state the next step reads, so ``keep`` only records the request in ``COMMITTED``;
the commit that supersedes the generation carries the request (with the record the
generation was committed with) into its own record, and the generation is then renamed to
``checkpoints/<tag>`` instead of being recycled. Each of those moves is atomic and the
request stays in ``COMMITTED`` until it is done, so a crash at any instant loses no
checkpoint: whichever run commits or opens the store next completes it.

A store short of disk may instead rewrite its one committed generation in place. A crash
mid-step then leaves it mixing two steps, so before the first write over it a ``DIRTY``
mark naming the commit it overwrites is made durable, and reading such a store is refused.
Every commit carries a serial number one above the last: the mark applies only while
``COMMITTED`` still holds the serial it names, so a new commit clears it atomically, with
no window in which a finished step looks unfinished, and any writer may make the mark
without waiting for the others. Nothing supersedes a generation rewritten in place, so its
checkpoints are copies (``create_like`` and ``copy``), chunk by chunk through the store's
own checked reads and writes, then kept as a written generation is.

A store made for a run carries a ``NEW`` mark (``mark_new``) until its first commit or its first
kept checkpoint: the only proof that a store without ``COMMITTED`` never committed anything.
A store holding neither lost its ``COMMITTED`` (a bad copy, a restore that skipped a file), and
may hold days of training: nothing may replace it unasked.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from offload.buffers import DIRECT_ALIGN
from offload.manifest import ManifestError, commit, read_committed
from offload.store import ShardStore

logger = logging.getLogger(__name__)

_GENERATION = re.compile(r"^gen-(\d+)$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

CHECKPOINTS = "checkpoints"
"""The store group holding the kept generations, one ``<tag>`` group each."""
KEEP = "keep"
"""Key of ``COMMITTED``: the committed generation is to be kept as ``{"tag", "retain"}``."""
SUPERSEDED = "superseded"
"""Key of ``COMMITTED``: the previous generation, to be kept as ``{"tag", "retain", "record"}``."""
SERIAL = "serial"
"""Key of ``COMMITTED``: how many commits the store has had, this one included."""
PREVIOUS = "previous"
"""Key of ``COMMITTED`` in a store committed together with other hosts' stores: the record it
replaced, which ``roll_back`` restores."""
DIRTY = "DIRTY"
"""The file marking the committed generation as being rewritten: ``{"generation", "step", "over"}``,
``over`` the serial of the commit it overwrites."""
NEW = "NEW"
"""The file marking a store as made and not yet committed to (no commit, no kept checkpoint)."""
_BOOKKEEPING = (KEEP, SUPERSEDED, SERIAL, PREVIOUS)


class CheckpointExistsError(FileExistsError):
    """A checkpoint tag that is already kept, or already asked for."""


def generation_prefix(generation: int) -> str:
    if not _is_count(generation):
        raise ValueError(f"a generation is a non-negative integer, not {generation!r}")
    return f"gen-{generation}"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_fields(path: Any, record: dict[str, Any], counts: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Refuse a record read from the store whose fields are not what the engine writes: each
    name in ``counts`` a non-negative integer (those in ``optional`` may be absent)."""
    for key in counts:
        if key in optional and key not in record:
            continue
        if not _is_count(record.get(key)):
            found = f"holds {record[key]!r}" if key in record else "is missing"
            raise ManifestError(
                f"{path}: field {key!r} {found}, where a non-negative integer belongs; the file was changed outside "
                f"the engine: restore it from a backup, or resume from a checkpoint"
            )


def _check_request(path: Any, field: str, request: Any, with_record: bool) -> None:
    """Refuse a checkpoint request (``keep``/``superseded``) that is not a valid tag and count."""
    if not isinstance(request, dict):
        raise ManifestError(
            f"{path}: field {field!r} holds {request!r}, not a checkpoint request; restore it from a backup"
        )
    try:
        check_tag(request.get("tag"))
    except ValueError as err:
        raise ManifestError(f"{path}: field {field!r}: {err}; restore it from a backup") from None
    _check_fields(f"{path} field {field!r}", request, ("retain",))
    if with_record:
        kept = request.get("record")
        if not isinstance(kept, dict):
            raise ManifestError(
                f"{path}: field {field!r} has no record of the generation to keep; restore it from a backup"
            )
        _check_fields(f"{path} field {field!r}", kept, ("generation",))


def checkpoint_prefix(tag: str) -> str:
    return f"{CHECKPOINTS}/{tag}"


def check_tag(tag: object) -> None:
    """Refuse a tag that is not one plain directory name (it becomes ``checkpoints/<tag>``)."""
    if not isinstance(tag, str) or not _TAG.match(tag) or tag == "zarr.json":
        raise ValueError(
            f"invalid checkpoint tag {tag!r}: use 1 to 128 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit (e.g. 'step-100')"
        )


def _own_record(record: dict[str, Any]) -> dict[str, Any]:
    """A committed record without the store's bookkeeping (checkpoint requests, serial): what a
    checkpoint keeps."""
    return {k: v for k, v in record.items() if k not in _BOOKKEEPING}


class Generations:
    """The committed generation of a store, the preparation of the next one, and checkpoints."""

    def __init__(self, store: ShardStore):
        self.store = store

    def committed(self) -> dict[str, Any] | None:
        """The last committed record (``generation``, ``step``, ...), or None for a new store;
        a record whose bookkeeping is malformed, or that names a generation the store does not
        hold, is refused (``ManifestError``) before any of it is used."""
        path = self.store.path / "COMMITTED"
        record = read_committed(self.store.path)
        if record is None:
            return None
        _check_fields(path, record, ("generation", SERIAL), optional=(SERIAL,))
        for field, with_record in ((KEEP, False), (SUPERSEDED, True)):
            if field in record:
                _check_request(path, field, record[field], with_record)
        if not (self.store.path / generation_prefix(record["generation"]) / "zarr.json").is_file():
            held = ", ".join(generation_prefix(g) for g in self.on_disk()) or "none"
            raise ManifestError(
                f"{path} names generation {record['generation']}, which the store does not hold (generations on disk: "
                f"{held}); the file was changed outside the engine: restore it from a backup, or resume from a checkpoint"
            )
        return record

    def mark_new(self) -> None:
        """Mark a store just made as holding nothing committed yet (``is_new``), durably."""
        commit(self.store.path, {}, name=NEW)

    def is_new(self) -> bool:
        """Whether the store never committed a step nor kept a checkpoint since it was made: its
        ``NEW`` mark is there and no ``COMMITTED`` (which wins over a mark a crash left behind)."""
        return (self.store.path / NEW).is_file() and not (self.store.path / "COMMITTED").exists()

    def _settle(self) -> None:
        """Drop the ``NEW`` mark once something is committed or kept (``COMMITTED`` or a kept
        checkpoint already outranks a mark a crash leaves, so the removal need not be durable)."""
        (self.store.path / NEW).unlink(missing_ok=True)

    def on_disk(self) -> list[int]:
        """Every generation directory present, committed or not, in order."""
        found = (_GENERATION.match(p.name) for p in self.store.path.iterdir() if p.is_dir())
        return sorted(int(m[1]) for m in found if m)

    def tidy(self) -> None:
        """Remove what an interrupted run left: half-built or half-removed groups, and any
        generation folder without its metadata (from a version that created generations in
        place). For the store's one writer, before its first write."""
        self.store.nodes.sweep()
        record = self.committed()
        for generation in self.on_disk():
            prefix = generation_prefix(generation)
            if not (self.store.path / prefix / "zarr.json").is_file() and (
                not record or generation != record["generation"]
            ):
                self.store.nodes.delete(prefix)
                logger.info("removed %s, an incomplete generation left by an interrupted run", prefix)

    def prepare(self, generation: int, create: Callable[[str], None]) -> None:
        """Make ``gen-<generation>`` ready to be written: recycle a superseded generation's
        directory by renaming it, or, if there is none, ``create(prefix)`` its arrays under a
        staging name and rename them into place (a crash meanwhile leaves no half-made
        generation). A superseded generation still to be kept as a checkpoint is kept first,
        never recycled."""
        self.keep_superseded()
        target = generation_prefix(generation)
        present = self.on_disk()
        if generation in present:
            return
        record = self.committed()
        stale = [g for g in present if not record or g != record["generation"]]
        if stale:
            self.store.nodes.move(generation_prefix(stale[0]), target)
            logger.debug("recycled %s as %s", generation_prefix(stale[0]), target)
        else:
            self.store.nodes.build(target, create)

    def commit(self, generation: int, record: dict[str, Any], together: bool = False) -> None:
        """Name ``generation`` as the committed one, atomically (after ``store.sync()``), with the
        next serial, which voids any dirty mark; the generation it supersedes, if asked to be
        kept, is then kept as its checkpoint.

        ``together``: this store is one of several (one a host) that commit each step together.
        The record replaced is kept in the new one (``PREVIOUS``), and the superseded generation
        is left as it is, for ``keep_superseded`` or ``prepare`` once every store has committed:
        until then a resume may have to ``roll_back`` to it."""
        reserved = [k for k in _BOOKKEEPING if k in record]
        if reserved:
            raise ValueError(
                f"the key {reserved[0]!r} of a committed record is reserved for the store's bookkeeping; rename it"
            )
        previous = self.committed()
        request = previous.get(KEEP) if previous else None
        carried = {SUPERSEDED: {**request, "record": _own_record(previous)}} if previous and request else {}
        serial = (previous.get(SERIAL, 0) if previous else 0) + 1
        if together and previous:
            carried[PREVIOUS] = {k: v for k, v in previous.items() if k != PREVIOUS}
        commit(self.store.path, {**record, **carried, "generation": generation, SERIAL: serial})
        # The new serial already voids any dirty mark; removing the file only tidies up.
        (self.store.path / DIRTY).unlink(missing_ok=True)
        self._settle()
        if not together:
            self.keep_superseded()

    def previous(self) -> dict[str, Any] | None:
        """The record the committed one replaced, if this store was committed ``together`` and
        still holds that record's generation (it is recycled once every store has committed)."""
        record = self.committed()
        previous = record.get(PREVIOUS) if record else None
        if not isinstance(previous, dict) or not _is_count(previous.get("generation")):
            return None
        held = (self.store.path / generation_prefix(previous["generation"]) / "zarr.json").is_file()
        return previous if held else None

    def roll_back(self) -> None:
        """Make the previous record (``previous``) the committed one again, with the next serial:
        for a store that committed a step the other stores of its run did not."""
        record, previous = self.committed(), self.previous()
        if record is None or previous is None:
            raise ManifestError(
                f"store {self.store.path} cannot go back to the step before its committed one: it no longer holds it"
            )
        commit(self.store.path, {**previous, SERIAL: record.get(SERIAL, 0) + 1})
        logger.info("store %s went back from step %s to step %s", self.store.path, record["step"], previous["step"])

    def own_record(self) -> dict[str, Any]:
        """The committed record as a checkpoint of it keeps it (without the store's bookkeeping)."""
        record = self.committed()
        if record is None:
            raise ValueError(f"store {self.store.path} has no committed step; take a step first")
        return _own_record(record)

    # ------------------------------------------------------- rewriting in place

    def mark_dirty(self) -> None:
        """Record, durably, that the committed generation is about to be overwritten in place.
        Idempotent, and every writer may call it without waiting for the others: each makes
        the mark before its own first write, so no write precedes a mark."""
        record = self.committed()
        if record is None:
            raise ValueError(
                f"store {self.store.path} has no committed generation to rewrite in place; commit one first"
            )
        mark = {"generation": record["generation"], "step": record.get("step"), "over": record.get(SERIAL, 0)}
        commit(self.store.path, mark, name=DIRTY)

    def dirty(self) -> dict[str, Any] | None:
        """The dirty mark if it holds (the committed generation was being rewritten and no commit
        has followed), else None: a mark a later commit voided is ignored."""
        mark = read_committed(self.store.path, DIRTY)
        record = self.committed()
        if mark is None or record is None:
            return None
        _check_fields(self.store.path / DIRTY, mark, ("generation", "over"))
        return mark if mark["over"] == record.get(SERIAL, 0) else None

    def drop_keep_request(self) -> None:
        """Withdraw the committed generation's pending ``keep``: for a store that will rewrite
        that generation in place, once the checkpoint is kept by copy instead."""
        record = self.committed()
        if record and KEEP in record:
            commit(self.store.path, {k: v for k, v in record.items() if k != KEEP})

    def create_like(self, source: str, target: str) -> None:
        """Create under ``target`` an empty array like each array under ``source`` (same size,
        chunks and dtype), whole or not at all: the destination of ``copy``."""

        def create(staging: str) -> None:
            for name in self._arrays(source):
                info = self.store.array_info(name)
                self.store.create_array(staging + name[len(source) :], info.numel, info.chunk_elems, info.dtype)

        self.store.nodes.build(target, create)

    def copy(self, source: str, target: str, buffer: torch.Tensor, part: tuple[int, int] = (0, 1)) -> None:
        """Copy the chunks of every array under ``source`` into the array of the same name under
        ``target`` (see ``create_like``), through ``buffer`` (uint8) only, whatever the sizes.

        ``part = (index, parts)`` copies that share of each array's chunks, so that ``parts``
        processes copy one generation together without two writing one chunk. Chunks go
        through the store's checked reads and writes: damage in the source is reported now,
        not when the copy is needed, and every chunk is written with its CRC-32C. The buffer is
        used in two halves, the reads into one overlapping the writes from the other.
        Durable at the store's next ``sync()``."""
        index, parts = part
        half = buffer.numel() // 2 // DIRECT_ALIGN * DIRECT_ALIGN  # each half starts aligned, for O_DIRECT
        halves = (buffer[:half], buffer[half : 2 * half])
        writes: list[Future | None] = [None, None]
        turn = 0
        try:
            for name in self._arrays(source):
                info = self.store.array_info(name)
                per_batch = half // info.chunk_bytes
                if per_batch == 0:
                    need = 2 * -(-info.chunk_bytes // DIRECT_ALIGN) * DIRECT_ALIGN
                    raise ValueError(
                        f"a copy buffer of {buffer.numel()} bytes cannot hold two {info.chunk_bytes}-byte chunks of "
                        f"array {name!r}; pass a buffer of at least {need} bytes"
                    )
                first, end = info.nchunks * index // parts, info.nchunks * (index + 1) // parts
                for batch in range(first, end, per_batch):
                    count = min(per_batch, end - batch)
                    pending = writes[turn]
                    if pending is not None:
                        pending.result()  # this half is still being written from
                    data = halves[turn][: count * info.chunk_bytes].view(info.dtype)
                    crcs = self.store.read_async(name, batch * info.chunk_elems, data).result()
                    writes[turn] = self.store.write_async(  # the CRCs just verified: none computed twice
                        target + name[len(source) :], batch * info.chunk_elems, data, crcs
                    )
                    turn ^= 1
        finally:
            # The writes read from ``buffer``, which the caller reuses: none may outlive this call.
            outstanding = [write for write in writes if write is not None]
            for write in outstanding:
                write.exception()
        for write in outstanding:
            write.result()

    def _arrays(self, prefix: str) -> list[str]:
        """Every array under the group ``prefix``."""
        return [name for name in self.store.array_names() if name.startswith(prefix + "/")]

    # ------------------------------------------------------------- checkpoints

    def check_free_tag(self, tag: str) -> None:
        """Refuse a tag that is invalid, kept, or asked for: what any new checkpoint must pass."""
        check_tag(tag)
        directory = self.store.path / checkpoint_prefix(tag)
        if directory.exists():
            raise CheckpointExistsError(
                f"checkpoint {tag!r} already exists ({directory}): choose another tag, or delete that "
                f"folder to reuse the name"
            )
        record = self.committed()
        request = record.get(KEEP) if record else None
        if record and request and request["tag"] == tag:
            raise CheckpointExistsError(
                f"checkpoint {tag!r} is already asked for (step {record.get('step')}, kept when the next step "
                f"commits): choose another tag"
            )

    def check_new_tag(self, tag: str) -> None:
        """Refuse, before anything changes, a request ``keep(tag, ...)`` would refuse."""
        self.check_free_tag(tag)
        record = self.committed()
        if record is None:
            raise ValueError(
                f"store {self.store.path} has no committed step to keep as checkpoint {tag!r}; take a step first"
            )
        request = record.get(KEEP)
        if request:
            raise ValueError(
                f"step {record.get('step')} is already to be kept as checkpoint {request['tag']!r}, and a step is "
                f"kept once: resume from {request['tag']!r}, or take a step before keeping another checkpoint"
            )

    def keep(self, tag: str, retain: int) -> None:
        """Keep the committed generation as ``checkpoints/<tag>`` once a commit supersedes it,
        then delete the oldest checkpoints beyond ``retain`` (0 keeps all)."""
        self.check_new_tag(tag)
        record = self.committed()
        assert record is not None  # check_new_tag refuses a store without a committed step
        commit(self.store.path, {**record, KEEP: {"tag": tag, "retain": retain}})
        logger.info("step %s will be kept as checkpoint %s when the next step commits", record.get("step"), tag)

    def keep_superseded(self) -> None:
        """Complete the keeping of the superseded generation ``COMMITTED`` asks for, if any:
        idempotent, so it also finishes what a crash interrupted. (Retention interrupted by a
        crash catches up when the next checkpoint is kept.)"""
        record = self.committed()
        request = record.get(SUPERSEDED) if record else None
        if not request:
            return
        kept = request["record"]
        if (self.store.path / generation_prefix(kept["generation"])).exists():
            self.keep_generation(request["tag"], kept, request["retain"])

    def keep_generation(self, tag: str, record: dict[str, Any], retain: int) -> None:
        """Keep the written generation ``record["generation"]`` as ``checkpoints/<tag>`` with
        ``record``, then delete the oldest checkpoints beyond ``retain`` (0 keeps all)."""
        source = generation_prefix(record["generation"])
        # Its record goes in before the rename, so the checkpoint appears whole or not at all.
        commit(self.store.path / source, record)
        self.store.nodes.move(source, checkpoint_prefix(tag))
        self._settle()
        logger.info("kept step %s (%s) as checkpoint %s", record.get("step"), source, tag)
        self._retain(retain)

    def next_free(self) -> int:
        """A generation number above every one the store holds, committed, on disk or kept: a
        checkpoint written outside the live generations (from memory) takes it, so it sorts as
        the newest for retention and its directory collides with none."""
        record = self.committed()
        taken = [*self.on_disk(), *(r["generation"] for r in self.checkpoints().values())]
        taken += [record["generation"]] if record else []
        return max(taken, default=-1) + 1

    def drop_uncommitted(self) -> None:
        """Delete every generation directory but the committed one, after completing a pending
        keep: leftovers of an interrupted write, or the live state's next write target, which
        is created again when needed."""
        self.keep_superseded()
        record = self.committed()
        for generation in self.on_disk():
            if not record or generation != record["generation"]:
                self.store.nodes.delete(generation_prefix(generation))

    def _retain(self, retain: int) -> None:
        """Delete the oldest checkpoints beyond ``retain`` (0 keeps all); the generation each
        was committed as orders them as they were made, whatever their tags or steps."""
        if retain <= 0:
            return
        by_age = sorted(self.checkpoints().items(), key=lambda item: item[1]["generation"])
        for tag, record in by_age[:-retain]:
            self.store.nodes.delete(checkpoint_prefix(tag))
            logger.info("deleted checkpoint %s (step %s): checkpoint.keep = %d", tag, record.get("step"), retain)
        self.store.sync()

    def latest_checkpoint(self) -> str | None:
        """The tag of the checkpoint kept last (the one a run falls back to), or None."""
        kept = self.checkpoints()
        return max(kept, key=lambda tag: kept[tag]["generation"]) if kept else None

    def checkpoints(self) -> dict[str, dict[str, Any]]:
        """Every kept checkpoint, by tag, with the record its generation was committed with."""
        root = self.store.path / CHECKPOINTS
        if not root.is_dir():
            return {}
        records = {p.name: self._kept_record(p.name) for p in sorted(root.iterdir()) if p.is_dir()}
        return {tag: record for tag, record in records.items() if record is not None}

    def _kept_record(self, tag: str) -> dict[str, Any] | None:
        """The record checkpoint ``tag`` was committed with, checked; None if it has none."""
        folder = self.store.path / checkpoint_prefix(tag)
        record = read_committed(folder)
        if record is not None:
            _check_fields(folder / "COMMITTED", record, ("generation",))
        return record

    def checkpoint(self, tag: str) -> tuple[str, dict[str, Any]]:
        """Where checkpoint ``tag``'s arrays are and the record it was committed with: its own
        group once kept, the committed generation while the request is pending."""
        check_tag(tag)
        record = self.committed()
        request = record.get(KEEP) if record else None
        if record and request and request["tag"] == tag:
            return generation_prefix(record["generation"]), _own_record(record)
        kept = self._kept_record(tag)
        if kept is not None:
            return checkpoint_prefix(tag), kept
        present = [*self.checkpoints(), *([f"{request['tag']} (pending)"] if request else [])]
        raise FileNotFoundError(
            f"no checkpoint {tag!r} in store {self.store.path}: it holds "
            f"{', '.join(present) if present else 'none'}; pass one of those"
        )
