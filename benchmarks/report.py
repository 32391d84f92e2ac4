"""Output shared by every benchmark: a readable table, a JSON record, an optional plot.

A result is only comparable with the machine and the command that produced it,
so every JSON file carries both. matplotlib is optional (the `bench` extra):
without it the plot is skipped and everything else still happens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import zarr

log = logging.getLogger(__name__)

Row = dict[str, Any]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark shares."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run in seconds")
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"directory for the JSON and PNG (default {DEFAULT_OUT})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _format_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value == 0 or not math.isfinite(value):
        return str(value)
    # Three significant digits without an exponent: 1.38, 0.853, 589, 1234.
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as aligned text: one column per key (in order of first appearance), numbers right-aligned."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_format_value(row.get(col, "")) for col in columns] for row in rows]
    widths = [max(len(col), *(len(line[i]) for line in cells)) for i, col in enumerate(columns)]
    numeric = [all(isinstance(row.get(col), (int, float)) for row in rows) for col in columns]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(c) for c in cells)])


def print_table(title: str, rows: Sequence[Mapping[str, Any]]) -> None:
    print(f"\n{title}\n{format_table(rows)}")


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: hardware, library versions, when and how it ran."""
    return {
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "ram_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "zarr": zarr.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
    }


def save_json(out_dir: Path, name: str, payload: Mapping[str, Any]) -> Path:
    """Write `<out_dir>/<name>.json` with the payload and the machine info; print where it went."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    record = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {path}")
    return path


def bar_chart(
    path: Path,
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    *,
    ylabel: str,
    title: str,
    references: Mapping[str, float] | None = None,
) -> Path | None:
    """Grouped bars (one group per category, one bar per series) with optional horizontal reference lines.

    Returns the PNG's path, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a server
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed (pip install '.[bench]'): skipping %s", path.name)
        return None
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(categories) * len(series)), 4.5))
    for i, (label, values) in enumerate(series.items()):
        ax.bar(
            [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))],
            values,
            width,
            label=label,
        )
    for (label, value), style in zip((references or {}).items(), ("--", ":", "-.", "-"), strict=False):
        ax.axhline(value, color="black", linestyle=style, linewidth=1, label=label)
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write and close a matplotlib figure; print where it went."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved {path}")
    return path
