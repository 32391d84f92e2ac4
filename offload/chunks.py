"""The fast route to a store's chunk files: positional reads and writes in place, straight
out of and into the caller's buffers, O_DIRECT where the buffer allows it, and a CRC-32C
trailer per chunk.

A chunk is one file at `<array>/c/<index>` holding the chunk's raw little-endian bytes
followed, when checksummed, by the 4-byte little-endian CRC-32C of those bytes (zarr's
`crc32c` codec). zarr's own local store writes at about half of the disk's speed, copying
through temp files and fresh bytes objects, so the hot path does this itself, one task per
chunk on the store's `IORunner`.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import fastcrc
import numpy as np
import torch

from offload.costs import CostAccount
from offload.metadata import ArrayInfo

# The fallback from O_DIRECT is the store's behaviour, reported under its name.
log = logging.getLogger("offload.store")

O_DIRECT = getattr(os, "O_DIRECT", 0)
CRC_BYTES = 4
TRAILER_BLOCK = 4096
"""An O_DIRECT read of the trailer reads this aligned block; the file ends 4 bytes into it."""


class ChecksumError(ValueError):
    """A chunk file's bytes are not what was written: bad CRC-32C or wrong length."""


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
        """Read at ``offset`` into ``buf``: one buffer, or a list of them filled in turn."""
        return os.preadv(fd, buf if isinstance(buf, list) else [buf], offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def allocate(self, fd: int, length: int) -> None:
        """Reserve the file's first ``length`` bytes, reading as zeros, without writing them; a
        system or filesystem that cannot reserve gets a hole of that length, zeros too."""
        reserve = getattr(os, "posix_fallocate", None)  # none on macOS
        if reserve is not None:
            try:
                return reserve(fd, 0, length)
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise  # a full disk among them
        os.ftruncate(fd, length)

    def clear_direct(self, fd: int) -> None:
        """Drop O_DIRECT from an open chunk file, for the unaligned 4-byte CRC trailer.

        One call, no F_GETFL first: of the flags F_SETFL changes (O_APPEND, O_ASYNC, O_DIRECT,
        O_NOATIME, O_NONBLOCK) a chunk file is only ever opened with O_DIRECT.
        """
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 array, without a copy."""
    return t.detach().view(torch.uint8).numpy()


def crc32c_of(buf: np.ndarray) -> int:
    # fastcrc's CRC-32/ISCSI (CRC-32C) folds with carry-less multiplies: 72 GB/s in cache here
    # against 21 for the `crc32c` package's crc32 instructions; from memory, where a chunk's
    # bytes are, both run at the memory's speed (`python -m benchmarks.checksum`). It releases
    # the GIL, so the checking threads run beside training.
    return fastcrc.crc32.iscsi(buf.data)


ZERO_BLOCK = 1 << 20


@functools.lru_cache(maxsize=16)
def zeros_crc32c(nbytes: int) -> int:
    """The CRC-32C of ``nbytes`` zero bytes (a chunk's size: a handful of sizes a store)."""
    block = np.zeros(min(nbytes, ZERO_BLOCK), dtype=np.uint8)
    crc, left = None, nbytes
    while left:
        crc = fastcrc.crc32.iscsi(block[: min(left, block.size)].data, crc)
        left -= min(left, block.size)
    return fastcrc.crc32.iscsi(b"") if crc is None else crc


def chunk_dir(root: Path, name: str) -> Path:
    """The directory of array `name`'s chunk files in the store at `root`."""
    return root / name / "c"


def chunk_path(root: Path, name: str, index: int) -> Path:
    """The file of chunk `index` of array `name` in the store at `root`."""
    return chunk_dir(root, name) / str(index)


class ChunkFiles:
    """The chunk files of one store, each read or written whole by one call, safely from many
    threads at once (for distinct chunks). `ops` is the only door to the OS, so that tests can
    substitute it; O_DIRECT is dropped for good, with a warning, the first time the
    filesystem refuses it. `costs` accounts the CPU time of each stage (`offload.costs`)."""

    def __init__(self, root: Path, ops: FileOps, direct: bool, costs: CostAccount | None = None) -> None:
        self.root = root
        self.ops = ops
        self.direct = direct and bool(O_DIRECT)
        self.costs = costs if costs is not None else CostAccount()
        self._lock = threading.Lock()
        self._local = threading.local()  # per I/O thread: an aligned block for the CRC trailer

    def check_size(self, name: str, index: int, info: ArrayInfo, path: Path) -> None:
        """Refuse a chunk whose file (at `path`) does not hold the bytes its array's metadata promises."""
        expected = info.chunk_bytes + (CRC_BYTES if info.checksum else 0)
        try:
            found = os.lstat(path).st_size
        except FileNotFoundError:
            raise ChecksumError(
                f"array {name!r} chunk {index}: {path} is missing; restore the store from a checkpoint"
            ) from None
        if found != expected:
            raise ChecksumError(
                f"array {name!r} chunk {index}: {path} holds {found} bytes where its metadata "
                f"({self.root / name / 'zarr.json'}) promises {expected}; the store is damaged, restore it "
                f"from a checkpoint"
            )

    def _open(self, path: str, flags: int, aligned: bool) -> tuple[int, bool]:
        """Open a chunk file, with O_DIRECT if the buffer, the store and the filesystem allow it.

        Returns the descriptor and whether it is in O_DIRECT mode.
        """
        timed = self.costs.timed
        if aligned and self.direct:
            try:
                return timed("open/close", self.ops.open, path, flags | O_DIRECT), True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self._disable_direct(path, err)
        return timed("open/close", self.ops.open, path, flags), False

    def _disable_direct(self, path: str, err: OSError) -> None:
        with self._lock:
            if not self.direct:
                return
            self.direct = False
        log.warning("O_DIRECT refused on %s (%s); store %s falls back to buffered I/O", path, err, self.root)

    def _write_all(self, fd: int, buf: Any, offset: int) -> None:
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = self.costs.timed("write syscalls", self.ops.pwrite, fd, view[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite made no progress at offset {offset + done}")
            done += n

    def _read_all(self, fd: int, buf: Any, offset: int) -> int:
        """Fill `buf` from `offset`; fewer bytes returned only at end of file."""
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = self.costs.timed("read syscalls", self.ops.preadv, fd, view[done:], offset + done)
            if n == 0:
                break
            done += n
        return done

    def write(self, name: str, index: int, path: str, body: np.ndarray, checksum: bool, aligned: bool) -> int | None:
        """Write chunk `index` of `name` from `body`. With `checksum`, the file is left open, its
        descriptor returned for `finish_write` to add the CRC trailer (on a checking thread, while
        this I/O thread writes on); without, it is closed and None returned."""
        # In place, no temp file and rename: crash consistency comes from generations.
        fd, direct = self._open(path, os.O_WRONLY | os.O_CREAT, aligned)
        try:
            self._write_all(fd, body, 0)
            if checksum and direct:
                self.costs.timed("write syscalls", self.ops.clear_direct, fd)
        except BaseException:
            self.costs.timed("open/close", self.ops.close, fd)
            raise
        self.costs.moved("written", body.size)
        if checksum:
            return fd
        self.costs.timed("open/close", self.ops.close, fd)
        return None

    def write_zeros(self, name: str, index: int, path: str, body: np.ndarray, checksum: bool, aligned: bool) -> None:
        """As `write`, for a `body` of zeros, none of whose bytes is written or read: the file is
        emptied, its body's length allocated (the filesystem reserves the blocks, marked as
        never written, and reads them as zeros: a step that later rewrites them in place finds
        the space the store was checked for), then given the CRC-32C trailer of that many zeros.
        A new store's optimizer moments start so: half a compact import's bytes, never written,
        and never read from the disk after. Returns no descriptor: `finish_write` has nothing
        left to do."""
        fd, _ = self._open(path, os.O_WRONLY | os.O_CREAT, aligned=False)
        try:
            self.costs.timed("write syscalls", self.ops.truncate, fd, 0)  # a recycled chunk's bytes go
            self.costs.timed("write syscalls", self.ops.allocate, fd, body.size)
            if checksum:
                self._write_all(fd, zeros_crc32c(body.size).to_bytes(CRC_BYTES, "little"), body.size)
        finally:
            self.costs.timed("open/close", self.ops.close, fd)

    def finish_write(
        self, fd: int | None, name: str, index: int, path: str, body: np.ndarray, crc: int | None = None
    ) -> None:
        """Append the CRC-32C trailer to chunk `index` of `name`, which `write` left open as `fd`,
        and close it: `crc` where the caller knows it (a chunk just read and verified, copied as it
        is), else computed from `body`. Nothing to do for a chunk without one (`fd` None)."""
        if fd is None:
            return
        try:
            if crc is None:
                crc = self.costs.timed("crc32c", crc32c_of, body)
            self._write_all(fd, crc.to_bytes(CRC_BYTES, "little"), body.size)
        finally:
            self.costs.timed("open/close", self.ops.close, fd)

    def read(self, name: str, index: int, path: str, body: np.ndarray, checksum: bool, aligned: bool) -> int | None:
        """Read chunk `index` of `name` into `body`, refusing a short file; returns the CRC-32C
        stored with it (None if the array has none), for `verify` to check the bytes against."""
        fd, direct = self._open(path, os.O_RDONLY, aligned)
        try:
            if checksum and direct:
                got, trailer = self._read_with_trailer(fd, body)
            else:
                got = self._read_all(fd, body, 0)
                trailer = bytearray(CRC_BYTES)
                if checksum and got == body.size:
                    got += self._read_all(fd, trailer, body.size)
        finally:
            self.costs.timed("open/close", self.ops.close, fd)
        expected = body.size + (CRC_BYTES if checksum else 0)
        if got != expected:
            raise ChecksumError(
                f"array {name!r} chunk {index}: {path} is truncated ({got} of {expected} bytes); "
                f"the chunk must be rewritten or restored from a checkpoint"
            )
        self.costs.moved("read", body.size)
        return int.from_bytes(trailer, "little") if checksum else None

    def verify(self, stored: int | None, name: str, index: int, path: str, body: np.ndarray) -> int | None:
        """Refuse chunk `index` of `name`, read into `body`, if its bytes do not have the CRC-32C
        `stored` with them (None: the array has none, nothing to check); returns it. Apart from
        `read`, so that the thread that read the chunk can start the next read meanwhile."""
        if stored is None:
            return None
        actual = self.costs.timed("crc32c", crc32c_of, body)
        if stored != actual:
            raise ChecksumError(
                f"array {name!r} chunk {index}: {path} fails its CRC-32C check "
                f"(stored {stored:#010x}, computed {actual:#010x}); the file is corrupt, "
                f"restore it from a checkpoint"
            )
        return stored

    def _read_with_trailer(self, fd: int, body: np.ndarray) -> tuple[int, bytearray]:
        """Body and CRC trailer in one O_DIRECT call: the trailer lands in an aligned block of
        its own, which the read fills only up to the end of the file. Returns the bytes read
        (body plus at most the trailer) and the trailer's bytes."""
        tail = getattr(self._local, "tail", None)
        if tail is None:
            tail = self._local.tail = np.frombuffer(mmap.mmap(-1, TRAILER_BLOCK), dtype=np.uint8)
        got = self.costs.timed("read syscalls", self.ops.preadv, fd, [body, tail], 0)
        extra = min(max(got - body.size, 0), CRC_BYTES)
        return min(got, body.size) + extra, bytearray(tail[:extra])

    def fsync(self, path: str, flags: int) -> None:
        """Flush one file or directory to disk (opened with `flags`)."""
        fd = self.costs.timed("open/close", self.ops.open, path, flags)
        try:
            self.costs.timed("fsync", self.ops.fsync, fd)
        finally:
            self.costs.timed("open/close", self.ops.close, fd)
