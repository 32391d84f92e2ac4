"""Smoke tests: each benchmark runs end to end on tiny sizes and saves a complete JSON record.

Not performance checks: the numbers only have to exist and be positive.
"""

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import checksum, copies, copy_timeline, optimizer, report, tiers
from engine.runtime.native_dtype import native_compute_dtype
from engine.state.forms import StateForm

TINY_TIERS = ["--quick", "--mb", "16", "--chunk-mb", "4", "16", "--threads", "2", "--reps", "1"]
MACHINE_KEYS = {"cpu_count", "ram_bytes", "torch", "zarr", "date", "command"}


@pytest.fixture
def own_io_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``benchmarks.tiers`` records the disk's I/O profile, which ``chunk_mb = "auto"`` reads:
    from these tiny runs it goes to the test's cache, not to the machine's."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache / "offload-engine" / "io_profile.json"


def load_record(path: Path, name: str) -> dict[str, Any]:
    record = json.loads((path / f"{name}.json").read_text())
    assert record["benchmark"] == name
    assert record["machine"].keys() >= MACHINE_KEYS
    return record


def test_tiers_quick(tmp_path: Path, own_io_profile: Path) -> None:
    disk = tmp_path / "disk"
    tiers.main(["--out", str(tmp_path), "--dir", str(disk), *TINY_TIERS])
    record = load_record(tmp_path, "tiers")
    keys = {"memcpy_gbps", "best_raw_gbps", "goal", "goal_met", "recommended", "recommended_measured", "rows"}
    assert keys <= record.keys()
    assert record["recommended_measured"]["write"] > 0 and record["recommended_measured"]["read"] > 0
    assert record["recommended"]["chunk_mb"] in (4, 16)
    assert record["recommended"]["io_threads"] in (2, 4)  # the grid's, or the default's run buffered
    # memcpy, raw at 2 threads, the 2 x 1 grid and the default, then its buffered, unchecksummed,
    # base-page and two-path variants
    assert [row["tier"].split()[0] for row in record["rows"]] == ["host", "raw", *["store"] * 7]
    assert [row["config"] for row in record["rows"][-5:]] == [
        "16 MiB x 4",
        "16 MiB x 4, buffered",
        "16 MiB x 4, no crc",
        "16 MiB x 4, base pages",
        "16 MiB x 4, 2 paths",
    ]
    # the default's CPU per GB in huge pages against base pages, both measured
    for kind in ("write", "read"):
        cut = record["cpu_cut"][kind]
        assert cut["before"] > 0 and cut["now"] > 0 and cut["ratio"] == pytest.approx(cut["now"] / cut["before"])
    for row in record["rows"]:
        assert row["write GB/s"] > 0 and row["read GB/s"] > 0
    stripes = record["stripes"]
    assert stripes["paths"] == 2 and stripes["same_disk"] and stripes["write_ratio"] > 0 and stripes["read_ratio"] > 0
    assert list(disk.iterdir()) == []  # every benchmark file was removed
    assert record["auto"]["profile"] == str(own_io_profile) and own_io_profile.exists()


def test_tiers_measures_reads_and_writes_at_once_against_them_apart(tmp_path: Path, own_io_profile: Path) -> None:
    disk = tmp_path / "disk"
    tiers.main(["--out", str(tmp_path), "--dir", str(disk), *TINY_TIERS, "--paths", "1", "--read-share", "0.25", "0.5"])
    record = load_record(tmp_path, "tiers")
    raw = record["best_raw_gbps"]
    assert [row["read share"] for row in record["mixed"]] == [0.25, 0.5]
    for row in record["mixed"]:
        share = row["read share"]
        assert row["one after the other GB/s"] == pytest.approx(1 / (share / raw["read"] + (1 - share) / raw["write"]))
        assert row["GB/s moved"] > 0 and row["x"] == pytest.approx(row["GB/s moved"] / row["one after the other GB/s"])
    assert list(disk.iterdir()) == []


def test_tiers_refuses_a_read_share_outside_zero_to_one(tmp_path: Path, own_io_profile: Path) -> None:
    with pytest.raises(SystemExit):
        tiers.main(["--out", str(tmp_path), *TINY_TIERS, "--read-share", "1.5"])


def test_tiers_stripes_across_other_drives_folders(tmp_path: Path, own_io_profile: Path) -> None:
    disk, other = tmp_path / "disk", tmp_path / "other"
    other.mkdir()
    tiers.main(["--out", str(tmp_path), "--dir", str(disk), *TINY_TIERS, "--paths", "2", "--stripe-dir", str(other)])
    assert load_record(tmp_path, "tiers")["stripes"]["striped"]["write"] > 0
    assert list(disk.iterdir()) == [] and list(other.iterdir()) == []


def test_tiers_moves_one_unit_as_the_tier_does(tmp_path: Path, own_io_profile: Path) -> None:
    disk = tmp_path / "disk"
    tiers.main(
        [
            "--out",
            str(tmp_path),
            "--dir",
            str(disk),
            "--mb",
            "16",
            "--chunk-mb",
            "4",
            "--threads",
            "2",
            "--reps",
            "1",
            "--unit-mb",
            "48",
        ]
    )
    units = [row for row in load_record(tmp_path, "tiers")["rows"] if row["tier"] == "store, one unit"]
    assert [row["config"] for row in units] == [
        "4 MiB x 2",
        "16 MiB x 4",
        "16 MiB x 4, buffered",
        "16 MiB x 4, no crc",
        "16 MiB x 4, base pages",
        "16 MiB x 4, 2 paths",
    ]
    assert all(row["write GB/s"] > 0 and row["read GB/s"] > 0 and row["write/raw"] > 0 for row in units)
    assert list(disk.iterdir()) == []


@pytest.mark.parametrize(
    ("state_dtype", "master_dtype", "state_bytes"),
    [
        ("fp32", "fp32", 3 * 4),
        pytest.param("int8", "fp32", 4 + 2 * 260 / 256, marks=pytest.mark.slow),  # int8 is in the next case too
        ("int8", "bf16", 2 + 2 * 260 / 256),
    ],
)
def test_optimizer_quick(tmp_path: Path, state_dtype: str, master_dtype: str, state_bytes: float) -> None:
    disk = tmp_path / "disk"
    host = ["--params", "200000", "--shard-params", "64000", "--reps", "1"]
    nvme_tier = ["--nvme-params", "320000", "--dir", str(disk), "--buffer-mb", "4"]
    form = ["--state-dtype", state_dtype, "--master-dtype", master_dtype]
    optimizer.main(["--quick", "--out", str(tmp_path), *host, *nvme_tier, *form])
    record = load_record(tmp_path, "optimizer")
    assert record["params"] == 200_000
    assert record["memcpy_gbps"] > 0 and record["bound_mparam_per_s"] > 0
    rows = record["sections"]["host memory"]["rows"]
    assert {(row["optimizer"], row["threads"]) for row in rows} == {
        (name, threads) for name in optimizer.optimizers(StateForm(state_dtype, master_dtype)) for threads in (1, 2)
    }
    for row in rows:
        assert row["Mparam/s"] > 0 and row["of bound"] > 0

    nvme = record["sections"]["nvme tier"]
    assert record["nvme_params"] == 320_000 and record["nvme"]["buffer_mb"] == 4
    (row,) = nvme["rows"]
    for key in ("step s", "compute s", "I/O bound s", "step/max", "of bound", "GB/s"):
        assert row[key] > 0, key
    details = nvme["details"]
    # 5 units of 64000 params, each padded to 65536: master, exp_avg and exp_avg_sq, read and written once
    assert details["bytes_read"] == details["bytes_written"] == 5 * 65536 * state_bytes
    assert row["B/param moved"] == 2 * row["B/param stored"] == 2 * 5 * 65536 * state_bytes / 320_000
    assert details["raw_read_gbps"] > 0 and details["raw_write_gbps"] > 0
    assert list(disk.iterdir()) == []  # the store and the raw benchmark file were removed


def test_plot_is_skipped_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    path = tmp_path / "plot.png"
    assert report.bar_chart(path, ["a"], {"s": [1.0]}, ylabel="y", title="t") is None
    assert not path.exists()


def test_checksum_quick(tmp_path: Path) -> None:
    checksum.main(["--out", str(tmp_path), "--quick", "--mb", "4", "--threads", "1", "2"])
    record = load_record(tmp_path, "checksum")
    rows = record["rows"]
    names = {row["checksum"] for row in rows}
    assert {(row["data"], row["threads"]) for row in rows} == {
        (d, t) for d in ("from memory", "in cache") for t in (1, 2)
    }
    assert len(rows) == 4 * len(names) and all(row["GB/s"] > 0 and row["x copy"] > 0 for row in rows)
    assert record["copy_gbps"] > 0 and record["cpu_model"]
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    assert len({f(data) for f in checksum.checksums().values()}) == 1, "every contestant computes the same CRC-32C"


@pytest.mark.parametrize(("plan", "extra"), [("s3-nvme-cpu", []), ("s3-cpu-cpu", ["--defer-update"])])
def test_copies_quick(plan: str, extra: list[str], tmp_path: Path) -> None:
    copies.main(["--out", str(tmp_path), "--quick", "--plans", plan, "--gbps", "0.05", *extra])
    record = load_record(tmp_path, "copies")
    assert record["defer_update"] == bool(extra)
    native = native_compute_dtype()[0]  # the plans leave precision.compute_dtype at "auto"
    assert {run["compute_dtype"] for run in record["runs"][plan].values()} == {native}
    (row,) = record["rows"]
    assert row["copy MB"] > 0 and row["copy s"] == pytest.approx(row["copy MB"] / 1e3 / 0.05)
    assert row["async s"] > 0 and row["sync s"] > 0 and 0 < row["overlap"] <= 1.5


def test_idle_time_is_what_no_span_covers() -> None:
    busy = [(5.0, 6.0), (1.0, 2.0), (1.5, 3.0)]
    assert copy_timeline.idle_s(busy, 0.0, 7.0) == pytest.approx(4.0)
    assert copy_timeline.idle_s(busy, 2.5, 5.5) == pytest.approx(2.0)
    assert copy_timeline.idle_s([], 1.0, 1.5) == pytest.approx(0.5)


def test_copy_timeline_quick(tmp_path: Path) -> None:
    copy_timeline.main(["--out", str(tmp_path), "--quick", "--gbps", "0.05"])
    record = load_record(tmp_path, "copy_timeline")
    assert record["compute_dtype"] == native_compute_dtype()[0]
    rows = {row["phase"]: row for row in record["rows"]}
    assert list(rows) == ["forward", "backward", "step", "whole step"]
    whole = rows["whole step"]
    assert whole["s"] > 0 and whole["up idle s"] < whole["s"] and whole["down idle s"] < whole["s"], (
        "both streams copied"
    )
    for row in rows.values():
        assert 0 <= row["both idle s"] <= min(row["up idle s"], row["down idle s"]) <= row["s"]


@pytest.mark.slow  # benchmarks.pretrained end to end: about 25 s
def test_pretrained_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from benchmarks import pretrained

    pretrained.main(["--quick", "--out", str(tmp_path), "--dir", str(tmp_path)])  # a 3-step fine-tune
    record = load_record(tmp_path, "pretrained")
    assert [row["phase"] for row in record["rows"]] == ["import", "finetune", "export"]
    for row in record["rows"]:
        assert row["read GB"] > 0 and row["written GB"] > 0 and row["GB/s"] > 0 and row["peak RSS GiB"] > 0
    tuned = record["finetune"]
    assert tuned["steps_done"] == 3 and tuned["resumed_the_import"] and len(tuned["seconds_per_step"]) == 3
    assert len(tuned["val_loss"]) == 3 and tuned["val_loss_last"] < tuned["val_loss_first"] and tuned["val_loss_fell"]
    assert tuned["peak_rss_bytes"] > 0 and tuned["bytes_read"] > 0 and tuned["bytes_written"] > 0
    reload = record["reload"]
    assert reload["config"] == "llama" and reload["equals_store"] and reload["changed"] and reload["from_pretrained"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bench-pretrained-")] == []


@pytest.mark.slow  # benchmarks.sft end to end: about 30 s
def test_sft_quick(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    from benchmarks import sft

    sft.main(["--quick", "--out", str(tmp_path), "--dir", str(tmp_path)])
    record = load_record(tmp_path, "sft")
    packed, unpacked = record["train"]
    assert (packed["data"], unpacked["data"]) == ("packed", "unpacked")
    assert packed["padding"] < unpacked["padding"] and packed["loss fraction"] > unpacked["loss fraction"]
    assert all(row["tokens/s"] > 0 and row["peak RSS GiB"] > 0 for row in record["train"])
    assert [row["loss"] for row in record["loss"]] == ["full", "chunked"]
    small, large = record["tokenize"]
    assert large["records"] > 5 * small["records"] and large["peak RSS GiB"] > 0
