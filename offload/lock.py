"""One writer per store: an exclusive ``flock`` on ``<store>/LOCK``.

Two runs writing one store would interleave their steps chunk by chunk and commit a mix
that neither run computed, with every checksum intact. The process that writes a store
holds an exclusive lock on a file inside it from before its first byte to its close; the
kernel drops the lock when the process dies, however it dies, so a crash never leaves a
store locked. A second writer is refused at once, naming the holder, which the lock file
records (pid, host, start time) for exactly that message. Readers take no lock: they read
only committed generations, which no writer modifies.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any

from offload.metadata import store_marker
from offload.stripes import refuse_share

LOCK_FILE = "LOCK"


class StoreLockedError(RuntimeError):
    """Another process holds the store's writer lock."""


def describe_holder(holder: dict[str, Any] | None) -> str:
    """The holder of a lock as messages name it."""
    if not holder:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {since})"


def read_holder(store_dir: Path) -> dict[str, Any] | None:
    """Who holds the lock on ``store_dir``, without taking it (None: nobody, or no lock file)."""
    path = Path(store_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_record(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _holder_record(fd: int) -> dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


class StoreLock:
    """The writer lock of one store, held until ``release``, until this object is collected
    (an engine whose construction failed), or until the process ends."""

    def __init__(self, store_dir: Path, fd: int, made: list[Path]):
        self.store_dir = store_dir
        self._release = weakref.finalize(self, _release, store_dir, fd, made)

    @classmethod
    def acquire(cls, store_dir: str | os.PathLike[str], create: bool = True) -> StoreLock:
        """Take the lock, creating the store's folder (and missing parents) if ``create``.
        Raises ``StoreLockedError`` naming the holder if another process has it."""
        store_dir = Path(store_dir)
        if store_dir.exists() and not store_dir.is_dir():
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"offload store path {store_dir} is a file, not a folder; choose another offload.nvme_path",
            )
        if store_dir.is_dir():
            refuse_share(store_dir, store_marker(store_dir))  # a share's writer is its store's, never its own
        made = [p for p in (store_dir, *store_dir.parents) if not p.exists()]
        if made and not create:
            raise FileNotFoundError(
                errno.ENOENT,
                f"no offload store at {store_dir}: the path does not exist; pass the folder a run trained into "
                f"(its offload.nvme_path)",
                str(store_dir),
            )
        _make_folder(store_dir, made)
        fd = os.open(store_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_record(fd)
            os.close(fd)
            raise StoreLockedError(
                f"store {store_dir} is being written by {describe_holder(holder)}: two runs on one store would mix "
                f"their steps; wait for that run to end or stop it, or choose another offload.nvme_path"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        return cls(store_dir, fd, made)

    @property
    def held(self) -> bool:
        return self._release.alive

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        self._release()


def _make_folder(store_dir: Path, made: list[Path]) -> None:
    """Create ``store_dir`` and its missing parents ``made`` (deepest first). A failure is one
    line naming the key to change, not a bare errno, and removes the parents it did create."""
    try:
        store_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # never made, or not ours to remove
                continue
        failed = f" ({err.filename})" if err.filename else ""
        raise OSError(
            err.errno,
            f"cannot create the store folder {store_dir} for offload.nvme_path: {err.strerror or err}{failed}; "
            f"choose a folder on a writable local disk",
        ) from err


def _release(store_dir: Path, fd: int, made: list[Path]) -> None:
    """Drop the lock. Folders the lock created that still hold nothing else are removed with
    it: a run refused before writing anything leaves no trace."""
    empty = bool(made) and [p.name for p in store_dir.iterdir()] == [LOCK_FILE]
    if empty:
        (store_dir / LOCK_FILE).unlink()  # while still held: no other process can have taken it
    os.close(fd)
    if empty:
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:  # something was put there meanwhile
                break
