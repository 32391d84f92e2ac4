"""The machine's own limits, measured in the run that compares against them.

Absolute numbers drift by about 30% between runs here, so every benchmark that
states a bound (memory bandwidth for the optimizer, disk bandwidth for the
store) measures it itself, in the same process, with these functions.

Units: GB/s is 1e9 bytes per second of payload, i.e. bytes copied for
`memcpy_gbps` and bytes written or read for `raw_disk_gbps`. A copy moves two
bytes through memory per byte copied (one read, one write); callers that need
memory traffic double the copy figure.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DROP_CACHES = "/proc/sys/vm/drop_caches"
# Per-call size of the raw route: large enough that syscall overhead vanishes,
# small enough that several calls per thread keep the device queue full.
_IO_BLOCK = 8 << 20

K = TypeVar("K")


def page_aligned(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over fresh anonymous memory: page-aligned, as O_DIRECT needs.

    torch's own allocations are not page-aligned; an anonymous mapping always is.
    """
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def interleaved_medians(fns: Mapping[K, Callable[[], object]], reps: int, *, desc: str | None = None) -> dict[K, float]:
    """Median wall time of each callable over `reps` rounds, every round calling each one once.

    Interleaving spreads the machine's slow spells over all callables alike,
    so the ratios between them hold even when the absolute times drift. An
    untimed round comes first (warm-up: state allocation, first touch).
    `desc` shows a progress bar over the rounds.
    """
    times: dict[K, list[float]] = {key: [] for key in fns}
    for round_ in tqdm(range(reps + 1), desc=desc, unit="round", disable=desc is None):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    """Bytes copied per second (GB/s) between two preallocated buffers of `nbytes`.

    numpy's copyto is a plain memcpy (streaming stores for large copies),
    about twice as fast here as torch's `copy_`: the fastest plain copy.
    One thread: a second one adds nothing on this memory system.
    """
    src = page_aligned(nbytes).numpy()
    dst = page_aligned(nbytes).numpy()
    src.fill(1)  # touch every page before timing: first touch is several times slower
    dst.fill(0)
    seconds = interleaved_medians({"copy": lambda: np.copyto(dst, src)}, reps)["copy"]
    return nbytes / seconds / 1e9


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache, so the next read comes from disk.

    Needs root; returns False (and the read that follows is warm) otherwise.
    """
    os.sync()
    try:
        with open(_DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as err:
        log.warning("cannot drop the page cache (%s): reads will be warm, not cold", err)
        return False
    return True


def _open(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    """Open with O_DIRECT when asked and allowed; returns the descriptor and whether it is direct."""
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            log.warning("O_DIRECT refused on %s (%s): measuring buffered I/O instead", path, err)
    return os.open(path, flags, 0o644), False


def _parallel_io(fd: int, buf: torch.Tensor, threads: int, write: bool) -> None:
    """Move all of `buf` to or from offset 0 of `fd`: `threads` contiguous ranges, blocks of `_IO_BLOCK`."""
    view = memoryview(buf.numpy())
    nbytes = len(view)
    # Ranges start on page boundaries, as O_DIRECT needs.
    per_thread = -(-nbytes // threads // mmap.PAGESIZE) * mmap.PAGESIZE

    def run(lo: int) -> None:
        for offset in range(lo, min(lo + per_thread, nbytes), _IO_BLOCK):
            block = view[offset : min(offset + _IO_BLOCK, lo + per_thread, nbytes)]
            done = 0
            while done < len(block):
                rest = block[done:]
                n = os.pwrite(fd, rest, offset + done) if write else os.preadv(fd, [rest], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"no progress at byte {offset + done} of the benchmark file")
                done += n

    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(run, lo) for lo in range(0, nbytes, per_thread)]:
            future.result()


def _timed_write(path: str, buffer: torch.Tensor, threads: int, direct: bool) -> tuple[float, float, bool]:
    """One durable write of ``buffer`` over the preallocated file: GB/s, the process's CPU-seconds,
    and whether it went with O_DIRECT."""
    nbytes = buffer.numel()
    fd, is_direct = _open(path, os.O_WRONLY, direct)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        os.fsync(fd)
        cpu_start, start = time.process_time(), time.perf_counter()
        _parallel_io(fd, buffer, threads, write=True)
        os.fsync(fd)
        return nbytes / (time.perf_counter() - start) / 1e9, time.process_time() - cpu_start, is_direct
    finally:
        os.close(fd)


def _timed_read(path: str, buffer: torch.Tensor, threads: int, direct: bool) -> tuple[float, float, bool]:
    """One read of the file into ``buffer``: GB/s, the process's CPU-seconds, and whether it went with O_DIRECT."""
    fd, is_direct = _open(path, os.O_RDONLY, direct)
    try:
        cpu_start, start = time.process_time(), time.perf_counter()
        _parallel_io(fd, buffer, threads, write=False)
        return buffer.numel() / (time.perf_counter() - start) / 1e9, time.process_time() - cpu_start, is_direct
    finally:
        os.close(fd)


def raw_disk_gbps(
    directory: str | os.PathLike[str],
    nbytes: int,
    threads: int,
    direct: bool = True,
    *,
    reps: int = 3,
    buffer: torch.Tensor | None = None,
) -> dict[str, float | bool]:
    """Durable write and cold read bandwidth (GB/s) of plain positional I/O on a file in `directory`.

    This is the disk's limit as seen from Python, the yardstick for the store:
    a preallocated file (no block allocation while timed), page-aligned memory,
    `threads` threads each moving one contiguous range with `os.pwrite` /
    `os.preadv`, O_DIRECT where the filesystem allows it. The write time
    includes the fsync; the page cache is dropped before each read.

    `buffer` (uint8, page-aligned, `nbytes` long) lets a caller reuse memory
    it has already touched across calls. Returns medians over `reps` of
    `write` and `read`, plus `direct` (whether O_DIRECT was used), `cold`
    (whether the page cache could be dropped) and `cpu_s_per_gb` (the process's
    CPU-seconds per GB while each was timed, by kind).
    """
    if nbytes % mmap.PAGESIZE:
        raise ValueError(f"nbytes must be a multiple of {mmap.PAGESIZE} for O_DIRECT, got {nbytes}")
    if buffer is None:
        buffer = page_aligned(nbytes)
        buffer.fill_(0x5A)  # first touch outside the timed region
    elif buffer.numel() != nbytes or buffer.dtype != torch.uint8:
        raise ValueError(f"buffer must be {nbytes} uint8 elements, got {buffer.numel()} x {buffer.dtype}")
    writes, reads, cpu = [], [], []
    used_direct = cold = True
    fd, path = tempfile.mkstemp(prefix="raw-disk-", suffix=".bin", dir=directory)
    os.close(fd)
    try:
        for _ in range(reps):
            write, cpu_write, is_direct = _timed_write(path, buffer, threads, direct)
            writes.append(write)
            cold &= drop_page_cache()
            read, cpu_read, is_direct_read = _timed_read(path, buffer, threads, direct)
            reads.append(read)
            cpu.append((cpu_write, cpu_read))
            used_direct &= is_direct and is_direct_read
            os.truncate(path, 0)  # the next write goes to freshly preallocated blocks again
    finally:
        Path(path).unlink(missing_ok=True)
    return {
        "write": statistics.median(writes),
        "read": statistics.median(reads),
        "direct": used_direct,
        "cold": cold,
        "cpu_s_per_gb": {
            kind: statistics.median(c[i] for c in cpu) / (nbytes / 1e9) for i, kind in enumerate(("write", "read"))
        },
    }


def mixed_disk_gbps(
    directory: str | os.PathLike[str], nbytes: int, read_share: float, threads: int, *, reps: int = 3
) -> dict[str, float | bool]:
    """Bytes moved per second (GB/s) while the disk reads and durably writes at once,
    ``read_share`` of ``nbytes`` read: the limit of a training step, whose reads and
    write-backs overlap, where adding the pure read and write times over-states it (a disk
    serves both at once) or under-states it (they contend).

    A file of the read part is written and the page cache dropped (untimed); then `threads`
    threads read it while as many write the other part over a preallocated file, O_DIRECT as in
    `raw_disk_gbps`, the time running until both are done and the write is fsynced. Returns the
    median GB/s (read and written bytes together), and `direct` and `cold` as there."""
    page = mmap.PAGESIZE
    read_n = max(page, round(nbytes * read_share / page) * page)
    write_n = max(page, nbytes - read_n)
    read_buf, write_buf = page_aligned(read_n), page_aligned(write_n)
    write_buf.fill_(0xA5)  # first touch outside the timed region
    paths = [tempfile.mkstemp(prefix=f"mixed-{kind}-", suffix=".bin", dir=directory) for kind in ("read", "write")]
    for fd, _ in paths:
        os.close(fd)
    (_, read_path), (_, write_path) = paths
    rates, used_direct, cold = [], True, True
    try:
        for _ in range(reps):
            *_, is_direct = _timed_write(read_path, read_buf, threads, direct=True)
            cold &= drop_page_cache()
            read_fd, read_direct = _open(read_path, os.O_RDONLY, True)
            write_fd, write_direct = _open(write_path, os.O_WRONLY, True)
            try:
                os.posix_fallocate(write_fd, 0, write_n)
                os.fsync(write_fd)
                start = time.perf_counter()
                with ThreadPoolExecutor(2) as pool:
                    reading = pool.submit(_parallel_io, read_fd, read_buf, threads, False)
                    _parallel_io(write_fd, write_buf, threads, True)
                    os.fsync(write_fd)
                    reading.result()
                rates.append((read_n + write_n) / (time.perf_counter() - start) / 1e9)
            finally:
                os.close(read_fd)
                os.close(write_fd)
            used_direct &= is_direct and read_direct and write_direct
            os.truncate(write_path, 0)
    finally:
        for _, path in paths:
            Path(path).unlink(missing_ok=True)
    return {
        "gbps": statistics.median(rates),
        "read_share": read_n / (read_n + write_n),
        "direct": used_direct,
        "cold": cold,
    }
