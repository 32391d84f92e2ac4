"""Three mistakes a command-line user makes, each ended by one line that names the config key
and what to type instead: a unit class the model lacks, a store folder that cannot be made,
and a list given as ``a,b`` (which is read as a list) or as no list at all."""

from __future__ import annotations

import logging
import os

import pytest

from engine.run import cli as engine_cli
from tests.caches import fresh_cache

TRAIN = ["train", "--preset", "tiny", "--steps", "1", "--seq_len", "64"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch) -> None:
    """Run where the test's files are, measuring disks into a cache of its own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def failure(caplog, args: list[str], code: int) -> str:
    """The one ERROR line of ``python -m engine ARGS``, which must exit with ``code``."""
    assert engine_cli.main(args) == code
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not record.exc_info and "\n" not in record.getMessage()
    return record.getMessage()


def test_a_unit_class_the_model_lacks_names_the_ones_it_has(tmp_path, caplog) -> None:
    line = failure(caplog, [*TRAIN, "--zero.unit_classes", "Nope", "--offload.nvme_path", str(tmp_path / "s")], 1)
    assert line == (
        "zero.unit_classes names 'Nope', which no module of this model is: its module classes are Block, "
        "CausalSelfAttention, Embedding, GPT, LayerNorm, Linear, MLP, ModuleList (choose among them, or leave "
        "zero.unit_classes empty for every entry of every nn.ModuleList)"
    )
    assert not (tmp_path / "s").exists(), "refused before the store holds anything"


def test_estimate_refuses_a_unit_class_the_model_lacks(caplog) -> None:
    line = failure(caplog, ["estimate", "--preset", "tiny", "--zero.unit_classes", "Block,Nope"], 1)
    assert line.startswith("zero.unit_classes names 'Nope', which no module of this model is: ")


def test_a_store_folder_under_a_file_names_the_key_and_the_fix(tmp_path, caplog) -> None:
    (tmp_path / "file").write_text("x")
    store = tmp_path / "file" / "store"
    line = failure(caplog, [*TRAIN, "--offload.nvme_path", str(store)], 1)
    assert line.endswith(
        f"cannot create the store folder {store} for offload.nvme_path: Not a directory ({store}); "
        "choose a folder on a writable local disk"
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.ismount("/proc"), reason="as root, only a pseudo-filesystem refuses"
)
def test_a_store_folder_under_proc_names_the_key_and_the_fix(caplog) -> None:
    line = failure(caplog, [*TRAIN, "--offload.nvme_path", "/proc/x/store"], 1)
    assert line.endswith(
        "cannot create the store folder /proc/x/store for offload.nvme_path: No such file or directory (/proc/x); "
        "choose a folder on a writable local disk"
    )


def test_a_list_on_the_command_line_is_comma_separated() -> None:
    config = engine_cli._load_config(None, ["--lora.target_modules", "q_proj,v_proj"])
    assert config.lora.target_modules == ["q_proj", "v_proj"]


def test_a_value_that_is_no_list_names_the_forms_that_are(caplog) -> None:
    line = failure(caplog, [*TRAIN, "--lora.target_modules", "3"], 2)
    assert line == (
        'config error: lora.target_modules = 3: expected a list of strings: in a config file ["name1", "name2"], '
        "on the command line --lora.target_modules name1,name2"
    )
