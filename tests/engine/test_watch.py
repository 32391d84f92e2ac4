"""What a user watches: ``python -m engine plot`` draws a metrics file's curves to a PNG, and
``train.tensorboard`` writes the same scalars as TensorBoard events; each optional package
missing ends in one line naming the install."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from engine.config import Config, ConfigError
from engine.run import cli
from engine.run.train import train
from engine.run.watch import Scalars

pytest.importorskip("matplotlib")

from engine.tools.plot import curves, draw, read_metrics

STEPS = 6
EVAL_EVERY = 2
OVERRIDES = ["preset=tiny", "compute_dtype=fp32", "seq_len=32", "micro_batch=2", "log_every=3", f"steps={STEPS}"]
OVERRIDES += ["val_fraction=0.1", f"eval_every={EVAL_EVERY}", "eval_batches=1", "offload.optimizer=cpu"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Config, list[dict]]:
    """A short run writing its metrics file (and TensorBoard events where tensorboard is installed)."""
    tmp_path = tmp_path_factory.mktemp("watch")
    events = [f"tensorboard={tmp_path / 'tb'}"] if importlib.util.find_spec("tensorboard") else []
    metrics = tmp_path / "metrics.jsonl"
    config = Config.from_dict({}, [*OVERRIDES, f"nvme_path={tmp_path / 'store'}", f"metrics={metrics}", *events])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        train(config)
    return config, [json.loads(line) for line in metrics.read_text().splitlines()]


def test_plot_writes_a_png_of_every_step_and_every_validation(run, tmp_path, caplog) -> None:
    from PIL import Image

    config, records = run
    out = tmp_path / "curves.png"
    assert cli.main(["plot", config.train.metrics, "--out", str(out)]) == 0
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > image.size[1] > 100
        image.verify()
    steps = list(range(1, STEPS + 1))
    evaluated = [s for s in steps if s % EVAL_EVERY == 0]
    fig = draw(curves(read_metrics(config.train.metrics)), "run")
    lines = {(ax.get_ylabel(), line.get_label()): line for ax in fig.axes for line in ax.get_lines()}
    assert set(lines) == {
        ("loss", "training"),
        ("loss", "validation"),
        ("seconds per step", "step"),
        ("tokens/s", "throughput"),
    }
    for panel_line, key, at in [
        (("loss", "training"), "loss", steps),
        (("loss", "validation"), "val_loss", evaluated),
        (("seconds per step", "step"), "seconds", steps),
        (("tokens/s", "throughput"), "tokens_per_s", steps),
    ]:
        line = lines[panel_line]
        assert list(line.get_xdata()) == at, key
        assert list(line.get_ydata()) == [r[key] for r in records if r["step"] in at], key
    tokens = 2 * 32  # micro_batch x seq_len on one rank
    assert all(r["tokens_per_s"] == pytest.approx(tokens / r["seconds"]) for r in records)


def test_plot_defaults_to_a_png_beside_the_metrics_file(run, tmp_path) -> None:
    config, _ = run
    metrics = tmp_path / "run.jsonl"
    metrics.write_text(Path(config.train.metrics).read_text())
    assert cli.main(["plot", str(metrics)]) == 0
    assert (tmp_path / "run.png").stat().st_size > 0


def test_tensorboard_events_hold_the_metrics_files_scalars(run) -> None:
    pytest.importorskip("tensorboard", reason="train.tensorboard needs the tensorboard package (optional extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, records = run
    events = EventAccumulator(config.train.tensorboard)
    events.Reload()
    for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "seconds", "peak_rss_bytes"):
        scalars = events.Scalars(key)
        expected = [(r["step"], r[key]) for r in records if key in r]
        assert [s.step for s in scalars] == [step for step, _ in expected], key
        assert [s.value for s in scalars] == pytest.approx([value for _, value in expected], rel=1e-6), key
    assert "step" not in events.Tags()["scalars"]


def test_tensorboard_without_its_package_is_refused_by_the_config_check(monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"train\.tensorboard = 'tb': needs the tensorboard package: pip install tensorboard"
    ):
        Config.from_dict({}, ["tensorboard=tb"])


def _one_error(caplog) -> str:
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    return errors[0]


def test_plot_without_matplotlib_ends_in_one_line_naming_the_install(run, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert cli.main(["plot", run[0].train.metrics, "--out", str(tmp_path / "x.png")]) == 1
    assert "plotting needs matplotlib: pip install matplotlib" in _one_error(caplog)
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "does not exist"),
        ("", "holds no steps"),
        ("{]\n", "line 1 is not JSON"),
        ('{"loss": 1}\n', "line 1 is not a step's record"),
    ],
)
def test_a_file_that_is_not_a_metrics_file_is_refused_in_one_line(tmp_path, caplog, text, message) -> None:
    path = tmp_path / "metrics.jsonl"
    if text is not None:
        path.write_text(text)
    assert cli.main(["plot", str(path)]) == 1
    assert message in _one_error(caplog)


def test_the_metrics_files_folder_is_made_when_missing(tmp_path) -> None:
    path = tmp_path / "runs" / "a" / "metrics.jsonl"
    scalars = Scalars(str(path), "")
    scalars.write({"step": 1, "loss": 2.5})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1, "loss": 2.5}]
