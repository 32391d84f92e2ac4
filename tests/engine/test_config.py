"""Every class of bad configuration is refused before any work, with a message that names
the key and the fix."""

from __future__ import annotations

import json

import pytest

from engine.config import Config, ConfigError


def test_defaults_are_valid_and_round_trip_through_a_file(tmp_path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(Config().to_dict()))
    assert Config.load(path) == Config()


def test_toml_file_and_overrides(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[zero]\nstage = 1\n[optim]\nlr = 1e-3\nbetas = [0.8, 0.9]\n")
    config = Config.load(path, ["optim.lr=2e-3", "steps=7", "offload.optimizer=device"])
    assert (config.zero.stage, config.optim.lr, config.optim.betas) == (1, 2e-3, (0.8, 0.9))
    assert config.train.steps == 7 and config.offload.optimizer == "device"


@pytest.mark.parametrize(
    ("raw", "overrides", "message"),
    [
        ({"zero": {"stgae": 1}}, [], "unknown key 'stgae' in section [zero] (did you mean 'stage'?)"),
        ({"optimm": {}}, [], "did you mean 'optim'?"),
        ({}, ["lrr=1"], "unknown config key 'lrr' (did you mean 'lr'?)"),
        ({}, ["seed=1"], "key 'seed' is ambiguous: write one of data.seed, train.seed"),
        ({"zero": {"stage": "two"}}, [], "zero.stage = 'two': expected int, got str"),
        ({"zero": {"stage": True}}, [], "zero.stage = True: expected int, got bool"),
        ({"optim": {"betas": [0.9]}}, [], "optim.betas = [0.9]: expected a list of 2 values"),
        ({"offload": {"optimizer": "disk"}}, [], "offload.optimizer = 'disk': must be one of 'device', 'cpu', 'nvme'"),
        ({"zero": {"stage": 4}}, [], "zero.stage = 4: must be 1, 2 or 3"),
        ({"optim": {"lr": -1.0}}, [], "optim.lr = -1.0: must be > 0"),
        ({"optim": {"betas": [0.9, 1.0]}}, [], "optim.betas = (0.9, 1.0): each must be in [0, 1)"),
        ({"precision": {"compute_dtype": "fp16"}}, [], "fp16 needs loss scaling"),
        ({"offload": {"param": "cpu"}}, [], "offloading parameters needs zero.stage = 3"),
        ({"offload": {"buffer_mb": 8, "chunk_mb": 16}}, [], "offload.buffer_mb = 8: must hold"),
        ({"zero": 3}, [], "zero must be a section"),
        ({"zero": {"prefetch_mb": -1}}, [], 'zero.prefetch_mb = -1.0: must be >= 0 (0: no prefetch), or "auto"'),
        ({}, ["zero.prefetch_mb=lots"], "zero.prefetch_mb = 'lots': expected a number or \"auto\""),
        ({}, ["offload.buffer_mb=1.5"], 'offload.buffer_mb = 1.5: expected a whole number or "auto"'),
        ({}, ["offload.grad_spill=3"], 'offload.grad_spill = 3: expected true or false or "auto"'),
        ({}, ["offload.nvme_path=3"], "offload.nvme_path = 3: expected a string or a list of strings"),
        ({}, ["lr=inf"], "optim.lr = inf: must be finite"),
        ({}, ["lr=nan"], "optim.lr = nan: must be finite"),
        ({"zero": {"device_memory_limit_mb": float("inf")}}, [], "zero.device_memory_limit_mb = inf: must be finite"),
        ({"optim": {"betas": [0.9, float("-inf")]}}, [], "optim.betas = (0.9, -inf): must be finite"),
    ],
)
def test_bad_values_are_named_with_the_fix(raw: dict, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_dict(raw, overrides)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "override",
    ["lora.target_modules=q_proj,v_proj", "target_modules=q_proj, v_proj", 'lora.target_modules=["q_proj", "v_proj"]'],
)
def test_a_list_of_strings_on_the_command_line_is_comma_separated_or_a_list(override: str) -> None:
    assert Config.from_dict({}, [override]).lora.target_modules == ["q_proj", "v_proj"]


def test_every_list_of_strings_splits_at_commas_and_nvme_path_stays_a_string() -> None:
    config = Config.from_dict({}, ["zero.unit_classes=Block", "offload.nvme_path=/a/s,/b/s"])
    assert config.zero.unit_classes == ["Block"]
    assert Config.from_dict({}, ["zero.unit_classes="]).zero.unit_classes == [], "empty: every ModuleList entry"
    assert config.offload.nvme_path == "/a/s,/b/s" and config.offload.nvme_paths == ["/a/s", "/b/s"]


@pytest.mark.parametrize(
    ("raw", "overrides"), [({}, ["lora.target_modules=3"]), ({"lora": {"target_modules": "q_proj"}}, [])]
)
def test_a_value_that_is_no_list_of_strings_names_the_forms_that_are(raw: dict, overrides: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_dict(raw, overrides)
    assert str(err.value).endswith(
        ': expected a list of strings: in a config file ["name1", "name2"], '
        "on the command line --lora.target_modules name1,name2"
    )


def test_unreadable_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[zero\nstage = 1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        Config.load(broken)


@pytest.mark.parametrize(
    ("name", "text"),
    [("run.toml", "[precision]\ninitial_scale = inf\n"), ("run.json", '{"precision": {"initial_scale": Infinity}}')],
)
def test_infinity_in_a_file_is_refused(tmp_path, name: str, text: str) -> None:
    """Both formats spell infinity, which every range check here (``> 0``) would let through."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"precision\.initial_scale = inf: must be finite"):
        Config.load(path)


def test_the_reference_documents_every_config_key() -> None:
    import dataclasses
    from pathlib import Path

    reference = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for section in dataclasses.fields(Config):
        assert f"## `[{section.name}]`" in reference, section.name
        for key in dataclasses.fields(section.default_factory()):
            assert f"| `{key.name}` |" in reference, f"{section.name}.{key.name} is not in docs/configuration.md"
