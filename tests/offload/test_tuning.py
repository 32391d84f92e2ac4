"""I/O settings that tune themselves: the disk is measured once, kept in a per-machine profile
and reused; explicit values win; a profile that cannot be read is ignored and measured again."""

from __future__ import annotations

import json
import logging

import pytest

import offload.tuning as tuning
from offload.tuning import CHUNK_RANGE, THREAD_RANGE, auto_settings, choose, disk_key, probe, profile_path

FAKE = {
    "8x4": {"write": 1.0, "read": 1.0},
    "16x4": {"write": 2.0, "read": 2.0},
    "32x8": {"write": 2.05, "read": 2.05},  # within the noise of 16x4: the smaller chunk wins
    "64x8": {"write": 1.5, "read": 1.5},
}


@pytest.fixture
def probes(tmp_path, monkeypatch) -> list[tuple]:
    """A profile in a fresh cache, and a probe that records its calls instead of measuring."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls: list[tuple] = []

    def fake_probe(path, candidates, nbytes=tuning.PROBE_BYTES, direct_io=True):
        calls.append((str(path), tuple(candidates)))
        return {k: v for k, v in FAKE.items() if tuning.parse_label(k) in set(candidates)}

    monkeypatch.setattr(tuning, "probe", fake_probe)
    return calls


def test_the_disk_is_measured_once_then_the_profile_is_reused(tmp_path, probes) -> None:
    first = auto_settings(tmp_path / "store")
    assert (first.chunk_mb, first.io_threads) == (16, 4)
    assert len(probes) == 1
    again = auto_settings(tmp_path / "other-store")  # the same disk
    assert (again.chunk_mb, again.io_threads) == (16, 4) and len(probes) == 1
    assert "by probe" in again.why and disk_key(tmp_path) in again.why
    saved = json.loads(profile_path().read_text())
    assert list(saved["disks"]) == [disk_key(tmp_path)]


def test_without_measuring_an_unknown_disk_gets_the_defaults(tmp_path, probes) -> None:
    settings = auto_settings(tmp_path, measure=False)
    assert (settings.chunk_mb, settings.io_threads) == tuning.FALLBACK and not probes
    assert "not measured yet" in settings.why


@pytest.mark.parametrize(
    "content", ["{not json", '{"version": 1, "disks": {"x": {"measured": {"16x4": {"write": -1}}}}}', "[]"]
)
def test_a_corrupt_profile_is_ignored_with_a_warning_and_measured_again(tmp_path, probes, caplog, content) -> None:
    profile_path().parent.mkdir(parents=True)
    profile_path().write_text(content)
    with caplog.at_level(logging.WARNING, logger="offload.tuning"):
        settings = auto_settings(tmp_path)
    assert "ignoring the I/O profile" in caplog.text
    assert len(probes) == 1 and (settings.chunk_mb, settings.io_threads) == (16, 4)
    assert json.loads(profile_path().read_text())["version"] == tuning.PROFILE_VERSION  # rewritten whole
    caplog.clear()
    auto_settings(tmp_path)
    assert len(probes) == 1 and not caplog.text


def test_a_smaller_chunk_is_preferred_only_within_the_noise() -> None:
    slower = {"16x4": {"write": 2.0, "read": 2.0}, "64x8": {"write": 2.15, "read": 2.15}}  # 7% apart
    assert choose(slower) == (64, 8)
    close = {"16x4": {"write": 2.0, "read": 2.0}, "64x8": {"write": 2.08, "read": 2.08}}  # 4% apart
    assert choose(close) == (16, 4)


def test_among_equally_fast_candidates_the_one_costing_least_cpu_wins() -> None:
    tied = {
        "16x4": {"write": 2.0, "read": 2.0, "cpu_s_per_gb": 0.13},
        "64x8": {"write": 2.04, "read": 2.04, "cpu_s_per_gb": 0.09},  # within the noise, cheaper
        "64x4": {"write": 1.8, "read": 1.8, "cpu_s_per_gb": 0.08},  # cheapest, but 11% slower
    }
    assert choose(tied) == (64, 8)
    unmeasured = {name: dict(bw) for name, bw in tied.items()}
    del unmeasured["64x8"]["cpu_s_per_gb"]  # a profile from before CPU was measured: as chosen then
    assert choose(unmeasured) == (16, 4)


def test_auto_stays_within_the_chunk_limit(tmp_path, probes) -> None:
    settings = auto_settings(tmp_path, max_chunk_mb=8)
    assert (settings.chunk_mb, settings.io_threads) == (8, 4)
    assert all(c <= 8 for c, _ in probes[0][1]), "no candidate over the limit is measured"
    assert choose(FAKE, max_chunk_mb=4) is None


def test_a_profile_of_small_chunks_is_completed_by_a_run_that_can_take_larger(tmp_path, probes) -> None:
    """A first run of small units measures small chunks only; a later run of large units must
    not be held to them (a 7.9B fine-tune ran at 1 MiB chunks after a quick benchmark's probe)."""
    small = auto_settings(tmp_path / "small", max_chunk_mb=8)
    assert (small.chunk_mb, small.io_threads) == (8, 4)
    large = auto_settings(tmp_path / "large")
    assert probes[1][1] == tuple(c for c in tuning.CANDIDATES if c[0] > 8), "only the larger candidates"
    assert (large.chunk_mb, large.io_threads) == (16, 4)
    saved = json.loads(profile_path().read_text())["disks"][disk_key(tmp_path)]["measured"]
    assert set(saved) == set(FAKE), "the larger candidates kept beside the small ones"
    auto_settings(tmp_path / "again")
    assert len(probes) == 2, "a complete profile is measured no more"


def test_a_disk_profiled_with_no_candidate_is_measured_whole(tmp_path, probes) -> None:
    tuning.record(tmp_path, {}, "probe")
    settings = auto_settings(tmp_path)
    assert probes[0][1] == tuning.CANDIDATES and (settings.chunk_mb, settings.io_threads) == (16, 4)


def test_a_real_probe_measures_and_cleans_up(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = tmp_path / "store"
    store.mkdir()
    measured = probe(store, [(1, 1), (2, 2)], nbytes=4 << 20)
    assert set(measured) == {"1x1", "2x2"}
    assert all(bw["write"] > 0 and bw["read"] > 0 and bw["cpu_s_per_gb"] > 0 for bw in measured.values())
    assert not list(store.iterdir()), "nothing written inside the store's folder"
    assert not list(tmp_path.glob(".io-probe-*")), "the probe, beside it, is removed"
    chunk, threads = choose(measured)
    assert CHUNK_RANGE[0] <= chunk <= CHUNK_RANGE[1] and THREAD_RANGE[0] <= threads <= THREAD_RANGE[1]


def test_the_probe_holds_one_candidates_bytes_at_a_time(tmp_path, monkeypatch) -> None:
    """Each candidate's files are gone before the next is written: a probe of five candidates
    needs the disk space of one (what a run's disk plan counts)."""
    found_at_start: list[list[str]] = []
    measure_one = tuning._probe_one

    def recording(root, *args):
        found_at_start.append([p.name for p in root.parent.iterdir()])
        return measure_one(root, *args)

    monkeypatch.setattr(tuning, "_probe_one", recording)
    probe(tmp_path / "store", [(1, 1), (2, 2), (4, 2)], nbytes=4 << 20)
    assert found_at_start == [[], [], []]


def test_a_probe_that_cannot_run_falls_back_to_the_defaults(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tuning, "probe", full_disk)
    with caplog.at_level(logging.WARNING, logger="offload.tuning"):
        settings = auto_settings(tmp_path)
    assert (settings.chunk_mb, settings.io_threads) == tuning.FALLBACK
    assert "could not measure" in caplog.text and not profile_path().exists()
