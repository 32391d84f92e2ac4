"""What a store holds: its layout, mode, committed step, generations, sizes, and whether its bytes are intact.

The store is the checkpoint, so before resuming from it, consolidating it or copying it
away one wants to know what it is without loading a model: ``inspect_store`` reads only
metadata unless asked to ``verify``, which then reads every chunk of the committed
generation through the store's own CRC-32C check, one chunk at a time, and lists every
bad chunk rather than stopping at the first (a damaged disk rarely damages only one). A
store written in place that is dirty is described, not refused: the report says which
checkpoint to resume from instead.

The read-side helpers here (opening a store, its layout, its committed record) are shared
with ``engine.tools.consolidate``; how arrays are named and read chunk by chunk is
``offload``'s (``unit_arrays``, ``ChunkReader``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm

from engine.state.forms import MASTER_DTYPE_ATTR, STATE_DTYPE_ATTR, STATE_KINDS, StateForm
from engine.state.partition import ModelLayout
from engine.tiers.frozen import FROZEN
from engine.tiers.parameters import PARAM_KIND
from engine.tiers.store_checks import (
    GENERATIONS,
    IN_PLACE,
    MODE_ATTR,
    DirtyStoreError,
    check_clean,
    naming_way_out,
)
from engine.tiers.store_io import HOSTS_ATTR, stored_chunk_mb
from offload import (
    CHECKPOINTS,
    FORMAT_VERSION,
    ChecksumError,
    ChunkReader,
    Generations,
    IORunner,
    ManifestError,
    ShardStore,
    array_name,
    auto_settings,
    describe_holder,
    generation_prefix,
    read_committed,
    read_holder,
    unit_arrays,
)

logger = logging.getLogger(__name__)

IO_THREADS = 2  # reads go one chunk at a time: more threads would only wait


def open_store(path: Path, runner: IORunner) -> ShardStore:
    """Open the store at ``path`` for reading; a path that holds none names itself and the likely
    fix (the store's own refusal advises creating one, which a reader does not want)."""
    fix = "pass the folder the engine trained into (its offload.nvme_path)"
    if not path.exists():
        raise FileNotFoundError(f"no store at {path}: the path does not exist; {fix}")
    if not (path / "zarr.json").is_file():
        what = "a folder without a zarr.json" if path.is_dir() else "a file, not a folder"
        raise ValueError(f"{path} is not an offload store: it is {what}; {fix}")
    return ShardStore.open(path, runner=runner)


def store_layout(store: ShardStore) -> ModelLayout:
    """The model layout the engine saved with the store: it names every unit and parameter."""
    layout = store.attrs.get("layout")
    if not isinstance(layout, dict):
        raise ValueError(
            f"offload store {store.path} has no 'layout' group attribute, so it was not written by the "
            f"engine and its arrays cannot be mapped to parameters; inspect it with zarr instead"
        )
    try:
        return ModelLayout.from_dict(layout)
    except (KeyError, TypeError, ValueError) as err:  # a hand-edited or truncated zarr.json
        raise ValueError(
            f"offload store {store.path} has a damaged 'layout' attribute in its zarr.json "
            f"({type(err).__name__}: {err}), so its arrays cannot be mapped to parameters; restore the store "
            f"from a backup"
        ) from err


def committed_record(store: ShardStore, dirty_ok: bool = False) -> dict[str, Any] | None:
    """The committed record, or None if nothing was committed; a record that names no
    generation is as untrustworthy as a garbled one, and so, unless ``dirty_ok``, is the
    record of a dirty store (its generation mixes two steps)."""
    generations = Generations(store)
    with naming_way_out(generations):
        record = generations.committed()
    if not dirty_ok:
        check_clean(generations)
    return record


def dirty_status(store: ShardStore) -> str | None:
    """Why the store is dirty and what to resume from instead, or None if it is clean."""
    try:
        check_clean(Generations(store))
    except DirtyStoreError as err:
        return str(err)
    return None


def generation_array(generation: int, unit: str, kind: str) -> str:
    """The store array holding one kind of state of one unit in one generation."""
    return array_name(generation_prefix(generation), unit, kind)


def io_line(path: Path) -> str:
    """The chunk size the store is cut with, and what ``auto`` would choose for its disk."""
    chunk_mb = stored_chunk_mb(path)
    auto = auto_settings(path, measure=False)
    cut = f"chunks of up to {chunk_mb} MiB (its layout; kept on resume)" if chunk_mb else "no layout recorded"
    return f"{cut}; a new store here: {auto.chunk_mb} MiB x {auto.io_threads} threads ({auto.why})"


_SHOWN_ATTRS = ("layout", MODE_ATTR, HOSTS_ATTR, STATE_DTYPE_ATTR, MASTER_DTYPE_ATTR)
"""The store attributes the report shows in lines of their own."""


def inspect_store(path: str | os.PathLike[str], verify: bool = False) -> dict[str, Any]:
    """Describe the store at ``path`` as plain data (see ``format_report`` for the text form).

    With ``verify``, every chunk of every array of the committed generation is read and its
    CRC-32C checked; failures are listed under ``verify.failures``, none stops the scan.
    """
    path = Path(path)
    with IORunner(threads=IO_THREADS) as runner:
        store = open_store(path, runner)
        layout = store_layout(store)
        record = committed_record(store, dirty_ok=True)
        generation = None if record is None else record["generation"]
        arrays = _generation_arrays(store, generation)
        report: dict[str, Any] = {
            "path": str(path),
            "paths": [str(folder) for folder in store.paths],
            "format": {"zarr": 3, "offload_store": FORMAT_VERSION, "checksum": store.checksum},
            "committed": None if record is None else _scalars(record),
            "mode": store.attrs.get(MODE_ATTR, GENERATIONS),
            "io": io_line(path),
            "dirty": dirty_status(store),
            "writer": read_holder(path),
            "world_size": layout.world_size,
            "state_dtype": StateForm.stored(store.attrs).name,
            "master_dtype": StateForm.stored(store.attrs).master,
            "attributes": {k: v for k, v in store.attrs.items() if k not in _SHOWN_ATTRS},
            "hosts": store.attrs.get(HOSTS_ATTR, {"node": 0, "nodes": 1}),
            "num_units": len(layout.units),
            "num_params": sum(len(u.params) for u in layout.units),
            "numel": layout.numel,
            "units": [
                {
                    "name": u.name,
                    "params": len(u.params),
                    "numel": u.numel,
                    "shard_numel": u.shard_numel,
                    "chunk_numel": u.chunk_numel,
                    "padded_numel": u.padded_numel,
                }
                for u in layout.units
            ],
            "bytes_per_kind": _bytes_per_kind(store, arrays),
            "frozen": _frozen(store, layout),
            "generations": Generations(store).on_disk(),
            "new": Generations(store).is_new(),
            "checkpoints": _checkpoints(path),
            "disk_bytes": sum(_disk_bytes(folder) for folder in store.paths),
            "verify": _verify(store, layout, generation, arrays | unit_arrays(store, FROZEN)) if verify else None,
        }
    return report


def _scalars(record: dict[str, Any]) -> dict[str, Any]:
    """The committed record's plain values (generation, step, loss scale...), without bulky
    nested state such as RNG states."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float, str, bool))}


def _generation_arrays(store: ShardStore, generation: int | None) -> dict[str, tuple[str, str]]:
    """The arrays of one generation, each with its (unit, kind)."""
    return {} if generation is None else unit_arrays(store, generation_prefix(generation))


def _bytes_per_kind(store: ShardStore, arrays: dict[str, tuple[str, str]]) -> dict[str, int]:
    """Logical bytes (padding included, checksums not) of each kind of state, parameters first."""
    sizes: dict[str, int] = {}
    for name, (_, kind) in arrays.items():
        sizes[kind] = sizes.get(kind, 0) + store.array_info(name).nbytes
    order = {kind: i for i, kind in enumerate((PARAM_KIND, *STATE_KINDS))}
    return dict(sorted(sizes.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))


def _frozen(store: ShardStore, layout: ModelLayout) -> dict[str, Any]:
    """The frozen units: parameters, elements, and the bytes of their values, stored once."""
    arrays = unit_arrays(store, FROZEN)
    return {
        "units": [u.name for u in layout.frozen],
        "params": sum(len(u.params) for u in layout.frozen),
        "numel": layout.frozen_numel,
        "bytes": sum(store.array_info(name).nbytes for name in arrays),
    }


def _checkpoints(path: Path) -> list[str]:
    """The kept checkpoints' tags by the step each record names (as text, ``step-1000`` would come
    before ``step-990``); ties by tag, and those whose record names no step last, by tag."""
    root = path / CHECKPOINTS
    if not root.is_dir():
        return []
    steps = {p.name: _checkpoint_step(p) for p in root.iterdir() if p.is_dir()}
    return sorted(steps, key=lambda tag: (steps[tag] is None, steps[tag] or 0, tag))


def _checkpoint_step(folder: Path) -> int | None:
    """The step a checkpoint's record names, or None where it names none or cannot be read: a
    damaged checkpoint is listed, not a reason to refuse describing the store."""
    try:
        record = read_committed(folder)
    except ManifestError:
        return None
    step = record.get("step") if record else None
    return step if isinstance(step, int) else None


def _disk_bytes(path: Path) -> int:
    """Bytes of every file under ``path``, as ``du --apparent-size`` counts them."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in filenames)
    return total


def _verify(
    store: ShardStore, layout: ModelLayout, generation: int | None, arrays: dict[str, tuple[str, str]]
) -> dict[str, Any]:
    """Read every chunk of the committed generation, collecting every failure."""
    failures: list[dict[str, Any]] = []

    def fail(unit: str, kind: str, chunk: int | None, file: Path, error: str) -> None:
        failures.append({"unit": unit, "kind": kind, "chunk": chunk, "file": str(file), "error": error})
        logger.warning("unit %s %s chunk %s (%s): %s", unit, kind, chunk, file, error)

    if generation is not None:
        for unit in layout.units:
            for kind in STATE_KINDS:
                name = generation_array(generation, unit.name, kind)
                if name not in arrays:
                    fail(unit.name, kind, None, store.path / name, "the array is missing from the committed generation")
    reader = ChunkReader(store, arrays)
    total = sum(info.nchunks for info in reader.infos.values())
    with tqdm(total=total, desc="verify", unit="chunk", disable=None) as bar:
        for name, (unit_name, kind) in arrays.items():
            for index in range(reader.infos[name].nchunks):
                try:
                    reader.read(name, index)
                except (ChecksumError, OSError) as error:
                    fail(unit_name, kind, index, reader.store.chunk_path(name, index), str(error))
                bar.update()
    return {"chunks": total, "failures": failures}


def _hosts_lines(hosts: dict[str, int]) -> list[str]:
    """Which hosts a node-local store belongs with (none for a store holding the whole run)."""
    if hosts["nodes"] == 1:
        return []
    return [
        f"hosts:       host {hosts['node']} of {hosts['nodes']}: its ranks' shards only; each other host's store "
        f"holds its own (`python -m engine gather OUT STORE...` makes them one)"
    ]


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"


def _stripes_lines(paths: list[str]) -> list[str]:
    """The folders a store's chunks are striped across, if more than its own."""
    return [f"striped:     {len(paths)} folders, chunks on each in turn: {', '.join(paths)}"] if len(paths) > 1 else []


def _uncommitted(report: dict[str, Any]) -> str:
    """Why a store has no committed generation, from what it holds."""
    if report["new"]:
        return "the run that made it stopped before its first commit"
    if report["generations"]:
        held = ", ".join(f"gen-{g}" for g in report["generations"])
        return f"yet it holds {held}: its COMMITTED file was lost; restore it from a backup"
    if report["checkpoints"]:
        return "its state is kept as checkpoints, below"
    return "nothing was trained into this store yet"


def format_report(report: dict[str, Any]) -> str:
    """The report as text for a terminal: one fact a line, units as a table."""
    fmt, committed = report["format"], report["committed"]
    checksum = "on" if fmt["checksum"] else "off"
    lines = [
        f"store:       {report['path']}",
        *_stripes_lines(report["paths"]),
        f"format:      zarr v{fmt['zarr']}, offload store v{fmt['offload_store']}, CRC-32C {checksum}",
        f"io:          {report['io']}",
    ]
    if committed is None:
        lines.append(f"committed:   no committed generation ({_uncommitted(report)})")
    else:
        others = ", ".join(f"{k} {v}" for k, v in committed.items() if k not in ("step", "generation"))
        lines.append(
            f"committed:   step {committed.get('step', '?')}, generation {committed['generation']}"
            + (f" ({others})" if others else "")
        )
        if committed["generation"] not in report["generations"]:
            lines.append(f"             generation {committed['generation']} is MISSING on disk")
    state = f", DIRTY: {report['dirty']}" if report["dirty"] else ", clean" if report["mode"] == IN_PLACE else ""
    lines.append(f"mode:        {report['mode']}{state}")
    writer = report["writer"]
    lines.append(f"writer:      {describe_holder(writer) if writer is not None else 'none (no run holds its lock)'}")
    lines.append(f"world size:  {report['world_size']}")
    lines += _hosts_lines(report["hosts"])
    lines += [f"{key + ':':<12} {value}" for key, value in report["attributes"].items()]
    lines.append(
        f"model:       {report['num_units']} units, {report['num_params']} parameters, {report['numel']:,} elements"
    )
    lines += _unit_table(report["units"])
    frozen = report["frozen"]
    if frozen["units"]:
        lines.append(
            f"frozen:      {len(frozen['units'])} units, {frozen['params']} parameters, {frozen['numel']:,} elements, "
            f"stored once ({_size(frozen['bytes'])}), no optimizer state"
        )
    kinds = ", ".join(f"{kind} {_size(n)}" for kind, n in report["bytes_per_kind"].items()) or "none"
    form = f"optim.state_dtype = {report['state_dtype']!r}, master_dtype = {report['master_dtype']!r}"
    lines.append(f"state:       {kinds} (committed generation; {form})")
    lines.append(f"generations: {', '.join(map(str, report['generations'])) or 'none'}")
    lines.append(f"checkpoints: {', '.join(report['checkpoints']) or 'none'}")
    lines.append(f"on disk:     {_size(report['disk_bytes'])}")
    if report["verify"] is not None:
        lines += _verify_lines(report["verify"], committed is not None)
    return "\n".join(lines)


def _unit_table(units: list[dict[str, Any]]) -> list[str]:
    """One line per unit: its parameters, elements, shard and chunk."""
    width = max((len(u["name"]) for u in units), default=4)
    return [f"  {'unit':<{width}} {'params':>6} {'numel':>12} {'shard':>12} {'chunk':>12}"] + [
        f"  {u['name']:<{width}} {u['params']:>6} {u['numel']:>12,} {u['shard_numel']:>12,} {u['chunk_numel']:>12,}"
        for u in units
    ]


def _verify_lines(verify: dict[str, Any], committed: bool) -> list[str]:
    """What ``--verify`` found: nothing to check, every chunk good, or each problem."""
    failures = verify["failures"]
    if not committed:
        return ["checksum:    nothing to verify (no committed generation)"]
    if not failures:
        return [f"checksum:    ok ({verify['chunks']} chunks read)"]
    lines = [f"checksum:    FAILED: {len(failures)} problem(s) in {verify['chunks']} chunks"]
    for f in failures:
        where = "whole array" if f["chunk"] is None else f"chunk {f['chunk']}"
        lines.append(f"  unit {f['unit']} {f['kind']} {where}: {f['file']}: {f['error']}")
    return lines
