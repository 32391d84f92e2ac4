"""Line plots of a quantity against model size, beside `benchmarks.report.bar_chart`.

matplotlib stays optional (the `bench` extra): without it the plot is skipped, as
with the bar chart, and the benchmark's table and JSON are still produced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from benchmarks.report import save_figure
from engine.tools.plot import pyplot as engine_pyplot

log = logging.getLogger(__name__)


def pyplot() -> ModuleType | None:
    """matplotlib's pyplot drawing to files only (servers have no display), or None if it is not installed."""
    try:
        return engine_pyplot()
    except ModuleNotFoundError:
        return None


Series = Sequence[float] | Callable[[float], float]
"""Measurements, one per x, or a model (such as a fitted line) drawn as a curve over x's range."""

CURVE_POINTS = 100


def line_panels(
    path: Path,
    x: Sequence[float],
    panels: Mapping[str, Mapping[str, Series]],
    *,
    xlabel: str,
    title: str,
) -> Path | None:
    """Side-by-side panels sharing a log-scaled x axis: one panel per y label, one line per series.

    Measurements are drawn with markers; models dashed and smooth (a straight line is
    a curve on a log axis), so the two read apart. Returns the PNG's path, or None
    without matplotlib.
    """
    plt = pyplot()
    if plt is None:
        log.info("matplotlib is not installed (pip install '.[bench]'): skipping %s", path.name)
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels.items(), strict=True):
        for label, values in series.items():
            if callable(values):
                grid = np.geomspace(min(x), max(x), CURVE_POINTS)
                ax.plot(grid, [values(v) for v in grid], label=label, linestyle="--")
            else:
                ax.plot(x, values, label=label, marker="o")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return save_figure(fig, path)
