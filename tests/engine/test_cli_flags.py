"""What a command-line user finds out without reading the code: ``--help`` lists every config
key with its default and summary, ``--print-config`` shows what a command would run with, a
YAML file reads as YAML, every flag has one spelling (the other still works, with a warning),
and ``--seed`` sets every seed a run draws from."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib

import pytest

from engine.config import Config, ConfigError
from engine.config_docs import reference
from engine.config_parse import read_file
from engine.run import cli as engine_cli


def help_of(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        engine_cli.main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_train_help_lists_every_key_with_its_default_and_summary(capsys) -> None:
    text = " ".join(help_of("train", capsys).split())
    for section in reference():
        assert f"[{section.name}]" in text
        for key in section.keys:
            flag = f"--{section.name}.{key.name}".replace("_", "-")
            assert f"{flag} (default {key.default})" in text, flag
            assert " ".join(key.summary.replace("``", "").split()) in text, flag
    assert "--seed N: sets train.seed and data.seed" in text


@pytest.mark.parametrize("command", ["estimate", "generate"])
def test_every_command_taking_a_config_lists_its_keys(capsys, command: str) -> None:
    text = help_of(command, capsys)
    assert "--print-config" in text and "--optim.grad-clip (default 1.0)" in text


def test_usage_names_the_program_as_it_was_called(capsys, tmp_path) -> None:
    assert help_of("train", capsys).startswith("usage: offload-engine train"), "the console script's name"
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", "--help"], env=env, capture_output=True, text=True, check=True
    )
    assert proc.stdout.startswith("usage: python -m engine train")


def test_print_config_prints_the_file_and_flags_as_toml(tmp_path, capsys) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("zero:\n  stage: 3\noptim:\n  lr: 1e-3\n  betas: [0.8, 0.9]\noffload:\n  param: cpu\n")
    args = ["train", "--config", str(path), "--optim.grad-clip", "0.5", "--steps=7", "--print-config"]
    assert engine_cli.main(args) == 0
    printed = Config.from_dict(tomllib.loads(capsys.readouterr().out))
    assert printed == Config.load(path, ["optim.grad_clip=0.5", "train.steps=7"])
    assert (printed.zero.stage, printed.optim.lr, printed.optim.betas) == (3, 1e-3, (0.8, 0.9))


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_a_yaml_file_is_read_as_yaml(tmp_path, suffix: str) -> None:
    path = tmp_path / f"run{suffix}"
    path.write_text("optim:\n  lr: 2e-4\n  no_decay: [bias]\ntrain:\n  steps: 3\n")
    config = Config.load(path)
    assert (config.optim.lr, config.optim.no_decay, config.train.steps) == (2e-4, ["bias"], 3)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("run.cfg", "[zero]\nstage = 1\n", "config file {} has the extension '.cfg', which is not a config format"),
        ("run", "[zero]\nstage = 1\n", "config file {} has the extension '(none)', which is not a config format"),
        ("broken.yaml", "zero: [stage\n", "config file {} is not valid YAML: "),
        ("list.yaml", "- zero\n", "config file {} holds a list, not a table of sections"),
        ("list.json", "[1]", "config file {} holds a list, not a table of sections"),
    ],
)
def test_a_file_of_no_config_format_is_refused_by_name(tmp_path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_file(path)
    assert message.format(path) in " ".join(str(err.value).split())


def test_the_underscore_spelling_works_with_a_warning(caplog) -> None:
    config = engine_cli._load_config(None, engine_cli._respell(["--seq-len", "64", "--optim.grad-clip=0.5"])[0])
    assert (config.data.seq_len, config.optim.grad_clip) == (64, 0.5)
    respelled, notices = engine_cli._respell(["--seq_len", "64", "--log_level", "x", "--", "--keep_this"])
    assert respelled == ["--seq-len", "64", "--log-level", "x", "--", "--keep_this"]
    assert notices[0] == "--seq_len is deprecated: write --seq-len (flags are kebab-case; the old spelling still works)"
    with caplog.at_level(logging.WARNING):
        assert engine_cli.main(["train", "--seq_len", "64", "--seq_len", "64", "--print-config"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [notices[0]], "one warning per flag"


@pytest.mark.parametrize("command", [["export", "store", "out"], ["consolidate", "store", "out.safetensors"]])
def test_checkpoint_is_an_old_name_of_from_checkpoint(command: list[str]) -> None:
    respelled, notices = engine_cli._respell([*command, "--checkpoint", "step-2"])
    args = engine_cli._parser("offload-engine").parse_args(respelled)
    assert args.from_checkpoint == "step-2"
    assert notices == [
        "--checkpoint is deprecated: write --from-checkpoint (flags are kebab-case; the old spelling still works)"
    ]


def test_seed_sets_both_seeds_and_a_dotted_key_after_it_wins() -> None:
    config = engine_cli._load_config(None, ["--seed", "5"])
    assert (config.train.seed, config.data.seed) == (5, 5)
    config = engine_cli._load_config(None, ["--seed=5", "--data.seed", "7"])
    assert (config.train.seed, config.data.seed) == (5, 7)
    args, extra = engine_cli._parser("offload-engine").parse_known_args(["generate", "--prompt", "a", "--seed", "3"])
    assert args.seed == 3 and extra == [], "generate's --seed draws the sample"
