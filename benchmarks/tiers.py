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

The disk also reads and writes at once, as a training step does (`--read-share`): each
share is measured as `benchmarks.bandwidth.mixed_disk_gbps` does, with the recommended
configuration's thread count, against the rate of the same bytes read, then written, at the
pure rates (above 1: the disk serves both at once; below 1: they contend). Its defaults are an
update phase's (each unit's state read and written back: half) and a stage-3 step's with
everything on nvme (parameters read in forward and in backward besides: two thirds, as
measured at 7.9B).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.bandwidth import mixed_disk_gbps
from benchmarks.report import Row, bar_chart, base_parser, print_table, save_json, setup_logging
from benchmarks.tier_measure import KINDS, Bandwidth, Measurements, StoreConfig, measure, store_configs
from engine.runtime.sizes import MIB
from offload.costs import STAGES
from offload.tuning import CHUNK_RANGE, CPU, FALLBACK, Measured, auto_settings, choose, label, profile_path, record

GOAL = 0.85
READ_SHARES = (0.5, 0.67)
"""The update phase's share of bytes read, and a stage-3 nvme step's (see the module's doc)."""


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


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, int, list[StoreConfig]]:
    """The arguments, the MiB moved per measurement, and the store configurations to measure;
    refuses sizes that do not fit the chunk sizes."""
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
    parser.add_argument(
        "--read-share",
        type=float,
        nargs="*",
        default=list(READ_SHARES),
        help="also measure reading and writing at once, this share of the bytes read (none: not)",
    )
    args = parser.parse_args(argv)
    if not all(0 < share < 1 for share in args.read_share):
        parser.error(f"--read-share takes shares between 0 and 1, got {args.read_share}")
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
    return args, mb, configs


def measure_in_folders(args: argparse.Namespace, mb: int, configs: list[StoreConfig]) -> tuple[Measurements, bool]:
    """The measurements, in temporary folders: one in ``--dir`` and one in each ``--stripe-dir``,
    the rest of ``--paths`` beside the first (the same disk); and whether all are on one disk."""
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
    return m, same_disk


def mixed_rows(args: argparse.Namespace, mb: int, m: Measurements, threads: int) -> list[Row]:
    """The disk reading and writing at once at each ``--read-share``, against the same bytes
    moved one kind after the other at the best pure rates."""
    rows: list[Row] = []
    for share in args.read_share:
        mixed = mixed_disk_gbps(args.dir, mb * MIB, share, threads, reps=args.reps)
        read = mixed["read_share"]
        apart = 1 / (read / m.best_raw["read"] + (1 - read) / m.best_raw["write"])
        rows.append(
            {
                "read share": read,
                "GB/s moved": mixed["gbps"],
                "one after the other GB/s": apart,
                "x": mixed["gbps"] / apart,
            }
        )
    return rows


def print_bandwidth(m: Measurements, rows: list[Row], chosen: StoreConfig, mb: int, reps: int) -> None:
    """The bandwidth table, against the goal, and the configuration recommended."""
    ratios = m.ratios(chosen)
    reads = "cold" if m.cold else "WARM (not root)"
    print_table(f"Tier bandwidth, {mb} MiB each, median of {reps} rounds; writes durable, reads {reads}", rows)
    print(
        f"\nGoal: store >= {GOAL} x raw for write and read (best raw: write {m.best_raw['write']:.2f} GB/s, "
        f"read {m.best_raw['read']:.2f} GB/s; the store checksums unless noted)."
    )
    met = all(r >= GOAL for r in ratios.values())
    print(
        f"Recommended store config {chosen.label}: write {ratios['write']:.2f} x raw, "
        f"read {ratios['read']:.2f} x raw: goal {'met' if met else 'NOT met'}."
    )


def print_costs(costs: list[Row], cut: dict[str, dict[str, float]]) -> None:
    """The CPU-seconds per GB of each stage, and what huge pages cut."""
    print()
    print_table("CPU-seconds per GB moved, by stage (thread CPU time of the I/O threads; median of rounds)", costs)
    for kind, c in cut.items():
        print(
            f"{StoreConfig(*FALLBACK).label} {kind}: {c['now']:.3f} CPU-s/GB against {c['before']:.3f} "
            f"in base pages ({c['ratio']:.2f}x)"
        )


def print_settings(auto: dict[str, Any], stripes: dict[str, Any] | None, recommended: dict[str, Any]) -> None:
    """What ``auto`` chooses, what striping gives, and the recommendation as a config snippet."""
    print(
        f"\nauto (the I/O profile, {auto['profile']}): {auto['chunk_mb']} MiB x {auto['io_threads']}"
        + (
            f": write {auto['write_ratio']:.2f} x raw, read {auto['read_ratio']:.2f} x raw"
            if "write_ratio" in auto
            else ""
        )
    )
    if stripes:
        print(
            f"\n{stripes['config']} against 1 path: write {stripes['write_ratio']:.2f} x, read "
            f"{stripes['read_ratio']:.2f} x"
            + (" (folders on one disk: no bandwidth to gain)" if stripes["same_disk"] else "")
        )
    print("\nIn this machine's config file:\n[offload]")
    print("\n".join(f"{key} = {str(value).lower()}" for key, value in recommended.items()))


def chart(out: Path, m: Measurements, rows: list[Row], mb: int) -> None:
    disk_rows = rows[1:]  # memcpy would flatten every disk bar: it goes in the title
    bar_chart(
        out / "tiers.png",
        [f"{r['tier']}\n{r['config']}" for r in disk_rows],
        {kind: [r[f"{kind} GB/s"] for r in disk_rows] for kind in KINDS},
        ylabel="GB/s",
        title=f"Disk tiers, {mb} MiB (host memcpy: {m.memcpy:.1f} GB/s)",
        references={f"{GOAL} x raw {kind}": GOAL * m.best_raw[kind] for kind in KINDS},
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, mb, configs = parse_args(argv)
    setup_logging(args.verbose)
    m, same_disk = measure_in_folders(args, mb, configs)
    rows = build_rows(m)
    chosen = recommend(m)
    ratios = m.ratios(chosen)
    recommended = {
        "chunk_mb": chosen.chunk_mb,
        "io_threads": chosen.io_threads,
        "direct_io": chosen.direct_io and m.direct,
    }
    print_bandwidth(m, rows, chosen, mb, args.reps)
    mixed = mixed_rows(args, mb, m, chosen.io_threads)
    if mixed:
        print()
        print_table(
            f"Reads and writes at once, {mb} MiB, {chosen.io_threads} threads each, median of {args.reps}", mixed
        )
    costs, cut = cost_rows(m), cost_cut(m)
    print_costs(costs, cut)
    auto = keep_profile(args.dir, m)
    stripes = striping(m, args.paths, same_disk)
    print_settings(auto, stripes, recommended)
    chart(args.out, m, rows, mb)
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
        "goal_met": all(r >= GOAL for r in ratios.values()),
        "recommended": recommended,
        "rows": rows,
        "mixed": mixed,
        "cpu_s_per_gb": costs,
        "cpu_cut": cut,
        "auto": auto,
        "stripes": stripes,
    }
    save_json(args.out, "tiers", result)
    return result


if __name__ == "__main__":
    main()
