"""The heap benchmark: each setting timed in a process of its own, the setting made there
before torch allocates, glibc's run left without the engine's (nor torch's huge pages, even
where the process that runs the benchmark has them on)."""

from __future__ import annotations

import os

import pytest

from benchmarks import heap
from engine.runtime.heap import TORCH_HUGE_PAGES
from engine.runtime.heap_bound import KEEP_MIN


@pytest.mark.slow  # three processes that each load torch and transformers
def test_each_setting_runs_in_its_own_process_with_its_own_heap(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv(TORCH_HUGE_PAGES, "1")  # as a process that called tune_heap has it
    payload = heap.main(["--quick", "--thresholds-mb", "1", "64", "--out", str(tmp_path)])
    (own,), (one,), (sixty_four,) = payload["runs"].values()
    kept = one["kept_mb"]
    assert [row["heap"] for row in payload["rows"]] == [
        "glibc's own",
        f"mapped from 1 MiB, kept within {kept} MiB",
        f"mapped from 64 MiB, kept within {kept} MiB",
    ]
    assert kept >= KEEP_MIN >> 20 and own["kept_mb"] is None, "the engine's heap is bounded, glibc's is not"
    assert own["mapped_from_mb"] is None and not own["huge_pages"]
    assert (one["mapped_from_mb"], sixty_four["mapped_from_mb"]) == (1, 64) and one["huge_pages"]
    assert all(run["seconds"] > 0 and run["peak_rss_bytes"] > 0 for run in (own, one, sixty_four))
    assert payload["rows"][0]["x glibc"] == 1.0
    assert (tmp_path / "heap.json").exists() and os.environ[TORCH_HUGE_PAGES] == "1"
