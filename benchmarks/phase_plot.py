"""A step's time by phase: one horizontal bar per step, its forward, backward, update and the
loop's own time in turn, each split into compute and the waits it exposed (``StepStats.phases``).

    python -m benchmarks.phase_plot RUN.json [RUN.json ...] [--labels A B ...] [--out DIR]

Each RUN.json is one that `benchmarks.giant` or `benchmarks.finetune` saved; several, drawn one
above the other (the same command on the code before a change and after it), show which phase a
change took time out of.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.plots import pyplot
from benchmarks.report import Row, base_parser, print_table, save_figure, setup_logging
from engine.zero.stats import OTHER, PHASES

PARTS = (
    ("compute_s", "compute", ""),
    ("param_wait_s", "parameter wait", "//"),
    ("optimizer_wait_s", "optimizer wait", "xx"),
)
"""Each phase's seconds in the order drawn: the field, its legend entry, its hatch."""
COLORS = {"forward": "tab:blue", "backward": "tab:orange", "update": "tab:green", OTHER: "tab:gray"}


def phase_steps(records: Sequence[Mapping[str, Any]], runs: Sequence[str]) -> list[dict[str, Any]]:
    """Of each step's metrics record (``train.metrics``), its phases, with the run it belongs
    to (the stopped or the resumed process); steps recorded without phases are left out."""
    return [
        {"run": run, "step": record["step"], "phases": record["phases"]}
        for record, run in zip(records, runs, strict=True)
        if record.get("phases")
    ]


def phase_rows(steps: Sequence[Mapping[str, Any]]) -> list[Row]:
    """A table's rows: one per step and phase."""
    return [
        {"run": step["run"], "step": step["step"], "phase": name, "s": phase["seconds"]}
        | {label: phase[field] for field, label, _ in PARTS}
        for step in steps
        for name in (*PHASES, OTHER)
        if (phase := step["phases"].get(name))
    ]


def phase_bars(path: Path, runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str) -> Path | None:
    """The PNG at ``path``: a bar for each step of each labelled run, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.patches import Patch

    bars = [(f"{label}: step {s['step']} ({s['run']})", s["phases"]) for label, steps in runs.items() for s in steps]
    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.42 * len(bars)))
    for y, (_, phases) in enumerate(bars):
        left = 0.0
        for name in (*PHASES, OTHER):
            for field, _, hatch in PARTS:
                width = phases.get(name, {}).get(field, 0.0)
                ax.barh(y, width, left=left, color=COLORS[name], hatch=hatch, edgecolor="white", linewidth=0.5)
                left += width
    ax.set_yticks(range(len(bars)), [label for label, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    handles = [Patch(color=COLORS[name], label=name) for name in (*PHASES, OTHER)]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=hatch, label=label) for _, label, hatch in PARTS]
    ax.legend(handles=handles, fontsize="small", ncol=len(handles), loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> Path | None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files benchmarks.giant or benchmarks.finetune saved")
    parser.add_argument("--labels", nargs="+", help="a label for each file (default its name)")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    labels = args.labels or [path.stem for path in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels: {len(labels)} labels for {len(args.runs)} files; give one per file")
    runs = {
        label: json.loads(path.read_text()).get("phases", []) for label, path in zip(labels, args.runs, strict=True)
    }
    for label, steps in runs.items():
        print_table(f"phases: {label}", phase_rows(steps))
    return phase_bars(args.out / "phases.png", runs, "a step's phases: compute and exposed waits")


if __name__ == "__main__":
    main()
