"""``python -m engine plot METRICS.jsonl [--out PNG]``: a run's curves from its metrics file.

Three panels against the step: the training loss with the validation loss where it was taken,
the seconds of each step, and tokens per second. The numbers are those of the records that
``train.metrics`` holds (``engine.run.watch.step_record``), read back as they are; a file that
several runs appended to is drawn in the order it was written. matplotlib is optional (the
``plot`` extra); without it the command ends with one line naming the install.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

Curve = tuple[list[int], list[float]]
"""Steps and values of one line."""

PANELS: dict[str, dict[str, str]] = {
    "loss": {"training": "loss", "validation": "val_loss"},
    "seconds per step": {"step": "seconds"},
    "tokens/s": {"throughput": "tokens_per_s"},
}
"""Each panel's y label, and its lines: label -> the record's key."""


def pyplot() -> ModuleType:
    """matplotlib's pyplot drawing to files only (a server has no display)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ModuleNotFoundError(
            "plotting needs matplotlib: pip install matplotlib (or pip install 'offload-engine[plot]')"
        ) from err
    return plt


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``train.metrics`` file; refuses a line that is not a record of a step."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file {path} does not exist: give the file train.metrics names")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path} line {number} is not JSON ({err}): is it a train.metrics file?") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path} line {number} is not a step's record (no step): is it a train.metrics file?")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no steps: train with train.metrics = {str(path)!r} first")
    return records


def curves(records: list[dict[str, Any]]) -> dict[str, dict[str, Curve]]:
    """Each panel's lines, each line the steps whose records hold its key and those values."""
    panels: dict[str, dict[str, Curve]] = {}
    for ylabel, lines in PANELS.items():
        for label, key in lines.items():
            points = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                steps, values = zip(*points, strict=True)
                panels.setdefault(ylabel, {})[label] = (list(steps), list(values))
    return panels


def draw(panels: dict[str, dict[str, Curve]], title: str) -> Any:
    """A figure of side-by-side panels sharing the step axis, one line per curve."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (ylabel, lines) in zip(axes[0], panels.items(), strict=True):
        for label, (steps, values) in lines.items():
            ax.plot(steps, values, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(metrics: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw the curves of the metrics file ``metrics`` to the PNG ``out`` (default: beside it,
    ``.png`` for its suffix); returns the PNG's path."""
    pyplot()  # refuse before reading a large file
    metrics = Path(metrics)
    target = Path(out) if out else metrics.with_suffix(".png")
    fig = draw(curves(read_metrics(metrics)), metrics.name)
    try:
        fig.savefig(target, dpi=110)
    finally:
        pyplot().close(fig)
    return target
