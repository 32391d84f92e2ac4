"""Generations: the next write target is recycled by rename, never the committed one."""

from __future__ import annotations

import torch

from offload.generations import Generations
from offload.io import IORunner
from offload.store import ShardStore


def make(tmp_path):
    runner = IORunner(threads=2)
    store = ShardStore.create(tmp_path / "s", {}, runner=runner)
    return store, Generations(store), [], runner


def make_creator(store, created: list[str]):
    def create(prefix: str) -> None:
        created.append(prefix)
        store.create_array(f"{prefix}/u/master", 4096, 4096, torch.float32)

    return create


def test_prepare_creates_then_recycles_the_superseded_generation(tmp_path) -> None:
    store, gens, created, runner = make(tmp_path)
    create = make_creator(store, created)
    assert gens.committed() is None
    gens.prepare(0, create)
    store.write_from("gen-0/u/master", 0, torch.full((4096,), 1.0))
    store.sync()
    gens.commit(0, {"step": 0})
    gens.prepare(1, create)
    assert created == ["gen-0", "gen-1"]
    store.write_from("gen-1/u/master", 0, torch.full((4096,), 2.0))
    store.sync()
    gens.commit(1, {"step": 1})
    gens.prepare(2, create)  # gen-0 is superseded: renamed, not created
    assert created == ["gen-0", "gen-1"]
    assert gens.on_disk() == [1, 2]
    assert gens.committed() == {"generation": 1, "step": 1}
    out = torch.empty(4096)
    store.read_into("gen-1/u/master", 0, out)
    assert torch.equal(out, torch.full((4096,), 2.0)), "the committed generation is never touched"
    gens.prepare(2, create)  # idempotent: a crash between commit and prepare is harmless
    assert gens.on_disk() == [1, 2]
    runner.close()


def test_uncommitted_leftover_is_recycled_after_a_crash(tmp_path) -> None:
    store, gens, _, runner = make(tmp_path)
    create = make_creator(store, [])
    gens.prepare(0, create)
    store.sync()
    gens.commit(0, {"step": 0})
    gens.prepare(1, create)
    # a crash mid-step left gen-1 half written and uncommitted; the next run targets gen-1 again
    gens.prepare(1, lambda p: (_ for _ in ()).throw(AssertionError("must not create")))
    assert gens.on_disk() == [0, 1]
    runner.close()
