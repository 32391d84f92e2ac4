"""The store's CRC-32C against the memory it reads: in cache and from memory, on one thread and on
the store's I/O threads at once, beside the `crc32c` package where it is installed (the `bench`
extra) and a plain copy of the same bytes.

    python -m benchmarks.checksum [--quick] [--mb N] [--piece-kb K] [--threads T ...] [--reps R]

Every store chunk is checksummed when it is written and when it is read, by the I/O thread that
moves it (`offload.chunks.crc32c_of`): a step of a 10B model moves 162 GB. The bytes come from
memory there (a chunk is larger than any cache, and O_DIRECT moves it without the CPU), so what
a checksum costs is set by the memory's speed as much as by the instructions; in cache it shows
what the instructions alone reach, the speed a checksum taken where the bytes already are in
cache (fused into the pass that makes or uses them) could have. GB/s is bytes checksummed per
second, all threads together; `x copy` divides it by the bytes a plain copy moves per second
on one thread in the same run (`benchmarks.bandwidth.memcpy_gbps`).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bandwidth import interleaved_medians, memcpy_gbps, page_aligned
from benchmarks.report import Row, base_parser, print_table, save_json, setup_logging
from offload.chunks import crc32c_of

Checksum = Callable[[np.ndarray], int]
CRC_FLAGS = ("sse4_2", "pclmulqdq", "avx512f", "vpclmulqdq")
"""The CPU features a CRC-32C can use: the crc32 instruction, and carry-less multiplies to fold with."""


def checksums() -> dict[str, Checksum]:
    """The store's checksum, and the `crc32c` package's where it is installed."""
    found: dict[str, Checksum] = {"store (fastcrc)": crc32c_of}
    try:
        import crc32c
    except ImportError:
        return found
    found[f"crc32c {crc32c.__version__}"] = lambda buf: crc32c.crc32c(buf.data)
    return found


def cpu_model() -> str:
    """The CPU's model name and which of ``CRC_FLAGS`` it has."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return f"{name} ({' '.join(f for f in CRC_FLAGS if f in flags) or 'no CRC features'})"


def pieces_of(buf: np.ndarray, piece: int) -> list[np.ndarray]:
    return [buf[i : i + piece] for i in range(0, len(buf), piece)]


def rate(checksum: Checksum, buffers: list[list[np.ndarray]], reps: int) -> float:
    """GB/s of ``checksum`` over every piece, each thread taking its own list of pieces."""
    nbytes = sum(p.nbytes for pieces in buffers for p in pieces)

    def one(pieces: list[np.ndarray]) -> None:
        for piece in pieces:
            checksum(piece)

    with ThreadPoolExecutor(len(buffers)) as pool:
        seconds = interleaved_medians({0: lambda: list(pool.map(one, buffers))}, reps)[0]
    return nbytes / seconds / 1e9


def workloads(mb: int, piece_kb: int, threads: int) -> dict[str, list[list[np.ndarray]]]:
    """Per thread: ``mb`` MiB from memory in pieces of a chunk's size, or the same bytes as one
    ``piece_kb`` KiB piece checksummed again and again (in cache)."""
    data = np.random.default_rng(0).integers(0, 256, mb << 20, dtype=np.uint8)
    per_thread = [page_aligned(mb << 20).numpy() for _ in range(threads)]
    for buf in per_thread:
        buf[:] = data
    piece = piece_kb << 10
    cached = [[buf[:piece]] * (buf.size // piece) for buf in per_thread]
    return {"from memory": [pieces_of(buf, 16 << 20) for buf in per_thread], "in cache": cached}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, help="MiB checksummed per thread and round (default 1024, --quick 32)")
    parser.add_argument("--piece-kb", type=int, default=256, help="the in-cache piece, KiB (default 256)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4], help="threads at once (default 1 2 4)")
    parser.add_argument("--reps", type=int, help="timed rounds (default 5, --quick 1)")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    mb = args.mb or (32 if args.quick else 1024)
    reps = args.reps or (1 if args.quick else 5)
    copy = memcpy_gbps(mb << 20, reps)
    rows: list[Row] = []
    for threads in args.threads:
        for where, buffers in workloads(mb, args.piece_kb, threads).items():
            for name, checksum in checksums().items():
                gbps = rate(checksum, buffers, reps)
                rows.append({"checksum": name, "data": where, "threads": threads, "GB/s": gbps, "x copy": gbps / copy})
    cpu = cpu_model()
    print_table(f"CRC-32C on {cpu} (a copy moves {copy:.1f} GB/s)", rows)
    payload = {"cpu_model": cpu, "copy_gbps": copy, "mb": mb, "piece_kb": args.piece_kb, "rows": rows}
    save_json(args.out, "checksum", payload)
    return payload


if __name__ == "__main__":
    main()
