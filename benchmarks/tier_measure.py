"""How ``benchmarks.tiers`` measures: raw positional I/O and the shard store, in interleaved
rounds, each configuration's median kept; with the CPU-seconds per GB of each stage of the
store's path. The report and the recommendation are ``benchmarks.tiers``'.
"""

from __future__ import annotations

import functools
import resource
import shutil
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.bandwidth import drop_page_cache, memcpy_gbps, raw_disk_gbps
from engine.runtime.sizes import MIB
from offload import BufferPool, HostBuffer, IORunner, Pipeline, ShardStore, create_arrays, read_shard, write_shard
from offload.costs import per_gb
from offload.tuning import FALLBACK

KINDS = ("write", "read")

Bandwidth = dict[str, float]
"""GB/s by kind: {"write": ..., "read": ...}."""


@dataclass(frozen=True)
class StoreConfig:
    """One way of running the store; the first three fields are the `[offload]` settings."""

    chunk_mb: int
    io_threads: int
    direct_io: bool = True
    checksum: bool = True
    huge_pages: bool = True
    """Whether the buffers moved are in huge pages, as the engine's are (`offload.BufferPool`)."""
    paths: int = 1
    """Folders the store is striped across (``offload.stripes``)."""

    @property
    def label(self) -> str:
        extra = ("" if self.direct_io else ", buffered") + ("" if self.checksum else ", no crc")
        pages = "" if self.huge_pages else ", base pages"
        return f"{self.chunk_mb} MiB x {self.io_threads}{extra}{pages}" + (
            f", {self.paths} paths" if self.paths > 1 else ""
        )


def process_cpu() -> float:
    """CPU seconds (user + system) this process has used so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _stage_costs(store: ShardStore, cpu_start: float, nbytes: int) -> dict[str, float]:
    """CPU-seconds per GB of each stage since the store's account was last taken, and the
    whole process's (`process`: every thread, the waiting training thread's Python too)."""
    costs = per_gb(store.costs.take())
    costs["process"] = (process_cpu() - cpu_start) / (nbytes / 1e9)
    return costs


def new_store(dirs: list[Path], name: str, runner: IORunner, config: StoreConfig) -> ShardStore:
    """A fresh store ``name`` in the first of ``dirs`` (one folder a drive), striped across as
    many of them as ``config`` says."""
    stripes = [d / name for d in dirs[1 : config.paths]]
    return ShardStore.create(
        dirs[0] / name, {}, runner=runner, checksum=config.checksum, direct_io=config.direct_io, stripes=stripes
    )


def remove_store(store: ShardStore) -> None:
    for folder in store.paths:
        shutil.rmtree(folder)


def store_gbps(dirs: list[Path], src: torch.Tensor, dst: torch.Tensor, config: StoreConfig) -> dict[str, Any]:
    """One durable write of `src` into a fresh store and one cold read back into `dst`: GB/s of
    each, and under `costs` the CPU-seconds per GB of each stage of each (`offload.costs`).

    A fresh store each time: a step writes a whole new generation, so chunk
    files are created, not overwritten in place.
    """
    nbytes = src.numel() * src.element_size()
    with IORunner(threads=config.io_threads) as runner:
        store = new_store(dirs, "store", runner, config)
        try:
            store.create_array("bench", src.numel(), config.chunk_mb * MIB // src.element_size(), src.dtype)
            store.sync()  # metadata out of the way: time only the data
            store.costs.take()
            cpu, start = process_cpu(), time.perf_counter()
            store.write_async("bench", 0, src)
            store.sync()
            write = nbytes / (time.perf_counter() - start) / 1e9
            write_costs = _stage_costs(store, cpu, nbytes)
            drop_page_cache()
            cpu, start = process_cpu(), time.perf_counter()
            store.read_async("bench", 0, dst).result()
            read = nbytes / (time.perf_counter() - start) / 1e9
            read_costs = _stage_costs(store, cpu, nbytes)
        finally:
            remove_store(store)
    return {"write": write, "read": read, "costs": {"write": write_costs, "read": read_costs}}


def unit_gbps(dirs: list[Path], nbytes: int, config: StoreConfig) -> dict[str, float]:
    """One unit of `nbytes` (three fp32 arrays, as an optimizer unit's master and moments) moved
    as the `nvme` optimizer tier moves it: written back through a `Pipeline` and synced, then
    read ahead. GB/s of each; reads cold as `store_gbps`'s."""
    numel = nbytes // 4 // 3
    chunk = config.chunk_mb * MIB // 4
    kinds = [(kind, k * numel * 4) for k, kind in enumerate(("master", "exp_avg", "exp_avg_sq"))]
    pool = BufferPool(nbytes, huge_pages=config.huge_pages)

    def move(write: bool, _item: str, buf: HostBuffer) -> None:
        views = [(kind, buf.view(torch.float32, numel, offset)) for kind, offset in kinds]
        (write_shard if write else read_shard)(store, "", unit, 0, views)

    with IORunner(threads=config.io_threads) as runner:
        store = new_store(dirs, "unit", runner, config)
        unit = _Unit("unit", numel, chunk)
        create_arrays(store, "", [unit], [kind for kind, _ in kinds], torch.float32)
        store.sync()
        pipeline: Pipeline[str] = Pipeline(pool, runner, window_bytes=nbytes)
        buf = pool.acquire(nbytes)
        buf.view(torch.float32, 3 * numel).uniform_()  # also the first touch, outside any timing
        try:
            start = time.perf_counter()
            pipeline.write_back("unit", buf, functools.partial(move, True))
            pipeline.drain()
            store.sync()
            write = nbytes / (time.perf_counter() - start) / 1e9
            drop_page_cache()
            start = time.perf_counter()
            for _, loaded in pipeline.read_ahead(
                ["unit"], nbytes=lambda _: nbytes, load=functools.partial(move, False)
            ):
                pipeline.release(loaded)
            read = nbytes / (time.perf_counter() - start) / 1e9
        finally:
            remove_store(store)
    return {"write": write, "read": read}


@dataclass(frozen=True)
class _Unit:
    """A one-rank unit of whole chunks (`offload.ShardedUnit`)."""

    name: str
    numel: int
    chunk_numel: int

    @property
    def padded_numel(self) -> int:
        return self.numel

    @property
    def shard_numel(self) -> int:
        return self.numel

    def shard_slice(self, rank: int) -> slice:
        return slice(0, self.numel)


def store_configs(chunk_mbs: list[int], threads: list[int], paths: int = 1) -> list[StoreConfig]:
    """The grid (with the engine's default configuration), then the default without O_DIRECT,
    without checksums, in base pages, and striped across ``paths`` folders (if more than one).

    The extra rows show what each of those costs or gives. The buffered one is a candidate for
    the recommendation, so the advice on `direct_io` is measured; the others are not (checksums
    are a safety choice, not a speed one; base pages are the path before huge pages, kept to
    compare against in the same run; the number of drives is the machine's, not a setting to
    tune).
    """
    grid = [StoreConfig(c, t) for c in chunk_mbs for t in threads]
    default = StoreConfig(*FALLBACK)
    extra = [replace(default, direct_io=False), replace(default, checksum=False), replace(default, huge_pages=False)]
    striped = [replace(default, paths=paths)] if paths > 1 else []
    return [*grid, *([] if default in grid else [default]), *extra, *striped]


def _medians(results: list[Mapping[str, Any]]) -> Bandwidth:
    return {kind: statistics.median(r[kind] for r in results) for kind in KINDS}


def _median_costs(results: list[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind, the median CPU-seconds per GB of each stage over the rounds."""
    return {
        kind: {
            stage: statistics.median(r["costs"][kind][stage] for r in results) for stage in results[0]["costs"][kind]
        }
        for kind in KINDS
    }


@dataclass
class Measurements:
    """Median bandwidths of one run, and whether the disk allowed O_DIRECT and cold reads."""

    memcpy: float
    raw: dict[int, Bandwidth]
    store: dict[StoreConfig, Bandwidth]
    direct: bool
    cold: bool
    costs: dict[StoreConfig, dict[str, dict[str, float]]] = field(default_factory=dict)
    """Per store configuration and kind, median CPU-seconds per GB of each stage."""
    raw_cpu: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per raw thread count and kind, the process's CPU-seconds per GB moved."""
    unit: dict[StoreConfig, Bandwidth] = field(default_factory=dict)
    """Per store configuration, median GB/s of one unit moved as the nvme tier does (`--unit-mb`)."""

    @property
    def best_raw(self) -> Bandwidth:
        """The yardstick: the best raw write and the best raw read, at whatever thread count."""
        return {kind: max(r[kind] for r in self.raw.values()) for kind in KINDS}

    def ratios(self, config: StoreConfig, bandwidth: Bandwidth | None = None) -> Bandwidth:
        """`bandwidth` (by default the store's in `config`) over the best raw, by kind."""
        bw = self.store[config] if bandwidth is None else bandwidth
        return {kind: bw[kind] / self.best_raw[kind] for kind in KINDS}


def measure(
    dirs: list[Path], nbytes: int, configs: list[StoreConfig], threads: list[int], reps: int, unit_bytes: int = 0
) -> Measurements:
    """Raw I/O at each thread count (in the first of ``dirs``) and the store in each configuration
    (striped across as many of ``dirs`` as it says), in `reps` interleaved rounds; with
    `unit_bytes`, one unit of that size moved as the nvme tier does, too."""
    work = dirs[0]
    buffers = {huge: _buffer_pair(nbytes, huge) for huge in {c.huge_pages for c in configs} | {True}}
    src = buffers[True][0]
    raw: dict[int, list[dict[str, Any]]] = {t: [] for t in threads}
    store: dict[StoreConfig, list[dict[str, Any]]] = {c: [] for c in configs}
    unit: dict[StoreConfig, list[dict[str, Any]]] = {c: [] for c in configs if unit_bytes}
    with tqdm(total=reps * (len(raw) + len(store)), desc="tiers", unit="run") as bar:
        for _ in range(reps):
            for t, results in raw.items():
                results.append(raw_disk_gbps(work, nbytes, t, reps=1, buffer=src.view(torch.uint8)))
                bar.update()
            for config, results in store.items():
                results.append(store_gbps(dirs, *buffers[config.huge_pages], config))
                if unit_bytes:
                    unit[config].append(unit_gbps(dirs, unit_bytes, config))
                bar.update()
    runs = [r for results in raw.values() for r in results]
    return Measurements(
        memcpy=memcpy_gbps(nbytes),
        raw={t: _medians(results) for t, results in raw.items()},
        store={c: _medians(results) for c, results in store.items()},
        direct=all(r["direct"] for r in runs),
        cold=all(r["cold"] for r in runs),
        costs={c: _median_costs(results) for c, results in store.items()},
        raw_cpu={
            t: {kind: statistics.median(r["cpu_s_per_gb"][kind] for r in results) for kind in KINDS}
            for t, results in raw.items()
        },
        unit={c: _medians(results) for c, results in unit.items()},
    )


def _buffer_pair(nbytes: int, huge_pages: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A source of random fp32 and a destination, each of `nbytes`, first touched."""
    pool = BufferPool(2 * nbytes, huge_pages=huge_pages)
    src = pool.acquire(nbytes).view(torch.float32, nbytes // 4)
    dst = pool.acquire(nbytes).view(torch.float32, nbytes // 4)
    src.uniform_()  # also the first touch of both buffers, outside any timing
    dst.zero_()
    return src, dst
