"""Bandwidth of each tier, and how close the shard store comes to the raw disk.

    python -m benchmarks.tiers [--quick] [--dir PATH] [--out PATH] [--unit-mb N] [--paths N] [--stripe-dir PATH...]

Measures, on the same page-aligned memory: host memcpy; raw positional file
I/O (the disk's limit as seen from Python, see `benchmarks.bandwidth`); and
`ShardStore` at several chunk sizes and I/O thread counts. Writes are durable
(the store's `sync()` fsyncs every chunk file and directory), reads are cold
(page cache dropped first, which needs root). The goal is store >= 0.85 x raw
for both; the store configuration to use is printed as an `[offload]` snippet.

Beside the bandwidth, the CPU-seconds per GB of each stage of the store's path
(`offload.costs`), and the default configuration's, process-wide, against the same
configuration moving base-page buffers (the path before the pool used huge pages).

The machine is noisy, so the measurements run in rounds, each visiting every
configuration once, and each configuration reports its median: a slow minute
then hurts all configurations alike instead of one, and the ratios hold.

With `--unit-mb N`, each store configuration also moves one unit of N MiB of optimizer state
as the `nvme` tier does: written back through a `Pipeline` and made durable, then read ahead
(one compound task each, whose chunks run on every I/O thread at once).

With `--paths N` (default 2), the default configuration is also measured with its store
striped across N folders (`offload.nvme_path` a list): the first in `--dir`, the others in
the `--stripe-dir` folders (other drives), or beside the first on the same disk, where
striping adds no bandwidth and the ratio only shows what it costs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.bandwidth import drop_page_cache, memcpy_gbps, raw_disk_gbps
from benchmarks.report import Row, bar_chart, base_parser, print_table, save_json, setup_logging
from engine.runtime.sizes import MIB
from offload import BufferPool, HostBuffer, IORunner, Pipeline, ShardStore, create_arrays, read_shard, write_shard
from offload.costs import STAGES, per_gb
from offload.tuning import CHUNK_RANGE, CPU, FALLBACK, Measured, auto_settings, choose, label, profile_path, record

GOAL = 0.85
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


def profile_grid(m: Measurements) -> Measured:
    """The checksummed O_DIRECT grid as `offload.tuning` keeps it: GB/s by kind, and CPU-seconds
    per GB written plus per GB read (every thread of the process)."""
    return {
        label(c.chunk_mb, c.io_threads): dict(bw) | {CPU: sum(m.costs[c][kind]["process"] for kind in KINDS)}
        for c, bw in m.store.items()
        if c.checksum and c.direct_io and c.huge_pages and c.paths == 1
    }


def recommend(m: Measurements) -> StoreConfig:
    """The configuration `auto` runs given these measurements (`offload.tuning.choose`): the
    fastest for a step, or among those as fast within the noise the one costing least CPU per
    byte."""
    chosen = choose(profile_grid(m))
    assert chosen is not None, "parse_args keeps every chunk size within auto's range"
    return StoreConfig(*chosen)


def build_rows(m: Measurements) -> list[Row]:
    """One row per tier and configuration; store rows carry their ratios to the best raw."""

    def row(tier: str, config: str, bw: Bandwidth) -> Row:
        return {"tier": tier, "config": config, **{f"{kind} GB/s": bw[kind] for kind in KINDS}}

    raw_name = "raw O_DIRECT" if m.direct else "raw buffered"
    return [
        row("host memcpy", "1 thread", {kind: m.memcpy for kind in KINDS}),
        *(row(raw_name, f"{t} threads", bw) for t, bw in m.raw.items()),
        *(
            row("store", c.label, bw) | {f"{kind}/raw": r for kind, r in m.ratios(c).items()}
            for c, bw in m.store.items()
        ),
        *(
            row("store, one unit", c.label, bw) | {f"{kind}/raw": r for kind, r in m.ratios(c, bw).items()}
            for c, bw in m.unit.items()
        ),
    ]


def keep_profile(directory: Path, m: Measurements) -> dict[str, Any]:
    """Record the checksummed O_DIRECT grid as the machine's I/O profile of this disk (what
    `offload.chunk_mb = "auto"` reads), and what `auto` now chooses from it, with its ratios."""
    record(directory, profile_grid(m), "benchmarks.tiers")
    auto = auto_settings(directory, measure=False)
    config = StoreConfig(auto.chunk_mb, auto.io_threads)
    ratios = m.ratios(config) if config in m.store else {}
    return {
        "chunk_mb": auto.chunk_mb,
        "io_threads": auto.io_threads,
        "why": auto.why,
        "profile": str(profile_path()),
    } | {f"{kind}_ratio": r for kind, r in ratios.items()}


def cost_rows(m: Measurements) -> list[Row]:
    """CPU-seconds per GB moved, per stage of the path, for each store configuration and kind;
    `stages` is their sum (the I/O threads' CPU), `process` every thread of the process."""
    rows: list[Row] = [
        {"config": f"raw, {t} threads", "kind": kind, "process": cpu[kind]}
        for t, cpu in m.raw_cpu.items()
        for kind in KINDS
    ]
    for config, by_kind in m.costs.items():
        for kind in KINDS:
            costs = by_kind[kind]
            stages = {stage: costs.get(stage, 0.0) for stage in STAGES}
            rows.append(
                {"config": config.label, "kind": kind, **stages, "stages": costs.get("total", 0.0)}
                | {"process": costs["process"]}
            )
    return rows


def cost_cut(m: Measurements) -> dict[str, dict[str, float]]:
    """The default configuration's CPU-seconds per GB, process-wide, in base pages (the path
    before huge pages) and as the engine runs it, by kind, and the second over the first."""
    default = StoreConfig(*FALLBACK)
    before, now = m.costs[replace(default, huge_pages=False)], m.costs[default]
    return {
        kind: {"before": before[kind]["process"], "now": now[kind]["process"]}
        | {"ratio": now[kind]["process"] / before[kind]["process"]}
        for kind in KINDS
    }


def striping(m: Measurements, paths: int, same_disk: bool) -> dict[str, Any] | None:
    """The default configuration striped across ``paths`` folders against one folder: GB/s of
    each and their ratios (None where not measured)."""
    if paths < 2:
        return None
    one = StoreConfig(*FALLBACK)
    many = replace(one, paths=paths)
    return {
        "config": many.label,
        "paths": paths,
        "same_disk": same_disk,
        "one_path": m.store[one],
        "striped": m.store[many],
        **{f"{kind}_ratio": m.store[many][kind] / m.store[one][kind] for kind in KINDS},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("."), help="directory on the disk to measure (default .)")
    parser.add_argument("--mb", type=int, help="MiB moved per measurement (default 1024, --quick 64)")
    parser.add_argument("--chunk-mb", type=int, nargs="+", default=[4, 16, 64], help="store chunk sizes, MiB")
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8], help="I/O thread counts")
    parser.add_argument("--reps", type=int, default=3, help="rounds; each configuration reports its median")
    parser.add_argument(
        "--unit-mb", type=int, default=0, help="also move one unit of this many MiB as the nvme tier does"
    )
    parser.add_argument(
        "--paths", type=int, default=2, help="also stripe the default configuration across this many folders (1: not)"
    )
    parser.add_argument(
        "--stripe-dir", type=Path, nargs="+", default=[], help="the other folders' directories (other drives)"
    )
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    mb = args.mb or (64 if args.quick else 1024)
    if args.paths < 1 or len(args.stripe_dir) > args.paths - 1:
        parser.error(f"--paths {args.paths} takes at most {max(args.paths - 1, 0)} --stripe-dir folder(s)")
    if not all(CHUNK_RANGE[0] <= c <= CHUNK_RANGE[1] for c in args.chunk_mb):
        parser.error(f"--chunk-mb takes sizes from {CHUNK_RANGE[0]} to {CHUNK_RANGE[1]} MiB, those auto may choose")
    configs = store_configs(args.chunk_mb, args.threads, args.paths)
    if any(mb % c.chunk_mb for c in configs):
        parser.error(f"--mb {mb} must be a multiple of every chunk size: {sorted({c.chunk_mb for c in configs})}")
    if any(args.unit_mb % (3 * c.chunk_mb) for c in configs):
        parser.error(
            f"--unit-mb {args.unit_mb} must be a multiple of 3 x every chunk size (three arrays of whole chunks)"
        )

    args.dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        dirs = [
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-tiers-", dir=d)))
            for d in [args.dir, *args.stripe_dir]
        ]
        dirs += [dirs[0] / f"path-{i}" for i in range(len(dirs), args.paths)]  # beside the first: the same disk
        for folder in dirs:
            folder.mkdir(exist_ok=True)
        m = measure(dirs, mb * MIB, configs, args.threads, args.reps, args.unit_mb * MIB)
        same_disk = len({os.stat(d).st_dev for d in dirs}) == 1
    rows = build_rows(m)
    chosen = recommend(m)
    ratios = m.ratios(chosen)
    met = all(r >= GOAL for r in ratios.values())
    recommended = {
        "chunk_mb": chosen.chunk_mb,
        "io_threads": chosen.io_threads,
        "direct_io": chosen.direct_io and m.direct,
    }

    reads = "cold" if m.cold else "WARM (not root)"
    print_table(f"Tier bandwidth, {mb} MiB each, median of {args.reps} rounds; writes durable, reads {reads}", rows)
    print(
        f"\nGoal: store >= {GOAL} x raw for write and read (best raw: write {m.best_raw['write']:.2f} GB/s, "
        f"read {m.best_raw['read']:.2f} GB/s; the store checksums unless noted)."
    )
    print(
        f"Recommended store config {chosen.label}: write {ratios['write']:.2f} x raw, "
        f"read {ratios['read']:.2f} x raw: goal {'met' if met else 'NOT met'}."
    )
    costs = cost_rows(m)
    print()
    print_table("CPU-seconds per GB moved, by stage (thread CPU time of the I/O threads; median of rounds)", costs)
    cut = cost_cut(m)
    for kind, c in cut.items():
        print(
            f"{StoreConfig(*FALLBACK).label} {kind}: {c['now']:.3f} CPU-s/GB against {c['before']:.3f} "
            f"in base pages ({c['ratio']:.2f}x)"
        )
    auto = keep_profile(args.dir, m)
    print(
        f"\nauto (the I/O profile, {auto['profile']}): {auto['chunk_mb']} MiB x {auto['io_threads']}"
        + (
            f": write {auto['write_ratio']:.2f} x raw, read {auto['read_ratio']:.2f} x raw"
            if "write_ratio" in auto
            else ""
        )
    )
    stripes = striping(m, args.paths, same_disk)
    if stripes:
        print(
            f"\n{stripes['config']} against 1 path: write {stripes['write_ratio']:.2f} x, read "
            f"{stripes['read_ratio']:.2f} x" + (" (folders on one disk: no bandwidth to gain)" if same_disk else "")
        )
    print("\nIn this machine's config file:\n[offload]")
    print("\n".join(f"{key} = {str(value).lower()}" for key, value in recommended.items()))

    disk_rows = rows[1:]  # memcpy would flatten every disk bar: it goes in the title
    bar_chart(
        args.out / "tiers.png",
        [f"{r['tier']}\n{r['config']}" for r in disk_rows],
        {kind: [r[f"{kind} GB/s"] for r in disk_rows] for kind in KINDS},
        ylabel="GB/s",
        title=f"Disk tiers, {mb} MiB (host memcpy: {m.memcpy:.1f} GB/s)",
        references={f"{GOAL} x raw {kind}": GOAL * m.best_raw[kind] for kind in KINDS},
    )
    result = {
        "bytes": mb * MIB,
        "reps": args.reps,
        "directory": str(args.dir.resolve()),
        "direct": m.direct,
        "cold": m.cold,
        "memcpy_gbps": m.memcpy,
        "best_raw_gbps": m.best_raw,
        "goal": GOAL,
        "recommended_measured": {
            "config": chosen.label,
            **m.store[chosen],
            **{f"{k}_ratio": v for k, v in ratios.items()},
        },
        "goal_met": met,
        "recommended": recommended,
        "rows": rows,
        "cpu_s_per_gb": costs,
        "cpu_cut": cut,
        "auto": auto,
        "stripes": stripes,
    }
    save_json(args.out, "tiers", result)
    return result


if __name__ == "__main__":
    main()
