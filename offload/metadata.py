"""The store's zarr metadata: the group's format marker, the arrays' `zarr.json`, and the
checks every name and metadata file passes before it becomes a path or a read.

The store is a directory holding a zarr v3 group (`zarr.json` with the group attributes,
including the `offload_store` format marker). Arrays are 1-D, named by slash-separated
paths such as `gen-0/blocks.0/master`; each is a directory with its own `zarr.json` (shape
`(numel,)`, a regular grid of `chunk_elems`, fill value 0, the `bytes` codec little-endian,
then `crc32c` when checksummed; bfloat16 is stored as uint16 with the attribute
`torch_dtype: "bfloat16"`). zarr makes this metadata (once per dtype, each array filling in
its numbers), so the format stays zarr's and any zarr reader can open the store; the fast
route (`offload.chunks`) only reads it back, and only what it can read exactly.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import LocalStore, MemoryStore

from offload.manifest import write_atomic

FORMAT_KEY = "offload_store"
FORMAT_VERSION = 1
TORCH_DTYPE_ATTR = "torch_dtype"
STRIPE_START_ATTR = "stripe_start"
"""Array attribute of a store striped across several folders: the folder of its chunk 0
(``offload.stripes``); absent, 0."""

# torch dtype -> zarr data type of the stored elements. bfloat16 has no zarr
# dtype; its bits round-trip exactly as uint16.
ZARR_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "uint16",
    torch.int64: "int64",
    torch.uint16: "uint16",
    torch.uint8: "uint8",  # packed bytes (8-bit optimizer moments with their block scales)
}
_TORCH_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in ZARR_DTYPES}


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    """What the fast route needs to know about one array, read once from its `zarr.json`."""

    numel: int
    chunk_elems: int
    dtype: torch.dtype
    checksum: bool
    stripe_start: int = 0
    """In a store of several folders, the position of the one holding chunk 0 (``offload.stripes``)."""

    @property
    def nchunks(self) -> int:
        return self.numel // self.chunk_elems

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk's data, without the CRC trailer."""
        return self.chunk_elems * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array's data (padding included, CRC trailers not)."""
        return self.numel * self.dtype.itemsize


def check_name(name: str, what: str) -> None:
    parts = name.split("/")
    if any(p in ("", ".", "..", "zarr.json") for p in parts):
        raise ValueError(
            f"invalid {what} {name!r}: use slash-separated names without empty, '.', '..' "
            f"or 'zarr.json' parts, e.g. 'gen-0/blocks.0/master'"
        )


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + "/")


def read_json(path: Path) -> dict[str, Any]:
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


def check_no_links(root: Path) -> None:
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


def group_attrs(root: Path) -> dict[str, Any]:
    """The attributes of the group at `root`, less the store's format marker."""
    attrs = dict(read_json(root / "zarr.json").get("attributes", {}))
    attrs.pop(FORMAT_KEY, None)
    return attrs


def store_marker(root: Path) -> dict[str, Any] | None:
    """The format marker of an offload store at `root`, or None if `root` is not one."""
    try:
        meta = read_json(root / "zarr.json")
    except (OSError, ValueError):
        return None
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
        return None
    marker = meta.get("attributes", {}).get(FORMAT_KEY)
    return marker if isinstance(marker, dict) else None


def parse_array_meta(name: str, meta_path: Path, meta: dict[str, Any]) -> ArrayInfo:
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
    # zarr names no byte order for one-byte data
    byte_order_ok = endian == "little" or (endian is None and meta.get("data_type") == "uint8")
    if codecs not in (["bytes"], ["bytes", "crc32c"]) or not byte_order_ok:
        raise unsupported(f"codecs {meta.get('codecs')}")
    stored = meta.get("data_type")
    torch_name = meta.get("attributes", {}).get(TORCH_DTYPE_ATTR)
    if torch_name is None:
        matches = [d for d, z in ZARR_DTYPES.items() if z == stored and d is not torch.bfloat16]
        if not matches:
            raise unsupported(f"data type {stored!r}")
        dtype = matches[0]
    else:
        named = _TORCH_BY_NAME.get(torch_name)
        if named is None or ZARR_DTYPES[named] != stored:
            raise unsupported(f"attribute {TORCH_DTYPE_ATTR}={torch_name!r} with data type {stored!r}")
        dtype = named
    numel, chunk_elems = int(shape[0]), int(chunk_shape[0])
    if chunk_elems <= 0 or numel % chunk_elems:
        raise unsupported(f"numel {numel} is not a multiple of the chunk size {chunk_elems}")
    start = meta.get("attributes", {}).get(STRIPE_START_ATTR, 0)
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise unsupported(f"attribute {STRIPE_START_ATTR}={start!r}")
    return ArrayInfo(
        numel=numel, chunk_elems=chunk_elems, dtype=dtype, checksum=codecs[-1] == "crc32c", stripe_start=start
    )


def create_group(root: Path, attrs: dict[str, Any]) -> None:
    """Write the metadata of a new store's group at `root`, with its attributes."""
    zarr.create_group(LocalStore(root), attributes=attrs)


def create_subgroup(root: Path, path: str) -> None:
    """Write the metadata of a new, empty group at `path` inside the store at `root`."""
    zarr.open_group(LocalStore(root), path=path, mode="w-")


def update_group_attrs(root: Path, attrs: dict[str, Any]) -> None:
    """Merge `attrs` into the attributes of the group at `root` (zarr replaces its `zarr.json` by a rename)."""
    zarr.open_group(LocalStore(root), mode="r+").update_attributes(attrs)


def create_array_meta(
    root: Path, name: str, numel: int, chunk_elems: int, dtype: torch.dtype, checksum: bool, stripe_start: int | None
) -> None:
    """Write the `zarr.json` of the 1-D array `name` (and of any missing group above it) in the
    store at `root`, in the one form `parse_array_meta` reads back (`stripe_start` only in a
    store of several folders): zarr's own documents (`_zarr_documents`), the array's shape,
    chunks and attributes filled in."""
    array, group = _zarr_documents(dtype, checksum)
    node = root / name
    for parent in reversed(node.relative_to(root).parents[:-1]):  # the groups above it, top down
        if not (root / parent / "zarr.json").is_file():
            (root / parent).mkdir(exist_ok=True)
            _write_document(root / parent / "zarr.json", group)
    striped = {} if stripe_start is None else {STRIPE_START_ATTR: stripe_start}
    document = array | {
        "shape": [numel],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_elems]}},
        "attributes": {TORCH_DTYPE_ATTR: str(dtype).removeprefix("torch."), **striped},
    }
    node.mkdir()
    _write_document(node / "zarr.json", document)


def _write_document(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as ``path`` whole or not at all, made durable by the store's next sync
    (one fsync per array would cost hundreds at a store's creation)."""
    write_atomic(path, json.dumps(document, indent=2).encode(), durable=False)


@functools.cache
def _zarr_documents(dtype: torch.dtype, checksum: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `zarr.json` zarr writes for a 1-D array of `dtype` (checksummed or not) and for the
    group above it, made by zarr once, in memory. Each array's metadata is this document with
    its own numbers: a call of zarr per array cost 3.4 ms, 2.3 s of a 1B model's 7.3 s import
    for its 550 arrays."""
    store = MemoryStore()
    zarr.create_array(
        store,
        name="group/array",
        shape=(1,),
        chunks=(1,),
        dtype=ZARR_DTYPES[dtype],
        serializer=BytesCodec(endian="little"),
        compressors=[Crc32cCodec()] if checksum else None,
        filters=None,
        fill_value=0,
    )

    def document(key: str) -> dict[str, Any]:
        stored = sync(store.get(key, prototype=default_buffer_prototype()))
        assert stored is not None, key
        return json.loads(stored.to_bytes())

    return document("group/array/zarr.json"), document("group/zarr.json")
