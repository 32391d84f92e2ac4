"""A full disk stops a run with a message naming the store, what it still holds and the fix,
and the same command continues once there is room."""

from __future__ import annotations

import errno

import pytest

import offload.generations
from engine.config import Config
from engine.run.train import train
from tests.caches import fresh_cache

OVERRIDES = ["preset=tiny", "compute_dtype=fp32", "seq_len=32", "micro_batch=2", "log_every=1"]


def test_a_full_disk_names_the_store_and_the_step_it_holds(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    store = tmp_path / "store"
    config = Config.from_dict({}, [*OVERRIDES, f"nvme_path={store}", "steps=6"])
    commit = offload.generations.commit
    commits = []

    def commit_until_full(path, record, name="COMMITTED"):
        commits.append(record.get("step") if name == "COMMITTED" else name)  # also the NEW mark, first
        if len(commits) == 5:  # the NEW mark, generation 0, steps 1 and 2, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        commit(path, record, name)

    monkeypatch.setattr(offload.generations, "commit", commit_until_full)
    with pytest.raises(
        OSError,
        match=rf"the disk of {store} is full .*larger disk.*it still holds step 2, and the same command continues",
    ) as full:
        train(config)
    assert full.value.errno == errno.ENOSPC and "\n" not in str(full.value)
    del full  # its traceback holds the engine, and with it the store's lock
    monkeypatch.setattr(offload.generations, "commit", commit)
    result = train(config)
    assert result.steps_done == 6 and len(result.losses) == 4, "continued from step 2"
