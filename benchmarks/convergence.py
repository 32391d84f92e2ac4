"""Convergence of each optimizer state form: the same run of `python -m engine train`, one per
form and seed, and its validation loss against the fp32 runs'.

A compact form is only worth its bytes if it trains as well: each form runs the built-in
model on the built-in data with the same seeds, batches and schedule, the optimizer on the
`cpu` tier (every form is held the same way on every tier; this one keeps the run
compute-bound), and a validation loss every `--eval-every` steps on held-out text. Each form
runs `--seeds` seeds (model initialisation and batch order; default 3), and its score is the
mean over seeds of the mean of its last `TAIL` validation losses, so that neither one seed nor
one evaluation decides. The table gives each form's score, its ratio to fp32's, the spread of
its seeds and the verdict: within the form's bound (`BOUNDS`) or not; the plot, the validation
curves averaged over seeds.

A run is deterministic (seeded data, initialisation and rounding), so a form's curve does
not depend on when it ran, only on the code and the configuration: results accumulate in one
JSON per setting, keyed on the commit (and a digest of uncommitted changes to the code) and on
the whole configuration the runs resolve to, defaults included, so that a later call with
`--forms F` adds (or replaces) form F's curves beside earlier ones of the same code and
configuration only. Each run's log and metrics file stay in `<out>/convergence-runs/`.

    python -m benchmarks.convergence [--quick] [--forms fp32 bf16 int8 bf16-master] [--steps 1000] [--seeds 3]
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.peers.launch import python_module, run_one
from benchmarks.report import base_parser, print_table, save_figure, save_json, setup_logging
from benchmarks.runs import REPO_ROOT
from engine.config import Config
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


TAIL = 3
"""Validation losses at the end of a curve averaged into its score."""
CODE = ("engine", "offload", "benchmarks")
"""The folders whose code a run's curve depends on."""


def code_version() -> str:
    """The commit, and a digest of uncommitted changes to ``CODE`` if any ("unknown" outside a
    git checkout: such results are never reused)."""
    git = ["git", "-C", str(REPO_ROOT)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        diff = subprocess.run([*git, "diff", "HEAD", "--", *CODE], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head if not diff else f"{head}+{hashlib.sha256(diff).hexdigest()[:16]}"


def run_overrides(shared: dict[str, Any], seed: int) -> list[str]:
    """The ``--section.key value`` arguments every form's run of ``seed`` takes."""
    return [
        "--preset", shared["preset"], "--steps", str(shared["steps"]), "--data.seq_len", str(shared["seq_len"]),
        "--data.micro_batch", str(shared["micro_batch"]), "--data.val_fraction", str(shared["val_fraction"]),
        "--train.eval_every", str(shared["eval_every"]), "--optim.lr", str(shared["lr"]),
        "--offload.optimizer", "cpu", "--log_every", "100", "--train.seed", str(seed), "--data.seed", str(seed),
    ]  # fmt: skip


def resolved_config(shared: dict[str, Any]) -> dict[str, Any]:
    """The whole configuration the fp32 run of the first seed resolves to, defaults included: a
    changed default changes the results' key as a changed option does."""
    argv = run_overrides(shared, 0)
    return Config.from_dict({}, [f"{k[2:]}={v}" for k, v in zip(argv[::2], argv[1::2], strict=True)]).to_dict()


def settings(args: Any) -> dict[str, Any]:
    """What every form's runs share; the JSON keeps curves only of runs with equal settings."""
    shared = {
        "preset": args.preset,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "eval_every": args.eval_every,
        "val_fraction": 0.05,
        "lr": args.lr,
        "seeds": list(range(args.seeds)),
        "code": code_version(),
    }
    return json.loads(json.dumps(shared | {"config": resolved_config(shared)}))  # as the JSON keeps them: lists


def train(form: str, seed: int, shared: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """One form's run of ``seed`` in a fresh process, started afresh in ``folder``; its metrics records."""
    name = f"{form}-seed{seed}"
    metrics = folder / f"{name}.jsonl"
    shutil.rmtree(folder / name, ignore_errors=True)  # a store there would be resumed
    metrics.unlink(missing_ok=True)  # records are appended
    folder.mkdir(parents=True, exist_ok=True)
    argv = python_module(
        "engine", "train", *run_overrides(shared, seed), "--nvme_path", str(folder / name),
        "--train.metrics", str(metrics), *FORMS[form],
    )  # fmt: skip
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    code = run_one(argv, cwd=REPO_ROOT, env=env, timeout_s=6 * 3600, log=folder / f"{name}.log")
    if code != 0:
        raise RuntimeError(f"the {form} run of seed {seed} failed (exit {code}): see {folder / name}.log")
    shutil.rmtree(folder / name, ignore_errors=True)
    return read_metrics(metrics)


def validation(records: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """The steps that took a validation loss, and the losses."""
    points = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return [s for s, _ in points], [v for _, v in points]


def previous(path: Path, shared: dict[str, Any]) -> dict[str, Any]:
    """The curves an earlier call saved with the same settings (code and configuration), by form."""
    if shared["code"] == "unknown" or not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return record.get("forms", {}) if record.get("settings") == shared else {}


def score(curves: dict[str, Any]) -> float:
    """A form's score: over its seeds, the mean of each curve's last ``TAIL`` validation losses."""
    return statistics.fmean(statistics.fmean(c["val_loss"][-TAIL:]) for c in curves.values())


def rows(forms: dict[str, Any]) -> list[dict[str, Any]]:
    """Each form's score, its ratio to fp32's, the spread of its seeds' final validation losses,
    and the verdict: whether the ratio is within the form's bound (None for fp32, or without it)."""
    base = score(forms["fp32"]) if "fp32" in forms else None
    table = []
    for form, curves in forms.items():
        value = score(curves)
        finals = [c["val_loss"][-1] for c in curves.values()]
        ratio = value / base if base else None
        bound = BOUNDS.get(form)
        table.append(
            {
                "form": form,
                "seeds": len(curves),
                "score": round(value, 4),
                "vs fp32": None if ratio is None else round(ratio, 4),
                "bound": None if bound is None else 1 + bound,
                "within": None if ratio is None or bound is None else ratio <= 1 + bound,
                "seed spread": round(max(finals) - min(finals), 4),
                "first val loss": round(statistics.fmean(c["val_loss"][0] for c in curves.values()), 4),
            }
        )
    return table


def plot(out: Path, name: str, forms: dict[str, Any], title: str) -> None:
    """The validation curves of every form averaged over its seeds, one panel; skipped without matplotlib."""
    try:
        pyplot()
    except ModuleNotFoundError:
        return
    lines = {}
    for form, curves in forms.items():
        steps = next(iter(curves.values()))["steps"]
        seeds = zip(*(c["val_loss"] for c in curves.values()), strict=True)
        lines[form] = (steps, [statistics.fmean(points) for points in seeds])
    save_figure(draw({"validation loss": lines}, title), out / f"{name}.png")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS), help="forms to run")
    parser.add_argument("--preset", default="medium", help="the built-in GPT's size (default medium)")
    parser.add_argument("--steps", type=int, help="steps per run (default 1000, --quick 20)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per form: 0, 1, ... (default 3)")
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
        forms[form] = {}
        for seed in shared["seeds"]:
            steps, losses = validation(train(form, seed, shared, args.out / f"{name}-runs"))
            forms[form][str(seed)] = {"steps": steps, "val_loss": losses}
            print(f"{form}, seed {seed}: validation loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    table = rows(forms)
    print_table(f"validation loss after {args.steps} steps of the {args.preset} GPT, by state form", table)
    record = {"settings": shared, "forms": forms, "rows": table}
    save_json(args.out, name, record)
    plot(args.out, name, forms, f"{args.preset} GPT, {args.steps} steps: validation loss by optimizer state form")
    return record


if __name__ == "__main__":
    main()
