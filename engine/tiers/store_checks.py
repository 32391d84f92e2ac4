"""What is checked about the nvme optimizer tier's store before any work, and what a user is
told when a store cannot be used.

Pre-flight checks refuse, before anything is written, a path without room or rights, a
buffer too small to stage a unit and a store of another model. ``resume_point`` decides the
one question both a new run and a resumed one ask of an existing store: what can be
continued in it (its committed step, its last checkpoint, or nothing). Every refusal of a
damaged or dirty store names the way out (``way_out``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from engine.runtime.sizes import GIB, MIB
from engine.state.forms import FP32_STATE, StateForm
from engine.state.partition import ModelLayout
from offload import ChecksumError, Generations, IORunner, ManifestError, ShardStore, generation_prefix

logger = logging.getLogger(__name__)

GENERATIONS = "generations"
IN_PLACE = "in-place"
MODES = (GENERATIONS, IN_PLACE)
MODE_ATTR = "store_mode"
"""Group attribute: the ``store.mode`` the store was last opened with (absent: generations)."""
LIVE_GENERATIONS = {GENERATIONS: 2, IN_PLACE: 1}
"""Live generations each mode keeps: the committed one and the one being written, or the one
rewritten in place (checkpoints come on top)."""


class DirtyStoreError(ValueError):
    """A store whose committed generation was being rewritten in place when its run stopped."""


def store_bytes(layout: ModelLayout, mode: str = GENERATIONS, form: StateForm = FP32_STATE) -> int:
    """Disk the optimizer state takes for all ranks, in the live generations of ``mode``."""
    return LIVE_GENERATIONS[mode] * sum(form.array_bytes(u) for u in layout.units)


def check_mode(mode: str) -> None:
    """Refuse an unknown mode by name (the config checks it too, but the tier is also used directly)."""
    if mode not in MODES:
        raise ValueError(f"store.mode = {mode!r}: use one of {', '.join(map(repr, MODES))}")


def check_buffer(layout: ModelLayout, buffer_bytes: int, form: StateForm = FP32_STATE) -> None:
    """Refuse a host buffer that cannot read one unit's state while writing another's."""
    largest = max(layout.units, key=form.unit_bytes)
    if buffer_bytes < 2 * form.unit_bytes(largest):
        need_mb = -(-2 * form.unit_bytes(largest) // MIB)
        raise ValueError(
            f"offload.buffer_mb = {buffer_bytes // MIB}: unit {largest.name!r} needs "
            f"{form.unit_bytes(largest) / MIB:.1f} MiB of host buffer to stage its optimizer state, "
            f"twice that to read one unit while writing another; set offload.buffer_mb >= {need_mb} "
            f'(or "auto", the default, which sizes it so)'
        )


def check_buffer_memory(
    layout: ModelLayout, buffer_bytes: int, available_bytes: int, form: StateForm = FP32_STATE
) -> None:
    """Refuse a host buffer sized by ``offload.buffer_mb = "auto"`` that this machine's memory
    cannot hold (the pool grows to the buffer or to the rank's whole state, if smaller)."""
    largest = max(layout.units, key=form.unit_bytes)
    need = min(buffer_bytes, sum(form.unit_bytes(u) for u in layout.units))
    if need > available_bytes:
        raise ValueError(
            f'offload.buffer_mb = "auto": the nvme tier\'s host buffer needs {need / MIB:.0f} MiB (unit '
            f"{largest.name!r} stages {form.unit_bytes(largest) / MIB:.1f} MiB of optimizer state, twice that to "
            f"read one unit while writing another) but only {available_bytes / MIB:.0f} MiB of memory are "
            f"available: free memory, use more ranks, or split the largest unit with zero.unit_classes"
        )


def stripe_bytes(layout: ModelLayout, mode: str, form: StateForm, count: int) -> int:
    """Disk the optimizer state takes on the first of ``count`` folders it is striped across,
    the one holding the most (chunk ``k`` of each array on folder ``k % count``); ``store_bytes``
    for one folder."""
    per_generation = sum(
        -(-(g.padded_numel // g.chunk_numel) // count) * g.chunk_numel * dtype.itemsize
        for unit in layout.units
        for g, dtype in zip(form.geometries(unit), form.dtypes(), strict=True)
    )
    return LIVE_GENERATIONS[mode] * per_generation


def check_nvme_path(
    path: Path,
    layout: ModelLayout,
    mode: str = GENERATIONS,
    scratch_bytes: int = 0,
    form: StateForm = FP32_STATE,
    stripes: tuple[Path, ...] = (),
) -> None:
    """Refuse, before any work, a path that cannot hold the store of optimizer state in ``form``
    and the run's spilled gradients (``scratch_bytes``) (missing rights or space): each of the
    folders it is striped across (``stripes``) its share, named."""
    for folder in (path, *stripes):
        parent = folder if folder.exists() else folder.parent
        if not parent.exists():
            raise FileNotFoundError(
                f"offload.nvme_path = {str(folder)!r}: its parent folder {parent} does not exist; create it"
                + (" (or mount its drive)" if stripes else "")
            )
        if not os.access(parent, os.W_OK):
            raise PermissionError(
                f"offload.nvme_path = {str(folder)!r}: {parent} is not writable; choose a writable folder"
            )
        # Spilled gradients spread as the store's chunks do: each array starts one folder further.
        spilled = -(-scratch_bytes // (1 + len(stripes)))
        _check_room(folder, parent, layout, mode, form, 1 + len(stripes), spilled)


def _check_room(
    path: Path, parent: Path, layout: ModelLayout, mode: str, form: StateForm, count: int, scratch_bytes: int
) -> None:
    """Refuse a folder whose disk cannot hold its share of the store (one of ``count``) and ``scratch_bytes``."""
    need, free = stripe_bytes(layout, mode, form, count) + scratch_bytes, shutil.disk_usage(parent).free
    if need <= free:
        return
    in_place = stripe_bytes(layout, IN_PLACE, form, count) + scratch_bytes
    hint = (
        f'; store.mode = "in-place" needs {in_place / GIB:.2f} GiB (one generation rewritten each step; '
        f"after a crash mid-step only an explicit checkpoint resumes)"
        if mode != IN_PLACE and in_place <= free
        else "; free some space or choose another nvme_path"
    )
    spilled = (
        f" and {scratch_bytes / GIB:.2f} GiB of spilled gradients (offload.grad_spill; false keeps them in memory)"
        if scratch_bytes
        else ""
    )
    share = f"its share (1 of {count} folders) of " if count > 1 else ""
    raise OSError(
        f"offload.nvme_path = {str(path)!r}: the store needs {need / GIB:.2f} GiB there "
        f"({share}{LIVE_GENERATIONS[mode]} generation(s) of fp32 master, exp_avg and exp_avg_sq, store.mode = {mode!r}"
        f"{spilled}) but only {free / GIB:.2f} GiB are free there{hint}"
    )


OVERWRITE = "start afresh over it with --overwrite (in Python: Engine(..., overwrite=True))"
"""The way out of a store that nothing can continue, for a user who means to replace it."""


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
        f"it holds no checkpoint to resume from, so restore {generations.store.path} from a backup, or {OVERWRITE} "
        f"(checkpoint.interval keeps checkpoints to fall back to)"
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


class Continuation:
    """What a run can continue in an existing store: the one rule that both a new run (may it
    replace the store?) and a resumed one (from where?) follow. The checkpoints' records are
    read only when the answer needs them."""

    def __init__(self, generations: Generations):
        self._generations = generations
        with naming_way_out(generations):
            self.committed = generations.committed() is not None
            """It holds a committed step."""
            self.lost = self.committed and generations.dirty() is not None
            """That step was being rewritten in place when its run stopped: it cannot be read."""
        self.new = generations.is_new()
        """It was made by a run that never committed a step nor kept a checkpoint."""
        self.held = generations.on_disk()
        """The generations on disk, committed or not."""

    @functools.cached_property
    def checkpoints(self) -> list[str]:
        """Its kept checkpoints, by tag."""
        with naming_way_out(self._generations):
            return list(self._generations.checkpoints())

    @property
    def fallback(self) -> str | None:
        """The checkpoint a run continues from when the committed step cannot be read (None: none kept)."""
        with naming_way_out(self._generations):
            return self._generations.latest_checkpoint()

    @property
    def nothing(self) -> bool:
        """Provably nothing was ever trained into the store: no commit and no checkpoint, and
        either its ``NEW`` mark (made by a run that stopped before its first commit) or no
        generation at all. A new run replaces it."""
        return not self.committed and not self.checkpoints and (self.new or not self.held)


def resume_point(path: Path) -> tuple[bool, str | None]:
    """Where a run continues the store at ``path`` unaided: ``(True, None)`` from its last
    committed step; ``(True, tag)`` from its last checkpoint, when it was stopped mid-step
    while rewritten in place; ``(False, None)`` when there is nothing to continue from (no
    store, no committed step, or a store stopped mid-step in place that keeps no checkpoint),
    where a new run starts if ``check_new`` lets it."""
    if not (path / "COMMITTED").is_file():
        return False, None
    with IORunner(threads=1) as runner:
        found = Continuation(Generations(ShardStore.open(path, runner=runner)))
        if not found.lost:
            return True, None
        latest = found.fallback
    return latest is not None, latest


def check_new(path: Path, runner: IORunner, overwrite: bool = False) -> bool:
    """Whether a new store may be made at ``path``: nothing there (False), a store that provably
    never held a trained step, or any store with ``overwrite`` (True: it is replaced); else
    refused, naming what the store holds and the ways out. Nothing is changed here."""
    if not (path / "zarr.json").exists():
        return False
    found = Continuation(Generations(ShardStore.open(path, runner=runner)))
    if overwrite or found.nothing:
        why = "--overwrite was given" if overwrite else "it never committed its first step"
        logger.warning("replacing the store at %s: %s", path, why)
        return True
    raise FileExistsError(f"offload.nvme_path = {str(path)!r} already holds a store: {how_to_continue(found, path)}")


def how_to_continue(found: Continuation, path: Path) -> str:
    """How a store that a new run may not replace can be continued, or why it cannot: what a
    refused start says after naming the store."""
    tags = found.checkpoints
    others = f"{OVERWRITE}; or choose another nvme_path"
    if found.committed and not found.lost:
        return "resume from it (run the same command again: `python -m engine train` continues a store); or " + others
    if not found.committed and (found.new or not found.held):  # a memory tier's: checkpoints, no step of its own
        return f"it holds only checkpoints written from memory ({', '.join(tags)}): resume from one with --from-checkpoint TAG; or {others}"
    if tags:
        newest = found.fallback
        others = f"resume from its newest checkpoint, {newest!r}: `python -m engine train --from-checkpoint {newest}`; or {others}"
    if found.lost:
        return (
            f'its run (store.mode = "in-place") stopped mid-step, so its committed step mixes two steps and cannot be '
            f"read{'' if tags else ', and it keeps no checkpoint'}; {others}"
        )
    held = ", ".join(generation_prefix(g) for g in found.held)
    return (
        f"it has no COMMITTED record but was trained into (it holds {held}{', checkpoints ' + ', '.join(tags) if tags else ''}): "
        f"its COMMITTED file was deleted or lost (a bad copy, a restore that skipped a file), so which step it holds is "
        f"unknown, and nothing was changed; restore COMMITTED from a backup; or {others}"
    )


def first_difference(stored: ModelLayout, current: ModelLayout, path: Path) -> None:
    """Refuse a store written for another model, naming the first difference. Another world
    size (or chunk size) is no difference: only the shards are cut differently."""
    _same_frozen(stored, current, path)
    stored_params = [(u.name, p.name, p.shape) for u in stored.all_units for p in u.params]
    current_params = [(u.name, p.name, p.shape) for u in current.all_units for p in u.params]
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


def _same_frozen(stored: ModelLayout, current: ModelLayout, path: Path) -> None:
    """Refuse a model that freezes other parameters than the run that wrote the store."""
    frozen = [{p.name for u in layout.frozen for p in u.params} for layout in (stored, current)]
    trained = [{p.name for u in layout.units for p in u.params} for layout in (stored, current)]
    for name in sorted((frozen[0] & trained[1]) | (trained[0] & frozen[1])):
        was, now = ("frozen", "trains") if name in frozen[0] else ("trained", "freezes")
        raise ValueError(
            f"store {path} does not match this model: its run {was} parameter {name!r}, which this model {now}; "
            f"set requires_grad as the run that wrote the store did"
        )
