"""I/O settings that tune themselves: a short probe of the disk, kept in a per-machine profile.

The best chunk size and thread count depend on the disk (a fast NVMe wants large chunks and
many requests in flight; a virtual disk is happy with fewer). The first run on a disk
measures it: a probe store of `PROBE_BYTES`, written durably and read back with checksums
on, for each of a few (chunk MiB, threads) candidates, beside the store's folder (in its
nearest existing parent on the same disk) and removed after. The measurements are kept in a profile,
`$XDG_CACHE_HOME/offload-engine/io_profile.json` (`~/.cache` by default), keyed by the
filesystem the store lives on; later runs read it and measure nothing, except a run that may
take larger chunks than any the profile holds (the first run's units were small): it measures
those candidates and adds them. `benchmarks.tiers`
writes its longer measurement there too. A profile that cannot be read is ignored, with a
warning, and measured again.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offload.buffers import BufferPool
from offload.io import IORunner
from offload.store import ShardStore

log = logging.getLogger(__name__)

MIB = 1 << 20
PROFILE_VERSION = 1
PROBE_BYTES = 256 * MIB
CANDIDATES: tuple[tuple[int, int], ...] = ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8))
"""(chunk MiB, I/O threads) the probe tries; `benchmarks.tiers` measures a larger grid."""
FALLBACK = (16, 4)
"""The settings where nothing was measured (no disk tier, or no candidate fits)."""
CHUNK_RANGE = (1, 64)
THREAD_RANGE = (1, 16)
"""What `auto` may choose: chunk MiB and thread counts are clamped into these."""
TIE = 0.05
"""Relative step cost below which two candidates count as equally fast (the disk's noise): what
a cheaper candidate may cost to be preferred, small enough that the choice stays within about
0.9 of the fastest candidate, and so of the raw disk (`python -m benchmarks.tiers`)."""
CPU = "cpu_s_per_gb"
"""A candidate's CPU-seconds per GB written plus per GB read (every thread of the process):
among equally fast candidates the one that leaves the most CPU to training. Larger chunks
make fewer files, system calls and tasks per byte: 64 MiB chunks cost 0.04-0.05 against
0.06-0.07 for 16 MiB here."""

Measured = dict[str, dict[str, float]]
"""GB/s by candidate label (`"16x4"`) and kind (`"write"`, `"read"`), and the candidate's
``CPU`` where it was measured."""


@dataclass(frozen=True)
class IOSettings:
    """The chunk size and thread count to run with, and a line saying where they came from."""

    chunk_mb: int
    io_threads: int
    why: str


def label(chunk_mb: int, threads: int) -> str:
    return f"{chunk_mb}x{threads}"


def parse_label(text: str) -> tuple[int, int]:
    chunk, threads = text.split("x")
    return int(chunk), int(threads)


def profile_path() -> Path:
    """Where the machine's I/O profile lives (XDG_CACHE_HOME respected)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "offload-engine" / "io_profile.json"


def existing_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is a directory, else its nearest existing parent."""
    here = Path(path).absolute()
    while not here.is_dir():
        here = here.parent
    return here


def disk_key(path: str | os.PathLike[str]) -> str:
    """The filesystem holding ``path`` (or where it would be created): source, type and device
    numbers from the mount table, or the device numbers alone where there is none."""
    dev = os.stat(existing_dir(path)).st_dev
    numbers = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields[2] == numbers and "-" in fields:
                    fstype, source = fields[fields.index("-") + 1 : fields.index("-") + 3]
                    return f"{source} {fstype} {numbers}"
    except (OSError, IndexError, ValueError):
        pass
    return f"dev {numbers}"


def load_profile() -> dict[str, Any]:
    """The profile's disks (key -> entry); empty, with a warning, if the file is unreadable."""
    path = profile_path()
    try:
        data = json.loads(path.read_text())
        disks = data["disks"]
        if data.get("version") != PROFILE_VERSION or not isinstance(disks, dict):
            raise ValueError(f"version {data.get('version')!r}, this code reads {PROFILE_VERSION}")
        for entry in disks.values():
            _check_measured(entry["measured"])
        return disks
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("ignoring the I/O profile %s, which cannot be read (%s): the disk is measured again", path, err)
        return {}


def _check_measured(measured: Any) -> None:
    for name, bandwidth in measured.items():
        parse_label(name)
        if not all(float(bandwidth[kind]) > 0 for kind in ("write", "read")):
            raise ValueError(f"candidate {name}: bandwidth must be positive")
        if float(bandwidth.get(CPU, 0.0)) < 0:
            raise ValueError(f"candidate {name}: {CPU} must not be negative")


def record(path: str | os.PathLike[str], measured: Measured, source: str) -> None:
    """Keep ``measured`` as the profile of the disk holding ``path`` (atomically replaced)."""
    disks = load_profile()
    disks[disk_key(path)] = {
        "measured": measured,
        "source": source,
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "path": str(existing_dir(path)),
    }
    target = profile_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".io_profile-", dir=target.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"version": PROFILE_VERSION, "disks": disks}, f, indent=1)
    os.replace(tmp, target)


def choose(measured: Measured, max_chunk_mb: int = CHUNK_RANGE[1]) -> tuple[int, int] | None:
    """The candidate to run: the fastest for a step (which reads and writes alike, so pays
    1/write + 1/read per byte), or, within `TIE` of it, the one with the least CPU per byte
    (where every such candidate's was measured; a profile written before it was is read as
    it was chosen then), then a smaller chunk, then fewer threads. None if no candidate's
    chunk is within ``max_chunk_mb``."""
    cost = {
        parse_label(name): 1 / bw["write"] + 1 / bw["read"]
        for name, bw in measured.items()
        if parse_label(name)[0] <= max_chunk_mb
    }
    if not cost:
        return None
    fastest = min(cost.values())
    tied = [c for c in cost if cost[c] <= fastest * (1 + TIE)]
    cpu = {c: measured[label(*c)].get(CPU) for c in tied}
    if all(value is not None for value in cpu.values()):
        chunk, threads = min(tied, key=lambda c: (cpu[c], c))
    else:
        chunk, threads = min(tied)
    return _clamp(chunk, *CHUNK_RANGE), _clamp(threads, *THREAD_RANGE)


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def probe(
    path: str | os.PathLike[str],
    candidates: Sequence[tuple[int, int]] = CANDIDATES,
    nbytes: int = PROBE_BYTES,
    direct_io: bool = True,
) -> Measured:
    """Durable write and uncached read GB/s of a checksummed probe store beside ``path`` for
    each candidate; the probe's files are removed, whatever happens. Each candidate's go before
    the next is written, so the probe never holds more than ``nbytes`` of the disk (a run's
    disk plan counts it once, and a nearly full disk is not filled by the candidates' count)."""
    pool = BufferPool(nbytes)
    measured: Measured = {}
    with pool.acquire(nbytes) as buf:
        data = buf.view(torch.float32, nbytes // 4)
        data.uniform_()  # also the first touch, outside the timing
        work = Path(tempfile.mkdtemp(prefix=".io-probe-", dir=_probe_dir(path)))
        try:
            for chunk_mb, threads in candidates:
                root = work / label(chunk_mb, threads)
                measured[root.name] = _probe_one(root, data, chunk_mb, threads, direct_io)
                shutil.rmtree(root)
            return measured
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _probe_dir(path: str | os.PathLike[str]) -> Path:
    """Beside the store (not inside it, where a store's own checks would meet a crashed
    probe's leftovers), unless only the store's own folder is on its disk."""
    inside = existing_dir(path)
    beside = existing_dir(Path(path).absolute().parent)
    return beside if os.stat(beside).st_dev == os.stat(inside).st_dev else inside


def _probe_one(root: Path, data: torch.Tensor, chunk_mb: int, threads: int, direct_io: bool) -> dict[str, float]:
    nbytes = data.numel() * 4
    with IORunner(threads=threads) as runner:
        store = ShardStore.create(root, {}, runner=runner, checksum=True, direct_io=direct_io)
        store.create_array("probe", data.numel(), min(chunk_mb * MIB, nbytes) // 4, torch.float32)
        store.sync()
        cpu, start = time.process_time(), time.perf_counter()
        store.write_async("probe", 0, data)
        store.sync()
        write = time.perf_counter() - start
        _evict(root / "probe" / "c")  # an uncached read, without dropping the whole page cache
        start = time.perf_counter()
        store.read_async("probe", 0, data).result()
        read = time.perf_counter() - start
        cpu = time.process_time() - cpu
    return {"write": nbytes / write / 1e9, "read": nbytes / read / 1e9, CPU: cpu / (nbytes / 1e9)}


def _evict(folder: Path) -> None:
    for entry in folder.iterdir():
        fd = os.open(entry, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def auto_settings(
    path: str | os.PathLike[str],
    *,
    max_chunk_mb: int = CHUNK_RANGE[1],
    measure: bool = True,
    direct_io: bool = True,
) -> IOSettings:
    """The settings for a store at ``path``: from the profile of its disk, or measured now
    (and recorded) if there is none and ``measure``; the fallback otherwise."""
    key = disk_key(path)
    entry: Mapping[str, Any] | None = load_profile().get(key)
    missing = unmeasured(entry, max_chunk_mb) if measure else []
    if missing:
        entry = _measure(path, key, missing, direct_io, entry)
    fallback = (min(FALLBACK[0], max_chunk_mb), FALLBACK[1])
    if entry is None:
        return IOSettings(*fallback, f"defaults: disk {key} not measured yet (the first training run measures it)")
    chosen = choose(entry["measured"], max_chunk_mb)
    if chosen is None:
        return IOSettings(*fallback, f"defaults: no measured candidate of disk {key} fits chunks <= {max_chunk_mb} MiB")
    bw = entry["measured"].get(label(*chosen), {})
    speeds = f" (write {bw['write']:.2f}, read {bw['read']:.2f} GB/s)" if bw else ""
    why = f"auto: fastest measured on disk {key}{speeds}, by {entry['source']} at {entry['when']}"
    return IOSettings(chosen[0], chosen[1], why)


def unmeasured(entry: Mapping[str, Any] | None, max_chunk_mb: int) -> list[tuple[int, int]]:
    """The candidates within ``max_chunk_mb`` that a run should measure before choosing: all of
    them for a disk with no profile, else those of larger chunks than any the profile holds. A
    profile measured by a run of small units, which could take only small chunks, then does not
    bind a later run of large ones to them; it is completed instead."""
    fitting = [c for c in CANDIDATES if c[0] <= max_chunk_mb] or [(max_chunk_mb, FALLBACK[1])]
    if entry is None:
        return fitting
    largest = max((parse_label(name)[0] for name in entry["measured"]), default=0)
    return [c for c in fitting if c[0] > largest]


def _measure(
    path: str | os.PathLike[str],
    key: str,
    candidates: Sequence[tuple[int, int]],
    direct_io: bool,
    known: Mapping[str, Any] | None,
) -> Mapping[str, Any] | None:
    """Probe the disk for ``candidates``, which ``known`` (its profile, if any) lacks, and record
    them beside it; ``known`` as it was, with a warning, if the probe cannot run there."""
    start = time.perf_counter()
    try:
        measured = probe(path, candidates, direct_io=direct_io)
    except OSError as err:
        then = "choosing among the candidates its profile holds" if known else "using the default I/O settings"
        log.warning("could not measure disk %s under %s (%s): %s", key, path, err, then)
        return known
    log.info("measured disk %s in %.1f s: %s", key, time.perf_counter() - start, _describe(measured))
    measured = {**(known["measured"] if known else {}), **measured}
    try:
        record(path, measured, "probe")
    except OSError as err:
        log.warning("could not keep the I/O profile in %s (%s): the next run measures again", profile_path(), err)
    return {"measured": measured, "source": "probe", "when": "this run"}


def _describe(measured: Measured) -> str:
    return ", ".join(f"{name} w {bw['write']:.2f} r {bw['read']:.2f} GB/s" for name, bw in measured.items())
