"""``offload.chunk_mb`` and ``offload.io_threads`` as ``"auto"``: settled to numbers before the
engine builds anything, from the machine's I/O profile; explicit values win; a resumed store
keeps the chunk size its layout was cut with."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

import offload.tuning as tuning
from engine.config import Config, ConfigError
from engine.engine import Engine
from engine.state.partition import build_layout, max_chunk_numel
from engine.tiers.store_io import settle_io, stored_chunk_mb
from tests.training import batches, config, tiny_gpt

MEASURED = {
    "8x4": {"write": 1.0, "read": 1.0},
    "32x8": {"write": 3.0, "read": 3.0},
    "64x8": {"write": 2.0, "read": 2.0},
}


@pytest.fixture
def probes(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls: list[str] = []

    def fake_probe(path, candidates, nbytes=tuning.PROBE_BYTES, direct_io=True):
        calls.append(str(path))
        return {k: v for k, v in MEASURED.items() if tuning.parse_label(k) in set(candidates)}

    monkeypatch.setattr(tuning, "probe", fake_probe)
    return calls


def nvme(tmp_path, **offload) -> Config:
    return config(offload={"optimizer": "nvme", "nvme_path": str(tmp_path / "store")} | offload)


def test_auto_is_the_default_and_parses() -> None:
    assert Config().offload.chunk_mb == "auto" and Config().offload.io_threads == "auto"
    cfg = Config.from_dict({}, ["chunk_mb=8", "io_threads=auto"])
    assert cfg.offload.chunk_mb == 8 and cfg.offload.io_threads == "auto"
    for bad, match in (("chunk_mb=fast", "chunk_mb"), ("io_threads=0", "io_threads"), ("chunk_mb=0", "chunk_mb")):
        with pytest.raises(ConfigError, match=match):
            Config.from_dict({}, [bad])


def test_explicit_values_win_and_nothing_is_measured(tmp_path, probes) -> None:
    cfg = nvme(tmp_path, chunk_mb=4, io_threads=3)
    settled, why = settle_io(cfg, resume=False)
    assert settled is cfg and "set in the config" in why and not probes
    half, _ = settle_io(nvme(tmp_path, chunk_mb=4), resume=False)
    assert (half.offload.chunk_mb, half.offload.io_threads) == (4, 8) and len(probes) == 1


def test_the_engine_measures_once_and_reuses_the_profile(tmp_path, probes) -> None:
    for _ in range(2):
        eng = Engine(tiny_gpt(), nvme(tmp_path), total_steps=2)
        assert (eng.config.offload.chunk_mb, eng.config.offload.io_threads) == (32, 8)
        assert eng.io.runner.threads == 8
        eng.close()
        shutil.rmtree(tmp_path / "store")  # a fresh store for the second engine
    assert len(probes) == 1


def test_auto_keeps_to_a_third_of_the_buffer(tmp_path, probes) -> None:
    settled, _ = settle_io(nvme(tmp_path, buffer_mb=30), resume=False)
    assert settled.offload.chunk_mb == 8  # 32 MiB chunks would not fit three times in 30 MiB


def test_no_disk_tier_measures_nothing(tmp_path, probes) -> None:
    settled, _why = settle_io(config(offload={"nvme_path": str(tmp_path / "s")}), resume=False)
    assert not probes and (settled.offload.chunk_mb, settled.offload.io_threads) == tuning.FALLBACK


@pytest.mark.parametrize("chunk_mb", [1, 2, 3, 5])
def test_the_stored_chunk_size_cuts_the_layout_as_it_was_cut(tmp_path, chunk_mb) -> None:
    params = {
        f"u{i}": [("w", nn.Parameter(torch.empty(n)))] for i, n in enumerate([300_000, 1_100_000, 2_700_000, 5_000])
    }
    for world in (1, 2, 3):
        layout = build_layout(params, world, max_chunk_numel(chunk_mb))
        (tmp_path / "zarr.json").write_text(json.dumps({"attributes": {"layout": layout.to_dict()}}))
        kept = stored_chunk_mb(tmp_path)
        assert kept is not None and kept <= chunk_mb
        assert build_layout(params, world, max_chunk_numel(kept)) == layout


def test_a_resumed_store_keeps_its_chunk_size(tmp_path, probes) -> None:
    eng = Engine(tiny_gpt(), nvme(tmp_path, chunk_mb=1, io_threads=2), total_steps=4)
    data = batches(4)
    eng.backward(eng(*data.next()))
    eng.step()
    layout = eng.layout
    eng.close()
    resumed = Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=4)
    assert resumed.config.offload.chunk_mb == stored_chunk_mb(tmp_path / "store") == 1
    assert resumed.config.offload.io_threads == 8, "the threads still come from the profile"
    assert resumed.layout == layout and resumed.global_step == 1
    resumed.close()
