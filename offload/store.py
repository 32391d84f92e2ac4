"""The shard store: a zarr v3 group of 1-D arrays on local disk, read and written by a fast route.

What is on disk is plain zarr (`offload.metadata`): any zarr reader can open the store. The
hot path does not go through zarr: it reads and writes the chunk files itself, in place,
straight out of and into the caller's buffers (`offload.chunks`), one task per chunk on an
`IORunner`. This module is the store's face: opening and creating it, its arrays, requests
cut into chunk tasks, and `sync`, which makes what was written durable. Reorganising whole
nodes (build, move, delete, sweep) is `offload.nodes`.
"""

from __future__ import annotations

import copy
import errno
import itertools
import logging
import os
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.buffers import DIRECT_ALIGN
from offload.chunks import ChunkFiles, FileOps, byte_view, chunk_dir, chunk_path
from offload.costs import CostAccount
from offload.host_memory import host_bytes
from offload.io import IORunner, OffloadIOError
from offload.lock import LOCK_FILE
from offload.metadata import (
    FORMAT_KEY,
    FORMAT_VERSION,
    ZARR_DTYPES,
    ArrayInfo,
    check_name,
    check_no_links,
    create_array_meta,
    create_group,
    group_attrs,
    parse_array_meta,
    read_json,
    store_marker,
    under,
    update_group_attrs,
)
from offload.nodes import NodeOps, SyncLedger
from offload.stripes import absolute, clear_folders, create_stripes, open_stripes, stripe_index

__all__ = ["ShardStore"]

log = logging.getLogger(__name__)


def _describe_request(kind: str, name: str, start: int, n: int, info: ArrayInfo) -> str:
    """A read or write request as its errors name it."""
    return f"{kind} {name!r} elements [{start}, {start + n}) (array numel {info.numel}, chunk size {info.chunk_elems})"


class ShardStore:
    """A zarr v3 group of 1-D arrays, read and written chunk by chunk in place.

    Build one with `create` or `open`. Writes become durable at `sync()`; the
    store itself promises nothing about crash consistency beyond that (the
    generations built on top of it do). Call `sync()` regularly (once a step):
    it also drops the small record kept per write call since the last sync.
    Distinct chunks may be read and written from many threads at once.
    """

    def __init__(
        self,
        root: Path,
        attrs: dict[str, Any],
        *,
        runner: IORunner,
        checksum: bool,
        direct_io: bool,
        file_ops: FileOps | None,
        costs: CostAccount | None = None,
        scratch: bool = False,
        stripes: tuple[Path, ...] = (),
    ) -> None:
        self.path = root
        self.paths = (root, *stripes)
        """Every folder of the store, the first its identity; chunk ``k`` of an array is in
        ``paths[(stripe_start + k) % len(paths)]`` (``offload.stripes``)."""
        self.checksum = checksum
        self.scratch = scratch
        """Its chunks hold data for one step only: `sync` never makes them durable."""
        self._attrs = attrs
        self._runner = runner
        self._files = ChunkFiles(root, file_ops if file_ops is not None else FileOps(), direct_io, costs)
        self._stripe_starts = itertools.count()
        self._ledger = SyncLedger()
        self.nodes = NodeOps(self.paths, self._ledger, self.sync, self._fsync_all)
        """Its verbs on whole nodes: `move`, `build`, `delete`, `sweep` (`offload.nodes`)."""

    @property
    def costs(self) -> CostAccount:
        """The CPU time each stage of this store's I/O took, and the bytes it moved (`offload.costs`)."""
        return self._files.costs

    @property
    def _ops(self) -> FileOps:
        """The chunk files' door to the OS; tests substitute it to count fsyncs or inject errors."""
        return self._files.ops

    @_ops.setter
    def _ops(self, ops: FileOps) -> None:
        self._files.ops = ops

    # ----------------------------------------------------------------- opening

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        attrs: dict[str, Any],
        *,
        runner: IORunner,
        checksum: bool = True,
        direct_io: bool = True,
        overwrite: bool = False,
        file_ops: FileOps | None = None,
        beside: Collection[str] = (),
        scratch: bool = False,
        costs: CostAccount | None = None,
        stripes: Sequence[str | os.PathLike[str]] = (),
    ) -> ShardStore:
        """Create an empty store at `path` with group attributes `attrs`, its chunks striped
        across `path` and the folders `stripes` (each made in an existing parent) if any.

        `checksum` is the default for `create_array`. With `overwrite`, an existing store (or
        empty directory) at `path` is replaced; anything else there is left alone and refused.
        The entries named in `beside` (another store nested in the folder) are neither the
        store's nor in its way. Its I/O is accounted in `costs` (as `open`'s). A `scratch`
        store's chunk writes are never fsynced: what it holds is rewritten before it is read
        again, and a crash loses nothing that matters.
        """
        root = Path(path)
        if FORMAT_KEY in attrs:
            raise ValueError(f"group attribute {FORMAT_KEY!r} is reserved for the store's format marker")
        extra = absolute(stripes)
        # Every folder is checked before any is changed: a refused store modifies nothing.
        clear_folders(root, extra, overwrite, {LOCK_FILE, *beside})()
        marker: dict[str, Any] = {"version": FORMAT_VERSION, "checksum": checksum}
        create_stripes(root, extra, marker)
        create_group(root, {**attrs, FORMAT_KEY: marker})  # last: the list names only folders made
        store = cls(
            root,
            dict(attrs),
            runner=runner,
            checksum=checksum,
            direct_io=direct_io,
            file_ops=file_ops,
            costs=costs,
            scratch=scratch,
            stripes=extra,
        )
        store._ledger.files.update(str(p / "zarr.json") for p in store.paths)
        store._ledger.dirs.update(d for p in store.paths for d in (str(p), str(p.parent)))
        log.debug("created offload store %s (checksum=%s)", root, checksum)
        return store

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        runner: IORunner,
        direct_io: bool = True,
        file_ops: FileOps | None = None,
        costs: CostAccount | None = None,
        stripes: Sequence[str | os.PathLike[str]] | None = None,
    ) -> ShardStore:
        """Open an existing store for reading and writing; its I/O is accounted in `costs`
        (shared by every store of a run, so a step's account is one), or in its own. Its other
        folders are those it recorded; `stripes`, where given, must be that very list."""
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(
                errno.ENOENT,
                f"no offload store at {root}: the path does not exist; pass the folder a run trained into",
                str(root),
            )
        marker = store_marker(root)
        if marker is None:
            raise ValueError(
                f"{root} is not an offload store: it has no zarr v3 group metadata (zarr.json) with the "
                f"{FORMAT_KEY!r} attribute; pass the folder a run trained into (its offload.nvme_path)"
            )
        if marker.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"offload store {root} has format version {marker.get('version')}, "
                f"this code reads version {FORMAT_VERSION}"
            )
        extra = open_stripes(root, marker, stripes)
        for folder in (root, *extra):
            check_no_links(folder)
        attrs = group_attrs(root)
        log.debug("opened offload store %s", root)
        checksum = bool(marker.get("checksum", True))
        return cls(
            root,
            attrs,
            runner=runner,
            checksum=checksum,
            direct_io=direct_io,
            file_ops=file_ops,
            costs=costs,
            stripes=extra,
        )

    # -------------------------------------------------------------- attributes

    @property
    def attrs(self) -> dict[str, Any]:
        """A copy of the group attributes (without the format marker)."""
        return copy.deepcopy(self._attrs)

    def update_attrs(self, attrs: dict[str, Any]) -> None:
        """Merge `attrs` into the group attributes; durable at the next `sync()`."""
        if FORMAT_KEY in attrs:
            raise ValueError(f"group attribute {FORMAT_KEY!r} is reserved for the store's format marker")
        update_group_attrs(self.path, attrs)
        self._attrs.update(copy.deepcopy(attrs))
        with self._ledger.lock:
            # zarr replaces zarr.json by a rename: the directory entry changes too.
            self._ledger.files.add(str(self.path / "zarr.json"))
            self._ledger.dirs.add(str(self.path))

    # ------------------------------------------------------------------ arrays

    def create_array(self, name: str, numel: int, chunk_elems: int, dtype: torch.dtype) -> None:
        """Create the 1-D array `name`; no chunk exists until it is written."""
        check_name(name, "array name")
        if dtype not in ZARR_DTYPES:
            raise ValueError(
                f"cannot create array {name!r} with dtype {dtype}: supported dtypes are "
                f"{', '.join(str(d) for d in ZARR_DTYPES)}"
            )
        if chunk_elems <= 0 or numel <= 0:
            raise ValueError(
                f"cannot create array {name!r}: numel ({numel}) and chunk_elems ({chunk_elems}) must be positive"
            )
        if numel % chunk_elems:
            raise ValueError(
                f"cannot create array {name!r}: numel {numel} is not a multiple of "
                f"chunk_elems {chunk_elems}; pad it to {-(-numel // chunk_elems) * chunk_elems}"
            )
        array_dir = self.path / name
        if array_dir.exists():
            raise FileExistsError(
                f"cannot create array {name!r}: {array_dir} already exists; delete it first with "
                f"ShardStore.nodes.delete({name!r})"
            )
        meta_files: list[str] = []
        dirs: list[str] = []
        # Each new array starts on the next folder: a unit's arrays of one chunk each still spread.
        start = None if len(self.paths) == 1 else next(self._stripe_starts) % len(self.paths)
        for folder in (*self.paths[1:], self.path):  # the first last: it says the array exists
            self.nodes.discard_orphan(folder, name)
            create_array_meta(folder, name, numel, chunk_elems, dtype, self.checksum, start)
            # Made here, not on first write, so the chunk writers never race to create it.
            chunk_dir(folder, name).mkdir()
            # zarr may have created parent groups too. Fsyncing one that already
            # existed costs little, and the sets keep each path once.
            node = folder / name
            groups = [p for p in node.parents if under(str(p), str(folder)) and p != folder]
            meta_files += [str(d / "zarr.json") for d in (node, *groups)]
            dirs += [str(d) for d in (chunk_dir(folder, name), node, *groups, folder)]
        info = ArrayInfo(numel, chunk_elems, dtype, self.checksum, start or 0)
        with self._ledger.lock:
            self._ledger.infos[name] = info
            self._ledger.files.update(meta_files)
            self._ledger.dirs.update(dirs)

    def has_array(self, name: str) -> bool:
        """Whether `name` is an array (of any format: `array_info` says if the fast route reads it)."""
        if name in self._ledger.infos:
            return True
        check_name(name, "array name")
        try:
            return read_json(self.path / name / "zarr.json").get("node_type") == "array"
        except FileNotFoundError:
            return False

    def array_names(self) -> list[str]:
        """Every array in the store, sorted; walks only zarr nodes, never chunk directories."""
        names = []
        for dirpath, dirnames, filenames in os.walk(self.path):
            is_node = dirpath != str(self.path) and "zarr.json" in filenames
            if is_node and read_json(Path(dirpath) / "zarr.json").get("node_type") == "array":
                names.append(os.path.relpath(dirpath, self.path).replace(os.sep, "/"))
                dirnames.clear()
                continue
            dirnames[:] = [d for d in dirnames if os.path.exists(os.path.join(dirpath, d, "zarr.json"))]
        return sorted(names)

    def array_info(self, name: str) -> ArrayInfo:
        """The array's metadata, read from disk once and cached."""
        info = self._ledger.infos.get(name)
        if info is not None:
            return info
        check_name(name, "array name")
        meta_path = self.path / name / "zarr.json"
        try:
            meta = read_json(meta_path)
        except FileNotFoundError:
            raise KeyError(
                f"no array {name!r} in offload store {self.path} ({meta_path} is missing): the store is "
                f"incomplete; resume from a checkpoint or restore the store"
            ) from None
        if meta.get("node_type") != "array":
            raise KeyError(f"{name!r} in offload store {self.path} is a {meta.get('node_type')}, not an array")
        info = parse_array_meta(name, meta_path, meta)
        with self._ledger.lock:
            self._ledger.infos[name] = info
        return info

    # ---------------------------------------------------------------- data I/O

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Read elements `[start, start + out.numel())` of `name` into `out`; blocks."""
        self.read_async(name, start, out).result()

    def write_from(self, name: str, start: int, src: torch.Tensor) -> None:
        """Write `src` to elements `[start, start + src.numel())` of `name`; blocks (durable at `sync()`)."""
        self.write_async(name, start, src).result()

    def read_async(self, name: str, start: int, out: torch.Tensor) -> Future:
        """Start reading whole chunks into `out`; do not touch `out` until the future completes.
        Its result: each chunk's verified CRC-32C (None without checksums), for `write_async`."""
        info, first, buf, aligned = self._plan("read", name, start, out)
        return self._submit_chunks("read", name, info, first, buf, aligned, self._files.read, then=self._files.verify)

    def write_async(self, name: str, start: int, src: torch.Tensor, crcs: Sequence[int | None] | None = None) -> Future:
        """Start writing whole chunks from `src`; do not modify `src` until the future completes.

        `crcs`, one a chunk, are the chunks' CRC-32C where known: what `read_async` verified for
        these very bytes, copied unchanged; a checksum is then never computed twice."""
        info, first, buf, aligned = self._plan("write", name, start, src)
        if crcs is not None and len(crcs) != buf.size // info.chunk_bytes:
            raise ValueError(f"write {name!r}: {len(crcs)} CRCs for {buf.size // info.chunk_bytes} chunks")
        future = self._submit_chunks(
            "write", name, info, first, buf, aligned, self._files.write, then=self._files.finish_write, crcs=crcs
        )
        return self._record_write(name, info, first, buf.size // info.chunk_bytes, future)

    def write_zeros_async(self, name: str, start: int, count: int) -> Future:
        """Start making elements `[start, start + count)` of `name`, whole chunks, zeros with
        nothing written but their checksums (`ChunkFiles.write_zeros`); durable at `sync()`."""
        dtype = self.array_info(name).dtype
        untouched = host_bytes(count * dtype.itemsize).view(dtype)  # it only sizes the chunks
        info, first, buf, aligned = self._plan("write", name, start, untouched)
        task, then = self._files.write_zeros, self._files.finish_write
        future = self._submit_chunks("write", name, info, first, buf, aligned, task, then=then)
        return self._record_write(name, info, first, buf.size // info.chunk_bytes, future)

    def _record_write(self, name: str, info: ArrayInfo, first: int, count: int, future: Future) -> Future:
        """Note `count` chunks from `first` as written, for `sync` to make durable."""
        if self.scratch:
            return future  # never synced, so not recorded for `sync`
        with self._ledger.lock:
            self._ledger.writes.append((name, first, count, future))
            touched = {self._folder_of(info, i) for i in range(first, first + min(count, len(self.paths)))}
            self._ledger.dirs.update(str(chunk_dir(folder, name)) for folder in touched)
        return future

    def read_range(self, name: str, start: int, out: torch.Tensor) -> None:
        """Read elements `[start, start + out.numel())` of `name` into `out`, wherever chunks fall; blocks.

        For ranges cut by another partitioning than the array's (a shard of another world
        size). The whole chunks inside the range go straight into `out` as with `read_into`;
        each of the (at most two) chunks the range only partly covers is read whole into a
        one-chunk scratch tensor, and its covered part copied.
        """
        info = self._check_request("read", name, start, out)
        size, end = info.chunk_elems, start + out.numel()
        inner_start, inner_end = -(-start // size) * size, end // size * size
        futures = []
        if inner_start < inner_end:
            futures.append(self.read_async(name, inner_start, out[inner_start - start : inner_end - start]))
        partial = {index for index, cut in ((start // size, start % size), (end // size, end % size)) if cut}
        for index in partial:
            self.check_chunk_file(name, index)
        scratch = {index: torch.empty(size, dtype=info.dtype) for index in partial}
        futures += [self.read_async(name, index * size, chunk) for index, chunk in scratch.items()]
        IORunner.gather(futures).result()
        with self.costs.stage("copy"):
            for index, chunk in scratch.items():
                lo, hi = max(start, index * size), min(end, (index + 1) * size)
                out[lo - start : hi - start].copy_(chunk[lo - index * size : hi - index * size])

    def chunk_path(self, name: str, index: int) -> Path:
        """The file holding chunk `index` of array `name`, on the store's path for it."""
        return chunk_path(self._folder_of(self.array_info(name), index), name, index)

    def _folder_of(self, info: ArrayInfo, index: int) -> Path:
        """The folder holding chunk `index` of an array (`offload.stripes`)."""
        return self.paths[stripe_index(info.stripe_start + index, len(self.paths))]

    def check_chunk_file(self, name: str, index: int) -> None:
        """Refuse a chunk whose file does not hold the bytes its array's metadata promises,
        before a buffer is allocated for it: metadata claiming a huge chunk must not make a
        reader allocate what no file holds."""
        self._files.check_size(name, index, self.array_info(name), self.chunk_path(name, index))

    def _check_request(self, kind: str, name: str, start: int, t: torch.Tensor) -> ArrayInfo:
        """Validate the buffer and that the range is non-empty and inside the array; return the array's info."""
        info = self.array_info(name)
        n = t.numel() if isinstance(t, torch.Tensor) else 0
        where = _describe_request(kind, name, start, n, info)
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{where}: the buffer must be a contiguous 1-D CPU tensor")
        if t.dtype != info.dtype:
            raise ValueError(f"{where}: buffer dtype {t.dtype} differs from the array's {info.dtype}")
        if n == 0 or start < 0 or start + n > info.numel:
            raise ValueError(f"{where}: the range must be non-empty and inside the array")
        return info

    def _plan(self, kind: str, name: str, start: int, t: torch.Tensor) -> tuple[ArrayInfo, int, np.ndarray, bool]:
        """Validate a whole-chunk request; return (info, first chunk, byte view, whether it is aligned for O_DIRECT)."""
        info = self._check_request(kind, name, start, t)
        if start % info.chunk_elems or t.numel() % info.chunk_elems:
            raise ValueError(
                f"{_describe_request(kind, name, start, t.numel(), info)}: the range must start on a chunk "
                f"boundary and cover whole chunks (read_range reads any range)"
            )
        buf = byte_view(t)
        aligned = buf.ctypes.data % DIRECT_ALIGN == 0 and info.chunk_bytes % DIRECT_ALIGN == 0
        return info, start // info.chunk_elems, buf, aligned

    def _submit_chunks(
        self,
        kind: str,
        name: str,
        info: ArrayInfo,
        first: int,
        buf: np.ndarray,
        aligned: bool,
        task: Callable[..., Any],
        then: Callable[..., Any],
        crcs: Sequence[int | None] | None = None,
    ) -> Future:
        """One `task` per chunk on the I/O threads, then `then` on each one's result on a
        checking thread (`IORunner.then`), given the chunk's CRC where `crcs` says it; a future
        of their results, in chunk order."""
        arrow = "->" if kind == "write" else "<-"
        size = info.chunk_bytes
        futures = []
        for k in range(buf.size // size):
            index = first + k
            path = str(self.chunk_path(name, index))
            lo = index * info.chunk_elems
            what = f"{kind} {name} chunk {index} elements [{lo}, {lo + info.chunk_elems}) {arrow} {path}"
            body = buf[k * size : (k + 1) * size]
            known = () if crcs is None else (crcs[k],)
            future = self._runner.submit(task, name, index, path, body, info.checksum, aligned, what=what)
            futures.append(self._runner.then(future, then, name, index, path, body, *known, what=f"{what} (CRC-32C)"))
        return IORunner.gather(futures)

    # -------------------------------------------------------------- durability

    def sync(self) -> None:
        """Make every write since the last sync durable: wait for it, fsync its files and directories.

        Raises `OffloadIOError` if one of those writes failed: its data cannot
        be made durable, so the caller must write it again.
        """
        writes, files, dirs = self._ledger.take()
        failed: list[tuple[str, BaseException]] = []
        chunk_files: set[str] = set()  # a chunk rewritten since the last sync needs one fsync
        for name, first, count, future in writes:
            error = future.exception()
            if error is not None:
                failed.append((name, error))
                continue
            chunk_files.update(str(self.chunk_path(name, index)) for index in range(first, first + count))
        self._fsync_all([*chunk_files, *files], dirs)
        if failed:
            name, error = failed[0]
            raise OffloadIOError(
                getattr(error, "errno", None) or errno.EIO,
                f"sync of offload store {self.path}: {len(failed)} write(s) since the last sync failed, "
                f"the first to array {name!r}: {error}; write that data again, then sync",
            ) from error
        log.debug("synced %d files and %d directories in %s", len(chunk_files) + len(files), len(dirs), self.path)

    def _fsync_all(self, files: list[str], dirs: set[str]) -> None:
        # In parallel: on a journaling filesystem one fsync mostly waits for its commit.
        submit = self._runner.submit
        futures = [submit(self._files.fsync, p, os.O_RDONLY, what=f"fsync {p}") for p in files]
        dir_flags = os.O_RDONLY | os.O_DIRECTORY
        futures += [submit(self._files.fsync, d, dir_flags, what=f"fsync directory {d}") for d in dirs]
        IORunner.gather(futures).result()
