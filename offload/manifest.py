"""Atomic commit of a store generation.

A step writes a whole new generation, then names it in one small JSON file
(``COMMITTED``). Replacing that file is the commit: a crash at any instant must
leave it naming either the old generation or the new one, never a torn mix, so
the store is always a valid checkpoint. That takes a temp file in the same
directory, fsync of its contents, an atomic rename over the old name, and fsync
of the directory so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the committed record's layout; readers refuse any other."""

_FORMAT_KEY = "format"


class ManifestError(ValueError):
    """A committed record exists but cannot be trusted."""


def write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new bytes, never a mix.
    ``durable``: fsync the bytes before the rename and the folder after it, so that a power loss
    keeps the new file too; without it the rename is atomic but made durable by whatever syncs
    the folder next (a store's metadata at its commit, a cache never). The file's mode is the
    umask's, as for any file the process makes."""
    path = Path(path)
    # Same directory, so the rename stays within one filesystem and is atomic; the leading dot and
    # suffix keep a temp left by a crash from passing for the real name (``offload.nodes`` sweeps it).
    tmp_name = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp_name, "xb") as tmp:
            tmp.write(data)
            if durable:
                tmp.flush()
                os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:  # a failed write names no file
            raise OSError(exc.errno, f"writing {path}: {exc.strerror}") from exc
        raise
    if durable:
        _fsync_dir(path.parent)


def commit(store_dir: Path, record: dict[str, Any], name: str = "COMMITTED") -> None:
    """Write ``record`` as the store's committed state, atomically.

    The JSON has sorted keys (so equal records give equal bytes) and a
    ``format`` field, which is reserved and must not be in ``record``.
    """
    store_dir = Path(store_dir)
    path = store_dir / name
    if _FORMAT_KEY in record:
        raise ValueError(f"the key {_FORMAT_KEY!r} is reserved for the manifest version; rename it in the record")
    if not store_dir.is_dir():
        raise FileNotFoundError(f"store directory {store_dir} does not exist; create the store before committing")
    try:
        text = json.dumps({**record, _FORMAT_KEY: FORMAT_VERSION}, sort_keys=True, indent=1, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"the record for {path} is not plain JSON ({exc}); convert tensors, bytes and non-finite "
            "floats to lists, strings or numbers before committing"
        ) from exc
    write_atomic(path, text.encode("utf-8"))
    logger.debug("committed %s", path)


def read_committed(store_dir: Path, name: str = "COMMITTED") -> dict[str, Any] | None:
    """Return the committed record (without its ``format`` field), or None if nothing was committed."""
    path = Path(store_dir) / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(
            f"{path} is garbled or truncated ({exc}); commits replace it atomically, so it was changed "
            "outside the engine: restore it from a backup or resume from a retained checkpoint"
        ) from exc
    if not isinstance(record, dict):
        raise ManifestError(
            f"{path} holds a JSON {type(record).__name__}, not an object; it is not a manifest: "
            "restore it from a backup or resume from a retained checkpoint"
        )
    if _FORMAT_KEY not in record:
        raise ManifestError(
            f"{path} has no {_FORMAT_KEY!r} field, so it was not written by commit(); "
            "restore it from a backup or resume from a retained checkpoint"
        )
    found = record.pop(_FORMAT_KEY)
    if found != FORMAT_VERSION:
        raise ManifestError(
            f"{path} has manifest format {found!r}, but this version reads format {FORMAT_VERSION}; "
            "open the store with the version of the engine that wrote it"
        )
    return record


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable: the new name lives in the directory's own data."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
