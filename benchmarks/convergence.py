"""Convergence of each optimizer state form: the same run of `python -m engine train`, one per
form, and its validation loss against the fp32 run's.

A compact form is only worth its bytes if it trains as well: each form runs the built-in
model on the built-in data with the same seed, batches and schedule, the optimizer on the
`cpu` tier (every form is held the same way on every tier; this one keeps the run
compute-bound), and a validation loss every `--eval-every` steps on held-out text. The
table gives each form's final validation loss and its ratio to fp32's; the plot, the
validation curves.

A run is deterministic (seeded data, initialisation and rounding), so a form's curve does
not depend on when it ran: results accumulate in one JSON per setting, and a later call with
`--forms F` adds (or replaces) form F's curve beside the earlier ones. Each run's log and
metrics file stay in `<out>/convergence-runs/`.

    python -m benchmarks.convergence [--quick] [--forms fp32 bf16 int8 bf16-master] [--steps 1000]
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from benchmarks.peers.launch import python_module, run_one
from benchmarks.report import base_parser, print_table, save_figure, save_json, setup_logging
from benchmarks.runs import REPO_ROOT
from engine.tools.plot import draw, pyplot, read_metrics

FORMS: dict[str, list[str]] = {
    "fp32": [],
    "bf16": ["--optim.state_dtype", "bf16"],
    "int8": ["--optim.state_dtype", "int8"],
    "bf16-master": ["--optim.master_dtype", "bf16"],
}
"""Each form's name and the overrides that select it (fp32 moments and masters are the default;
``bf16-master``: fp32 moments, bf16 masters rounded stochastically)."""
BOUNDS = {"bf16": 0.01, "int8": 0.02, "bf16-master": 0.02}
"""The largest relative excess of a form's final validation loss over fp32's that counts as
converging as well (the goals of the compact forms)."""


def settings(args: Any) -> dict[str, Any]:
    """What every form's run shares; the JSON keeps curves only of runs with equal settings."""
    return {
        "preset": args.preset,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "eval_every": args.eval_every,
        "val_fraction": 0.05,
        "lr": args.lr,
    }


def train(form: str, shared: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """One form's run in a fresh process, started afresh in ``folder``; its metrics records."""
    metrics = folder / f"{form}.jsonl"
    shutil.rmtree(folder / form, ignore_errors=True)  # a store there would be resumed
    metrics.unlink(missing_ok=True)  # records are appended
    folder.mkdir(parents=True, exist_ok=True)
    argv = python_module(
        "engine", "train", "--preset", shared["preset"], "--steps", str(shared["steps"]),
        "--data.seq_len", str(shared["seq_len"]), "--data.micro_batch", str(shared["micro_batch"]),
        "--data.val_fraction", str(shared["val_fraction"]), "--train.eval_every", str(shared["eval_every"]),
        "--optim.lr", str(shared["lr"]), "--offload.optimizer", "cpu", "--nvme_path", str(folder / form),
        "--train.metrics", str(metrics), "--log_every", "100", *FORMS[form],
    )  # fmt: skip
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    code = run_one(argv, cwd=REPO_ROOT, env=env, timeout_s=6 * 3600, log=folder / f"{form}.log")
    if code != 0:
        raise RuntimeError(f"the {form} run failed (exit {code}): see {folder / form}.log")
    shutil.rmtree(folder / form, ignore_errors=True)
    return read_metrics(metrics)


def validation(records: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """The steps that took a validation loss, and the losses."""
    points = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return [s for s, _ in points], [v for _, v in points]


def previous(path: Path, shared: dict[str, Any]) -> dict[str, Any]:
    """The curves an earlier call saved with the same settings, by form."""
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return record.get("forms", {}) if record.get("settings") == shared else {}


def rows(forms: dict[str, Any]) -> list[dict[str, Any]]:
    """Each form's final validation loss, its ratio to fp32's and whether it is within its bound."""
    base = forms.get("fp32", {}).get("val_loss", [None])[-1]
    table = []
    for form, curve in forms.items():
        final = curve["val_loss"][-1]
        ratio = final / base if base else None
        bound = BOUNDS.get(form)
        table.append(
            {
                "form": form,
                "final val loss": round(final, 4),
                "vs fp32": None if ratio is None else round(ratio, 4),
                "bound": None if bound is None else 1 + bound,
                "within": None if ratio is None or bound is None else ratio <= 1 + bound,
                "first val loss": round(curve["val_loss"][0], 4),
            }
        )
    return table


def plot(out: Path, name: str, forms: dict[str, Any], title: str) -> None:
    """The validation curves of every form, one panel; skipped without matplotlib."""
    try:
        pyplot()
    except ModuleNotFoundError:
        return
    lines = {form: (curve["steps"], curve["val_loss"]) for form, curve in forms.items()}
    save_figure(draw({"validation loss": lines}, title), out / f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS), help="forms to run")
    parser.add_argument("--preset", default="medium", help="the built-in GPT's size (default medium)")
    parser.add_argument("--steps", type=int, help="steps per run (default 1000, --quick 20)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--eval-every", type=int, help="steps between validation losses (default 50, --quick 5)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, cosine decay (default 1e-3)")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    if args.quick:
        args.preset = "tiny" if args.preset == "medium" else args.preset
    args.steps = args.steps or (20 if args.quick else 1000)
    args.eval_every = args.eval_every or (5 if args.quick else 50)
    shared = settings(args)
    name = "convergence-quick" if args.quick else "convergence"
    forms = previous(args.out / f"{name}.json", shared)
    for form in args.forms:
        steps, losses = validation(train(form, shared, args.out / f"{name}-runs"))
        forms[form] = {"steps": steps, "val_loss": losses}
        print(f"{form}: validation loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    table = rows(forms)
    print_table(f"validation loss after {args.steps} steps of the {args.preset} GPT, by state form", table)
    save_json(args.out, name, {"settings": shared, "forms": forms, "rows": table})
    plot(args.out, name, forms, f"{args.preset} GPT, {args.steps} steps: validation loss by optimizer state form")


if __name__ == "__main__":
    main()
