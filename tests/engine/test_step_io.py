"""The stores' I/O in a step: a unit's chunks in flight on several I/O threads at once, and
what moving them cost the CPU, stage by stage, in the step statistics and the train log."""

from __future__ import annotations

import collections
import json
import threading
import time
from pathlib import Path

import pytest

from engine.config import Config
from engine.engine import Engine
from engine.run.train import train
from offload.chunks import FileOps
from offload.costs import STAGES
from tests.caches import fresh_cache
from tests.engine.test_nvme_tier import nvme_config, train_steps
from tests.training import tiny_gpt

IO = {"chunk_mb": 1, "io_threads": 4}


class ConcurrencyOps(FileOps):
    """Counts, for each unit of each generation, how many of its chunks are being read or
    written at the same moment; each call lingers a little so that parallel calls meet."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.units: dict[int, tuple[str, str]] = {}  # open chunk file -> (generation, unit)
        self.now: collections.Counter[tuple[str, str]] = collections.Counter()
        self.most: dict[str, collections.Counter[tuple[str, str]]] = {
            "read": collections.Counter(),
            "write": collections.Counter(),
        }

    def open(self, path, flags):
        fd = super().open(path, flags)
        parts = Path(path).parts
        if parts[-2] == "c":  # <generation>/<unit>/<kind>/c/<index>
            with self.lock:
                self.units[fd] = (parts[-5], parts[-4])
        return fd

    def close(self, fd):
        with self.lock:
            self.units.pop(fd, None)
        super().close(fd)

    def _counted(self, kind, fd, call):
        with self.lock:
            unit = self.units[fd]
            self.now[unit] += 1
            self.most[kind][unit] = max(self.most[kind][unit], self.now[unit])
        try:
            time.sleep(0.005)
            return call()
        finally:
            with self.lock:
                self.now[unit] -= 1

    def pwrite(self, fd, buf, offset):
        return self._counted("write", fd, lambda: super(ConcurrencyOps, self).pwrite(fd, buf, offset))

    def preadv(self, fd, buf, offset):
        return self._counted("read", fd, lambda: super(ConcurrencyOps, self).preadv(fd, buf, offset))


def test_a_units_chunks_are_read_and_written_on_several_threads_at_once(tmp_path) -> None:
    eng = Engine(tiny_gpt(), nvme_config(tmp_path, offload=IO), total_steps=2)
    ops = ConcurrencyOps()
    eng.optimizer_state.store._ops = ops
    train_steps(eng, 2)
    eng.close()
    units = {u.name for u in eng.layout.units}
    for kind in ("read", "write"):
        seen = {unit for _, unit in ops.most[kind]}
        assert seen == units, (kind, seen)
        # One I/O thread per unit would never have two of a unit's chunks in flight at once.
        assert max(ops.most[kind].values()) >= 2, (kind, ops.most[kind])


def test_each_steps_io_cpu_is_there_by_stage_and_adds_up(tmp_path) -> None:
    config = nvme_config(tmp_path, offload=IO, store={"defer_commit": False})
    eng = Engine(tiny_gpt(), config, total_steps=3)
    for _ in range(3):
        train_steps(eng, 1)
        stats = eng.last_step_stats
        assert set(stats.io_cpu_s) == set(STAGES)
        # Every byte the chunk I/O moved is one the tier read or wrote (writes land in the step).
        assert stats.io_bytes == stats.bytes_read + stats.bytes_written > 0
        assert stats.io_cpu_s["crc32c"] > 0 and sum(stats.io_cpu_s.values()) <= stats.cpu_s
        rates = stats.to_dict()["io_cpu_s_per_gb"]
        assert rates["total"] == pytest.approx(sum(stats.io_cpu_s.values()) / (stats.io_bytes / 1e9))
        assert rates["crc32c"] == pytest.approx(stats.io_cpu_s["crc32c"] / (stats.io_bytes / 1e9))
    eng.close()


def test_the_train_log_has_each_steps_io_cpu_per_gb(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    metrics = tmp_path / "metrics.jsonl"
    overrides = ["preset=tiny", "compute_dtype=fp32", "seq_len=32", "micro_batch=2", "log_every=1", "steps=2"]
    offload = ["stage=3", "offload.param=nvme", "offload.optimizer=nvme", "chunk_mb=1", "io_threads=4"]
    where = [f"nvme_path={tmp_path / 'store'}", f"metrics={metrics}", "defer_commit=false"]
    train(Config.from_dict({}, [*overrides, *offload, *where]))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["io_bytes"] == record["bytes_read"] + record["bytes_written"] > 0
        assert set(record["io_cpu_s_per_gb"]) == {*STAGES, "total"}
        assert record["io_cpu_s_per_gb"]["total"] > 0
