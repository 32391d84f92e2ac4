"""The shard store: a zarr v3 group on local disk, read and written by a fast route.

On-disk layout: the store is a directory holding a zarr v3 group (`zarr.json`
with the group attributes, including the `offload_store` format marker).
Arrays are 1-D, named by slash-separated paths such as `gen-0/blocks.0/master`;
each is a directory with its own `zarr.json` (shape `(numel,)`, a regular grid
of `chunk_elems`, fill value 0, the `bytes` codec little-endian, then `crc32c`
when checksummed; bfloat16 is stored as uint16 with the attribute
`torch_dtype: "bfloat16"`) and one file per chunk at `<array>/c/<index>`,
holding the chunk's raw little-endian bytes followed, when checksummed, by the
4-byte little-endian CRC-32C of those bytes. Any zarr reader can open the store.

zarr creates the metadata, so the format stays zarr's. The hot path does not
go through zarr (whose local store writes at about half of the disk's speed,
copying through temp files and fresh bytes objects): it reads and writes the
chunk files itself, in place, with positional I/O straight out of and into
the caller's buffers, O_DIRECT when the buffer allows it, one task per chunk
on an `IORunner`.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.storage import LocalStore

from offload.buffers import DIRECT_ALIGN
from offload.io import IORunner, OffloadIOError
from offload.lock import LOCK_FILE

log = logging.getLogger(__name__)

FORMAT_KEY = "offload_store"
FORMAT_VERSION = 1
TORCH_DTYPE_ATTR = "torch_dtype"

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CRC_BYTES = 4
# Top-level names of groups being built or removed: never a valid node name, swept by the writer.
_STAGING = ".staging-"
_TRASH = ".trash-"

# torch dtype -> zarr data type of the stored elements. bfloat16 has no zarr
# dtype; its bits round-trip exactly as uint16.
_ZARR_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "uint16",
    torch.int64: "int64",
    torch.uint16: "uint16",
}
_TORCH_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in _ZARR_DTYPES}


class ChecksumError(ValueError):
    """A chunk file's bytes are not what was written: bad CRC-32C or wrong length."""


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    """What the fast route needs to know about one array, read once from its `zarr.json`."""

    numel: int
    chunk_elems: int
    dtype: torch.dtype
    checksum: bool

    @property
    def nchunks(self) -> int:
        return self.numel // self.chunk_elems

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk's data, without the CRC trailer."""
        return self.chunk_elems * self.dtype.itemsize


class FileOps:
    """The store's only door to the OS for chunk files.

    Kept to a few primitives so that tests can substitute them to count
    fsyncs or inject EIO/ENOSPC into a read or a write.
    """

    def open(self, path: str, flags: int) -> int:
        # Never through a link: a chunk that is one would read or write a file outside the store.
        nofollow = 0 if flags & os.O_DIRECTORY else os.O_NOFOLLOW
        return os.open(path, flags | nofollow | os.O_CLOEXEC, 0o644)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, buf: Any, offset: int) -> int:
        return os.pwrite(fd, buf, offset)

    def preadv(self, fd: int, buf: Any, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def clear_direct(self, fd: int) -> None:
        """Drop O_DIRECT from an open file, for the unaligned 4-byte CRC trailer."""
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 array, without a copy."""
    return t.detach().view(torch.uint8).numpy()


def _crc32c(buf: np.ndarray) -> int:
    # The `crc32c` package releases the GIL on large buffers: the I/O threads checksum chunks
    # while the training thread keeps running Python (google-crc32c holds the GIL throughout).
    return crc32c.crc32c(buf.data)


def _check_name(name: str, what: str) -> None:
    parts = name.split("/")
    if any(p in ("", ".", "..", "zarr.json") for p in parts):
        raise ValueError(
            f"invalid {what} {name!r}: use slash-separated names without empty, '.', '..' "
            f"or 'zarr.json' parts, e.g. 'gen-0/blocks.0/master'"
        )


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + "/")


def _read_json(path: Path) -> dict[str, Any]:
    """A metadata file's object; damage is reported naming the file (it is never followed if a link)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}): the store's metadata was damaged outside the engine; "
            f"restore the store from a backup, or resume from a checkpoint"
        ) from None
    if not isinstance(meta, dict):
        raise ValueError(
            f"{path} holds a JSON {type(meta).__name__}, not zarr metadata; restore the store from a backup"
        )
    return meta


def _check_no_links(root: Path) -> None:
    """Refuse a store holding a symbolic link: the engine never makes one, and writing through
    one would change a file outside the store."""
    pending = [str(root)]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    raise ValueError(
                        f"offload store {root} holds a symbolic link, {entry.path} -> {os.readlink(entry.path)}: the "
                        f"engine never makes one, so the store was changed by hand; replace the link by the data it "
                        f"points to (cp -L) or restore the store, then run again"
                    )
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)


def _store_marker(root: Path) -> dict[str, Any] | None:
    """The format marker of an offload store at `root`, or None if `root` is not one."""
    try:
        meta = _read_json(root / "zarr.json")
    except (OSError, ValueError):
        return None
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
        return None
    marker = meta.get("attributes", {}).get(FORMAT_KEY)
    return marker if isinstance(marker, dict) else None


def _describe_request(kind: str, name: str, start: int, n: int, info: ArrayInfo) -> str:
    """A read or write request as its errors name it."""
    return f"{kind} {name!r} elements [{start}, {start + n}) (array numel {info.numel}, chunk size {info.chunk_elems})"


def _parse_array_meta(name: str, meta_path: Path, meta: dict[str, Any]) -> ArrayInfo:
    """Validate that an array's metadata is something the fast route reads exactly; describe it."""

    def unsupported(reason: str) -> ValueError:
        return ValueError(
            f"array {name!r} ({meta_path}) is not readable by the offload fast route: {reason}; "
            f"the fast route needs a 1-D array with regular chunks, default '/' chunk keys and "
            f"codecs [bytes(little)] or [bytes(little), crc32c]; read it with zarr instead"
        )

    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise unsupported("not a zarr v3 array")
    shape = meta.get("shape", [])
    grid = meta.get("chunk_grid", {})
    chunk_shape = grid.get("configuration", {}).get("chunk_shape", [])
    if len(shape) != 1 or grid.get("name") != "regular" or len(chunk_shape) != 1:
        raise unsupported(f"shape {shape} with chunk grid {grid}")
    keys = meta.get("chunk_key_encoding", {})
    if keys.get("name") != "default" or keys.get("configuration", {}).get("separator", "/") != "/":
        raise unsupported(f"chunk key encoding {keys}")
    codecs = [c.get("name") for c in meta.get("codecs", [])]
    endian = meta.get("codecs", [{}])[0].get("configuration", {}).get("endian")
    if codecs not in (["bytes"], ["bytes", "crc32c"]) or endian != "little":
        raise unsupported(f"codecs {meta.get('codecs')}")
    stored = meta.get("data_type")
    torch_name = meta.get("attributes", {}).get(TORCH_DTYPE_ATTR)
    if torch_name is None:
        matches = [d for d, z in _ZARR_DTYPES.items() if z == stored and d is not torch.bfloat16]
        if not matches:
            raise unsupported(f"data type {stored!r}")
        dtype = matches[0]
    else:
        named = _TORCH_BY_NAME.get(torch_name)
        if named is None or _ZARR_DTYPES[named] != stored:
            raise unsupported(f"attribute {TORCH_DTYPE_ATTR}={torch_name!r} with data type {stored!r}")
        dtype = named
    numel, chunk_elems = int(shape[0]), int(chunk_shape[0])
    if chunk_elems <= 0 or numel % chunk_elems:
        raise unsupported(f"numel {numel} is not a multiple of the chunk size {chunk_elems}")
    return ArrayInfo(numel=numel, chunk_elems=chunk_elems, dtype=dtype, checksum=codecs[-1] == "crc32c")


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
    ) -> None:
        self.path = root
        self.checksum = checksum
        self._attrs = attrs
        self._runner = runner
        self._direct = direct_io and bool(_O_DIRECT)
        self._ops = file_ops if file_ops is not None else FileOps()
        self._infos: dict[str, ArrayInfo] = {}
        self._lock = threading.Lock()
        # Since the last sync: one entry per write call (not per chunk), and the
        # metadata files and directories created or changed.
        self._pending_writes: list[tuple[str, int, int, Future]] = []
        self._pending_files: set[str] = set()
        self._pending_dirs: set[str] = set()

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
    ) -> ShardStore:
        """Create an empty store at `path` with group attributes `attrs`.

        `checksum` is the default for `create_array`. With `overwrite`, an
        existing store (or empty directory) at `path` is replaced; anything
        else there is left alone and refused.
        """
        root = Path(path)
        if FORMAT_KEY in attrs:
            raise ValueError(f"group attribute {FORMAT_KEY!r} is reserved for the store's format marker")
        if root.exists():
            contents = [p for p in root.iterdir() if p.name != LOCK_FILE] if root.is_dir() else [root]
            if contents and not overwrite:
                raise FileExistsError(
                    f"cannot create an offload store at {root}: the path exists and is not empty; "
                    f"open the store there, or remove it, or choose another path"
                )
            if contents and _store_marker(root) is None:
                raise FileExistsError(
                    f"refusing to overwrite {root}: it is not an offload store nor an empty directory; "
                    f"remove it yourself or choose another path"
                )
            for entry in contents:  # the writer lock, if any, stays held and in place
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        marker = {"version": FORMAT_VERSION, "checksum": checksum}
        zarr.create_group(LocalStore(root), attributes={**attrs, FORMAT_KEY: marker})
        store = cls(root, dict(attrs), runner=runner, checksum=checksum, direct_io=direct_io, file_ops=file_ops)
        store._pending_files.add(str(root / "zarr.json"))
        store._pending_dirs.update((str(root), str(root.parent)))
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
    ) -> ShardStore:
        """Open an existing store for reading and writing."""
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(
                errno.ENOENT,
                f"no offload store at {root}: the path does not exist; pass the folder a run trained into",
                str(root),
            )
        marker = _store_marker(root)
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
        _check_no_links(root)
        attrs = _read_json(root / "zarr.json").get("attributes", {})
        attrs.pop(FORMAT_KEY)
        log.debug("opened offload store %s", root)
        checksum = bool(marker.get("checksum", True))
        return cls(root, attrs, runner=runner, checksum=checksum, direct_io=direct_io, file_ops=file_ops)

    # -------------------------------------------------------------- attributes

    @property
    def attrs(self) -> dict[str, Any]:
        """A copy of the group attributes (without the format marker)."""
        return copy.deepcopy(self._attrs)

    def update_attrs(self, attrs: dict[str, Any]) -> None:
        """Merge `attrs` into the group attributes; durable at the next `sync()`."""
        if FORMAT_KEY in attrs:
            raise ValueError(f"group attribute {FORMAT_KEY!r} is reserved for the store's format marker")
        zarr.open_group(LocalStore(self.path), mode="r+").update_attributes(attrs)
        self._attrs.update(copy.deepcopy(attrs))
        with self._lock:
            # zarr replaces zarr.json by a rename: the directory entry changes too.
            self._pending_files.add(str(self.path / "zarr.json"))
            self._pending_dirs.add(str(self.path))

    # ------------------------------------------------------------------ arrays

    def create_array(self, name: str, numel: int, chunk_elems: int, dtype: torch.dtype) -> None:
        """Create the 1-D array `name`; no chunk exists until it is written."""
        _check_name(name, "array name")
        if dtype not in _ZARR_DTYPES:
            raise ValueError(
                f"cannot create array {name!r} with dtype {dtype}: supported dtypes are "
                f"{', '.join(str(d) for d in _ZARR_DTYPES)}"
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
                f"ShardStore.delete({name!r})"
            )
        zarr.create_array(
            LocalStore(self.path),
            name=name,
            shape=(numel,),
            chunks=(chunk_elems,),
            dtype=_ZARR_DTYPES[dtype],
            serializer=BytesCodec(endian="little"),
            compressors=[Crc32cCodec()] if self.checksum else None,
            filters=None,
            fill_value=0,
            attributes={TORCH_DTYPE_ATTR: str(dtype).removeprefix("torch.")},
        )
        # Made here, not on first write, so the chunk writers never race to create it.
        (array_dir / "c").mkdir()
        info = ArrayInfo(numel=numel, chunk_elems=chunk_elems, dtype=dtype, checksum=self.checksum)
        # zarr may have created parent groups too. Fsyncing one that already
        # existed costs little, and the sets keep each path once.
        groups = [p for p in array_dir.parents if _under(str(p), str(self.path)) and p != self.path]
        meta_files = [str(d / "zarr.json") for d in (array_dir, *groups)]
        dirs = [str(d) for d in (array_dir / "c", array_dir, *groups, self.path)]
        with self._lock:
            self._infos[name] = info
            self._pending_files.update(meta_files)
            self._pending_dirs.update(dirs)

    def has_array(self, name: str) -> bool:
        """Whether `name` is an array (of any format: `array_info` says if the fast route reads it)."""
        if name in self._infos:
            return True
        _check_name(name, "array name")
        try:
            return _read_json(self.path / name / "zarr.json").get("node_type") == "array"
        except FileNotFoundError:
            return False

    def array_names(self) -> list[str]:
        """Every array in the store, sorted; walks only zarr nodes, never chunk directories."""
        names = []
        for dirpath, dirnames, filenames in os.walk(self.path):
            is_node = dirpath != str(self.path) and "zarr.json" in filenames
            if is_node and _read_json(Path(dirpath) / "zarr.json").get("node_type") == "array":
                names.append(os.path.relpath(dirpath, self.path).replace(os.sep, "/"))
                dirnames.clear()
                continue
            dirnames[:] = [d for d in dirnames if os.path.exists(os.path.join(dirpath, d, "zarr.json"))]
        return sorted(names)

    def array_info(self, name: str) -> ArrayInfo:
        """The array's metadata, read from disk once and cached."""
        info = self._infos.get(name)
        if info is not None:
            return info
        _check_name(name, "array name")
        meta_path = self.path / name / "zarr.json"
        try:
            meta = _read_json(meta_path)
        except FileNotFoundError:
            raise KeyError(
                f"no array {name!r} in offload store {self.path} ({meta_path} is missing): the store is "
                f"incomplete; resume from a checkpoint or restore the store"
            ) from None
        if meta.get("node_type") != "array":
            raise KeyError(f"{name!r} in offload store {self.path} is a {meta.get('node_type')}, not an array")
        info = _parse_array_meta(name, meta_path, meta)
        with self._lock:
            self._infos[name] = info
        return info

    # ---------------------------------------------------------------- data I/O

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Read elements `[start, start + out.numel())` of `name` into `out`; blocks."""
        self.read_async(name, start, out).result()

    def write_from(self, name: str, start: int, src: torch.Tensor) -> None:
        """Write `src` to elements `[start, start + src.numel())` of `name`; blocks (durable at `sync()`)."""
        self.write_async(name, start, src).result()

    def read_async(self, name: str, start: int, out: torch.Tensor) -> Future:
        """Start reading whole chunks into `out`; do not touch `out` until the future completes."""
        info, first, buf, aligned = self._plan("read", name, start, out)
        return self._submit_chunks("read", name, info, first, buf, aligned, self._read_chunk)

    def write_async(self, name: str, start: int, src: torch.Tensor) -> Future:
        """Start writing whole chunks from `src`; do not modify `src` until the future completes."""
        info, first, buf, aligned = self._plan("write", name, start, src)
        future = self._submit_chunks("write", name, info, first, buf, aligned, self._write_chunk)
        with self._lock:
            self._pending_writes.append((name, first, buf.size // info.chunk_bytes, future))
            self._pending_dirs.add(str(self.path / name / "c"))
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
        for index, chunk in scratch.items():
            lo, hi = max(start, index * size), min(end, (index + 1) * size)
            out[lo - start : hi - start].copy_(chunk[lo - index * size : hi - index * size])

    def chunk_path(self, name: str, index: int) -> Path:
        return self.path / name / "c" / str(index)

    def check_chunk_file(self, name: str, index: int) -> None:
        """Refuse a chunk whose file does not hold the bytes its array's metadata promises,
        before a buffer is allocated for it: metadata claiming a huge chunk must not make a
        reader allocate what no file holds."""
        info = self.array_info(name)
        path = self.chunk_path(name, index)
        expected = info.chunk_bytes + (_CRC_BYTES if info.checksum else 0)
        try:
            found = os.lstat(path).st_size
        except FileNotFoundError:
            raise ChecksumError(
                f"array {name!r} chunk {index}: {path} is missing; restore the store from a checkpoint"
            ) from None
        if found != expected:
            raise ChecksumError(
                f"array {name!r} chunk {index}: {path} holds {found} bytes where its metadata "
                f"({self.path / name / 'zarr.json'}) promises {expected}; the store is damaged, restore it "
                f"from a checkpoint"
            )

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
        buf = _byte_view(t)
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
        task: Callable[..., None],
    ) -> Future:
        arrow = "->" if kind == "write" else "<-"
        size = info.chunk_bytes
        futures = []
        for k in range(buf.size // size):
            index = first + k
            path = str(self.chunk_path(name, index))
            lo = index * info.chunk_elems
            what = f"{kind} {name} chunk {index} elements [{lo}, {lo + info.chunk_elems}) {arrow} {path}"
            body = buf[k * size : (k + 1) * size]
            futures.append(self._runner.submit(task, name, index, path, body, info.checksum, aligned, what=what))
        return IORunner.gather(futures)

    def _open(self, path: str, flags: int, aligned: bool) -> tuple[int, bool]:
        """Open a chunk file, with O_DIRECT if the buffer, the store and the filesystem allow it.

        Returns the descriptor and whether it is in O_DIRECT mode.
        """
        if aligned and self._direct:
            try:
                return self._ops.open(path, flags | _O_DIRECT), True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self._disable_direct(path, err)
        return self._ops.open(path, flags), False

    def _disable_direct(self, path: str, err: OSError) -> None:
        with self._lock:
            if not self._direct:
                return
            self._direct = False
        log.warning("O_DIRECT refused on %s (%s); store %s falls back to buffered I/O", path, err, self.path)

    def _write_all(self, fd: int, buf: Any, offset: int) -> None:
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = self._ops.pwrite(fd, view[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite made no progress at offset {offset + done}")
            done += n

    def _read_all(self, fd: int, buf: Any, offset: int) -> int:
        """Fill `buf` from `offset`; fewer bytes returned only at end of file."""
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = self._ops.preadv(fd, view[done:], offset + done)
            if n == 0:
                break
            done += n
        return done

    def _write_chunk(self, name: str, index: int, path: str, body: np.ndarray, checksum: bool, aligned: bool) -> None:
        # In place, no temp file and rename: crash consistency comes from generations.
        fd, direct = self._open(path, os.O_WRONLY | os.O_CREAT, aligned)
        try:
            self._write_all(fd, body, 0)
            if checksum:
                if direct:
                    self._ops.clear_direct(fd)
                self._write_all(fd, _crc32c(body).to_bytes(_CRC_BYTES, "little"), body.size)
        finally:
            self._ops.close(fd)

    def _read_chunk(self, name: str, index: int, path: str, body: np.ndarray, checksum: bool, aligned: bool) -> None:
        fd, direct = self._open(path, os.O_RDONLY, aligned)
        try:
            got = self._read_all(fd, body, 0)
            trailer = bytearray(_CRC_BYTES)
            if checksum and got == body.size:
                if direct:
                    self._ops.clear_direct(fd)
                got += self._read_all(fd, trailer, body.size)
        finally:
            self._ops.close(fd)
        expected = body.size + (_CRC_BYTES if checksum else 0)
        if got != expected:
            raise ChecksumError(
                f"array {name!r} chunk {index}: {path} is truncated ({got} of {expected} bytes); "
                f"the chunk must be rewritten or restored from a checkpoint"
            )
        if checksum:
            stored, actual = int.from_bytes(trailer, "little"), _crc32c(body)
            if stored != actual:
                raise ChecksumError(
                    f"array {name!r} chunk {index}: {path} fails its CRC-32C check "
                    f"(stored {stored:#010x}, computed {actual:#010x}); the file is corrupt, "
                    f"restore it from a checkpoint"
                )

    # -------------------------------------------------------------- durability

    def sync(self) -> None:
        """Make every write since the last sync durable: wait for it, fsync its files and directories.

        Raises `OffloadIOError` if one of those writes failed: its data cannot
        be made durable, so the caller must write it again.
        """
        with self._lock:
            writes, self._pending_writes = self._pending_writes, []
            files, self._pending_files = self._pending_files, set()
            dirs, self._pending_dirs = self._pending_dirs, set()
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
        futures = [submit(self._fsync_path, p, os.O_RDONLY, what=f"fsync {p}") for p in files]
        dir_flags = os.O_RDONLY | os.O_DIRECTORY
        futures += [submit(self._fsync_path, d, dir_flags, what=f"fsync directory {d}") for d in dirs]
        IORunner.gather(futures).result()

    def _fsync_path(self, path: str, flags: int) -> None:
        fd = self._ops.open(path, flags)
        try:
            self._ops.fsync(fd)
        finally:
            self._ops.close(fd)

    # ----------------------------------------------------------- reorganising

    def _node_dir(self, prefix: str, what: str) -> Path:
        _check_name(prefix, what)
        node = self.path / prefix
        if not (node / "zarr.json").exists():
            raise FileNotFoundError(
                errno.ENOENT, f"no group or array {prefix!r} in offload store {self.path}", str(node)
            )
        return node

    def move(self, src_prefix: str, dst_prefix: str) -> None:
        """Rename the group or array `src_prefix` to `dst_prefix` atomically; durable on return.

        Everything pending is synced first, so the data is durable before it
        appears under its new name (what keeping a checkpoint needs). zarr
        metadata holds no paths, so it stays valid; missing parent groups of
        the destination are created.
        """
        src = self._node_dir(src_prefix, "source prefix")
        _check_name(dst_prefix, "destination prefix")
        if _under(dst_prefix, src_prefix):
            raise ValueError(f"cannot move {src_prefix!r} into itself ({dst_prefix!r})")
        dst = self.path / dst_prefix
        if dst.exists():
            raise FileExistsError(
                errno.EEXIST,
                f"cannot move {src_prefix!r} to {dst_prefix!r}: the destination exists; delete it first",
                str(dst),
            )
        self.sync()
        made = self._make_parent_groups(dst_prefix)
        os.rename(src, dst)
        with self._lock:
            for name in [n for n in self._infos if _under(n, src_prefix)]:
                self._infos[dst_prefix + name[len(src_prefix) :]] = self._infos.pop(name)
        # New directory entries: in both parents, and for each new group its
        # zarr.json and its own entry.
        dirs = {str(src.parent), str(dst.parent)}
        for meta in made:
            dirs.update((str(Path(meta).parent), str(Path(meta).parent.parent)))
        self._fsync_all(made, dirs)
        log.debug("moved %s -> %s in %s", src_prefix, dst_prefix, self.path)

    def _make_parent_groups(self, prefix: str) -> list[str]:
        """Create the missing groups above `prefix`; return their new metadata files."""
        made = []
        parts = prefix.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            group = "/".join(parts[:depth])
            meta = self.path / group / "zarr.json"
            if not meta.exists():
                zarr.open_group(LocalStore(self.path), path=group, mode="w-")
                made.append(str(meta))
            elif _read_json(meta).get("node_type") != "group":
                raise ValueError(f"cannot place {prefix!r} under {group!r}: {group!r} is an array, not a group")
        return made

    def build(self, prefix: str, fill: Callable[[str], None]) -> None:
        """Create the group `prefix` whole or not at all: `fill(staging)` creates its arrays
        under a staging name, which is made durable and then renamed to `prefix`. A crash
        before the rename leaves only a leftover that `sweep` removes, never a half-made
        `prefix`."""
        _check_name(prefix, "prefix")
        staging = f"{_STAGING}{uuid.uuid4().hex}"
        fill(staging)
        self.move(staging, prefix)

    def delete(self, prefix: str) -> None:
        """Delete the group or array `prefix` and everything under it; durable at the next `sync()`.

        The node is first renamed out of the way (durably), then removed: a crash mid-removal
        leaves no partial node under its name, only a leftover that `sweep` removes. A node
        without metadata (a leftover itself) is deleted too. Writes still in flight under
        `prefix` are waited for first, so none lands in a directory being removed.
        """
        _check_name(prefix, "prefix")
        node = self.path / prefix
        if not node.is_dir() or node.is_symlink():
            raise FileNotFoundError(
                errno.ENOENT, f"no group or array {prefix!r} in offload store {self.path}", str(node)
            )
        with self._lock:
            doomed = [w for w in self._pending_writes if _under(w[0], prefix)]
            self._pending_writes = [w for w in self._pending_writes if not _under(w[0], prefix)]
        for *_, future in doomed:
            future.exception()  # the data is being deleted: its errors no longer matter
        self._discard(node)
        node_str = str(node)
        with self._lock:
            for name in [n for n in self._infos if _under(n, prefix)]:
                del self._infos[name]
            self._pending_files = {f for f in self._pending_files if not _under(f, node_str)}
            self._pending_dirs = {d for d in self._pending_dirs if not _under(d, node_str)}
            self._pending_dirs.add(str(node.parent))
        log.debug("deleted %s from %s", prefix, self.path)

    def _discard(self, node: Path) -> None:
        """Remove a directory tree: renamed to a leftover name first, durably, so that no crash
        leaves it half-removed under its own name."""
        trash = self.path / f"{_TRASH}{uuid.uuid4().hex}"
        os.rename(node, trash)
        self._fsync_all([], {str(node.parent), str(self.path)})
        shutil.rmtree(trash)

    def sweep(self) -> None:
        """Remove what interrupted operations left behind: half-built groups (`build`),
        half-removed ones (`delete`) and temporary metadata files. For the store's one writer,
        before it writes: nothing else refers to them."""
        for entry in self.path.iterdir():
            if entry.name.startswith((_STAGING, _TRASH)) and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
                log.info("removed %s, left by an interrupted run", entry)
            elif entry.is_file() and (
                (entry.name.startswith(".") and entry.name.endswith(".tmp")) or entry.name.endswith(".partial")
            ):
                entry.unlink()  # an atomic metadata write's temporary: ours, or zarr's
