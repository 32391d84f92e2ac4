"""``store.mode = "in-place"``: one generation rewritten each step. It trains bit-identically
to the generations mode on half the disk; a step cut short leaves the store dirty, refused
with its last checkpoint named; a graceful stop leaves it clean; its checkpoints are copies,
resumed from without being modified; and a store may change mode between runs."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from engine.run.data import load_tokens
from engine.run.train import build_model
from engine.tiers.store_checks import DirtyStoreError, check_nvme_path, store_bytes
from engine.tools.consolidate import consolidate
from engine.tools.inspect import inspect_store
from offload.generations import CheckpointExistsError
from offload.io import IORunner, OffloadIOError
from offload.manifest import read_committed
from offload.store import ShardStore
from tests.caches import fresh_cache
from tests.engine.test_checkpoints import assert_resumes_identically, file_hashes, kept
from tests.engine.test_crash import OVERRIDES, batches_for, fingerprint, train
from tests.engine.test_inspect import wide_gpt
from tests.engine.test_nvme_tier import FailingOps
from tests.engine.test_resume import nvme, params, run
from tests.ranks import run_ranks
from tests.training import config, tiny_gpt

IN_PLACE = {"mode": "in-place"}
REPO = Path(__file__).resolve().parents[2]


def in_place(tmp_path: Path, stage: int = 2, **sections) -> Config:
    return nvme(tmp_path, stage, store=IN_PLACE, **sections)


def in_place_chunks(tmp_path: Path, chunk_mb: int) -> Config:
    tmp_path.mkdir(parents=True, exist_ok=True)
    offload = {"optimizer": "nvme", "nvme_path": str(tmp_path / "store"), "chunk_mb": chunk_mb}
    return config(offload=offload, store=IN_PLACE)


def on_disk(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def live_generations(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir() if p.name.startswith("gen-"))


def same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def checkpoint_state(store: Path, tag: str) -> dict[str, torch.Tensor]:
    """Every array of checkpoint ``tag``, by name under the checkpoint."""
    prefix = f"checkpoints/{tag}/"
    with IORunner(threads=2) as runner:
        opened = ShardStore.open(store, runner=runner)
        state = {}
        for name in (n for n in opened.array_names() if n.startswith(prefix)):
            state[name[len(prefix) :]] = torch.empty(opened.array_info(name).numel)
            opened.read_into(name, 0, state[name[len(prefix) :]])
    return state


def assert_resumes_identically_from(cfg: Config, tag: str, expected_losses: list[float], expected: dict) -> None:
    resumed = Engine.resume(tiny_gpt(seed=99), cfg, total_steps=len(expected_losses), checkpoint=tag)
    step = resumed.global_step
    assert run(resumed, len(expected_losses) - step) == expected_losses[step:]
    assert same_params(params(resumed), expected)
    resumed.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_in_place_is_bit_identical_to_generations_on_half_the_disk(tmp_path, stage: int) -> None:
    results = {}
    for name, cfg in {"generations": nvme(tmp_path / "g", stage), "in-place": in_place(tmp_path / "i", stage)}.items():
        eng = Engine(tiny_gpt(), cfg, total_steps=4)
        results[name] = run(eng, 4), params(eng), eng.memory_report()["nvme"]
        eng.close()
    (losses, weights, nbytes), (losses_in_place, weights_in_place, nbytes_in_place) = results.values()
    assert losses_in_place == losses
    assert same_params(weights_in_place, weights)
    assert nbytes_in_place * 2 == nbytes
    assert 0.45 < on_disk(tmp_path / "i" / "store") / on_disk(tmp_path / "g" / "store") < 0.55
    assert live_generations(tmp_path / "i" / "store") == ["gen-0"], "the one generation, rewritten"
    assert read_committed(tmp_path / "i" / "store")["step"] == 4
    assert not (tmp_path / "i" / "store" / "DIRTY").exists()


def train_both_modes_on_ranks(root: str, steps: int) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    """Entry point for ``run_ranks``: each mode trains ``steps`` steps and keeps step 2."""
    out = {}
    for mode in ("generations", "in-place"):
        eng = Engine(tiny_gpt(), nvme(Path(root) / mode, store={"mode": mode}), total_steps=steps)
        losses = run(eng, 2)
        eng.save("step-2")
        losses += run(eng, steps - 2)
        out[mode] = losses, params(eng)
        eng.close()
    return out


def test_two_ranks_in_place_match_generations_and_copy_the_same_checkpoint(tmp_path) -> None:
    ranks = run_ranks(2, train_both_modes_on_ranks, str(tmp_path), 3)
    for result in ranks:
        (losses, weights), (losses_in_place, weights_in_place) = result["generations"], result["in-place"]
        assert losses_in_place == losses and same_params(weights_in_place, weights)
    renamed, copied = (checkpoint_state(tmp_path / mode / "store", "step-2") for mode in ("generations", "in-place"))
    assert renamed and same_params(copied, renamed), "each rank copied its share of the chunks"
    assert read_committed(tmp_path / "in-place" / "store" / "checkpoints" / "step-2")["step"] == 2


def test_a_checkpoint_is_a_copy_resumed_from_without_being_modified(tmp_path) -> None:
    cfg, store = in_place(tmp_path), tmp_path / "store"
    original = Engine(tiny_gpt(), cfg, total_steps=6)
    expected_losses = run(original, 3)
    original.save("step-3")
    assert kept(store) == ["step-3"], "nothing supersedes an in-place generation: it is copied at once"
    live = store / "gen-0"
    copied = store / "checkpoints" / "step-3"
    assert {k: v for k, v in file_hashes(copied).items() if "/c/" in k} == {
        k: v for k, v in file_hashes(live).items() if "/c/" in k
    }, "every chunk copied with its CRC-32C"
    expected_losses += run(original, 3)
    expected = params(original)
    original.close()
    before = file_hashes(copied)
    for _ in range(2):  # resumable again and again: its first step rewrites the live generation
        assert_resumes_identically(cfg, expected_losses, expected)
        assert read_committed(store)["step"] == 6
        assert file_hashes(copied) == before
        assert live_generations(store) == ["gen-0"]


def test_retention_and_tags_of_copied_checkpoints(tmp_path) -> None:
    store = tmp_path / "store"
    eng = Engine(tiny_gpt(), in_place(tmp_path, checkpoint={"keep": 2}), total_steps=6)
    for tag in ("z-first", "m-second", "a-third"):
        run(eng, 1)
        eng.save(tag)
    assert kept(store) == ["a-third", "m-second"]
    with pytest.raises(CheckpointExistsError, match="checkpoint 'a-third' already exists"):
        eng.save("a-third")
    eng.close()


def test_a_failed_step_leaves_the_store_dirty_and_refused(tmp_path) -> None:
    cfg, store = in_place(tmp_path), tmp_path / "store"
    eng = Engine(tiny_gpt(), cfg, total_steps=4)
    run(eng, 2)
    eng.flush()  # step 2 committed: step 3 is the one that fails
    ops = FailingOps("write", errno.ENOSPC)
    eng.optimizer_state.store._ops = ops
    ops.armed = True
    with pytest.raises(OffloadIOError):
        run(eng, 1)
        eng.flush()  # a write that fails behind the step surfaces here at the latest
    ops.armed = False
    with pytest.raises(DirtyStoreError, match="stopped while rewriting generation 0, committed at step 2"):
        eng.save("torn")
    eng.close()
    with pytest.raises(
        DirtyStoreError,
        match=rf"holds no checkpoint to resume from, so restore {store} from a backup, or start afresh over it with --overwrite",
    ):
        Engine.resume(tiny_gpt(), cfg, total_steps=4)
    with pytest.raises(DirtyStoreError):  # nor is a store in the generations mode read from it
        Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=4)
    with pytest.raises(DirtyStoreError):
        consolidate(store, tmp_path / "weights.safetensors")
    report = inspect_store(store)
    assert report["mode"] == "in-place" and "no checkpoint" in report["dirty"]


def test_switching_modes_between_runs(tmp_path) -> None:
    straight = Engine(tiny_gpt(), nvme(tmp_path / "a"), total_steps=6)
    expected_losses = run(straight, 6)
    expected = params(straight)
    straight.close()

    store = tmp_path / "b" / "store"
    eng = Engine(tiny_gpt(), nvme(tmp_path / "b"), total_steps=6)
    losses = run(eng, 2)
    eng.save("step-2")  # in the generations mode: pending until a step supersedes it
    eng.close()
    eng = Engine.resume(tiny_gpt(), in_place(tmp_path / "b"), total_steps=6)
    assert kept(store) == ["step-2"], "the pending keep is taken by copy: no step will supersede it"
    assert "keep" not in read_committed(store)
    losses += run(eng, 2)
    eng.close()
    assert len(live_generations(store)) == 1
    assert inspect_store(store)["mode"] == "in-place"
    eng = Engine.resume(tiny_gpt(), nvme(tmp_path / "b"), total_steps=6)  # and back
    losses += run(eng, 2)
    assert losses == expected_losses and same_params(params(eng), expected)
    eng.close()
    assert len(live_generations(store)) == 2 and inspect_store(store)["mode"] == "generations"
    assert_resumes_identically_from(nvme(tmp_path / "b"), "step-2", expected_losses, expected)


def test_another_chunk_size_writes_a_fresh_generation_then_rewrites_it(tmp_path) -> None:
    straight = Engine(wide_gpt(), in_place_chunks(tmp_path / "a", 1), total_steps=4)
    expected_losses = run(straight, 4)
    expected = params(straight)
    straight.close()

    store = tmp_path / "b" / "store"
    eng = Engine(wide_gpt(), in_place_chunks(tmp_path / "b", 1), total_steps=4)
    losses = run(eng, 2)
    eng.close()
    # Shards cut for other chunks cannot be rewritten where they lie: the first step writes a new generation.
    eng = Engine.resume(wide_gpt(), in_place_chunks(tmp_path / "b", 2), total_steps=4)
    losses += run(eng, 1)
    eng.flush()
    assert live_generations(store) == ["gen-1"], "the old one is dropped once the new one is committed"
    losses += run(eng, 1)
    eng.flush()
    assert live_generations(store) == ["gen-1"]
    assert losses == expected_losses and same_params(params(eng), expected)
    eng.close()


def test_the_disk_check_counts_one_generation_in_place(tmp_path, monkeypatch) -> None:
    eng = Engine(tiny_gpt(), in_place(tmp_path / "probe"), total_steps=1)
    layout = eng.layout
    eng.close()
    assert store_bytes(layout, "generations") == 2 * store_bytes(layout, "in-place")
    free = store_bytes(layout, "in-place") * 3 // 2
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free))
    with pytest.raises(
        OSError, match=r"2 generation\(s\) .* store.mode = 'generations'\) .* store.mode = \"in-place\" needs"
    ):
        check_nvme_path(tmp_path / "new", layout, "generations")
    check_nvme_path(tmp_path / "new", layout, "in-place")
    with pytest.raises(OSError, match="the store needs"):
        Engine(tiny_gpt(), nvme(tmp_path / "g"), total_steps=1)
    Engine(tiny_gpt(), in_place(tmp_path / "i"), total_steps=1).close()


# ----------------------------------------------------------- signals, from a real run

# Runs `python -m engine train` with ARGS and, right after the first write of the step after
# step 3 lands in the store, sends itself SIGNAL: a kill or a stop request mid-step.
CHILD = """
import os, signal, sys
from offload.manifest import read_committed
from offload.store import ShardStore
from engine.run.cli import main

sent = []
write_async = ShardStore.write_async

def write_then_signal(self, name, start, src, crcs=None):
    written = write_async(self, name, start, src, crcs)
    written.result()
    record = read_committed(self.path)
    if record and record["step"] >= 3 and not sent:
        sent.append(True)
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return written

ShardStore.write_async = write_then_signal
sys.exit(main(sys.argv[2:]))
"""


def train_and_signal(tmp_path: Path, store: Path, sig: str) -> subprocess.CompletedProcess:
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "XDG_CACHE_HOME": fresh_cache(tmp_path / "cache"),
        "PYTHONPATH": str(REPO),
    }
    args = [part for o in OVERRIDES for part in (f"--{o.split('=')[0]}", o.split("=")[1])]
    args += ["--nvme_path", str(store), "--store.mode", "in-place", "--checkpoint.interval", "2"]
    return subprocess.run(
        [sys.executable, "-c", CHILD, sig, "train", *args], env=env, capture_output=True, text=True, timeout=300
    )


class Reference:
    """The uninterrupted run (on the cpu tier): its parameters' fingerprint after every step."""

    def __init__(self) -> None:
        self.config = Config.from_dict({}, [*OVERRIDES, "offload.optimizer=cpu"])
        _, self.vocab = load_tokens(self.config.data.source)
        self.engine = Engine(build_model(self.config, self.vocab), self.config)
        self.data = batches_for(self.config, self.engine)
        self.prints = [fingerprint(self.engine)]

    def after(self, step: int) -> str:
        while len(self.prints) <= step:
            self.prints += train(self.engine, self.data, 1)
        return self.prints[step]

    def check_resumed(self, resumed: Engine) -> None:
        """``resumed`` holds the state after its step and stays on the trajectory for two more."""
        step = resumed.global_step
        assert fingerprint(resumed) == self.after(step)
        assert train(resumed, batches_for(self.config, resumed), 2) == [self.after(step + 1), self.after(step + 2)]


@pytest.mark.slow  # kept out of the default run's 10 minutes; CI runs it with the slow ones
def test_kill_nine_mid_step_leaves_a_dirty_store_that_names_its_checkpoint(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    store = tmp_path / "store"
    child = train_and_signal(tmp_path, store, "SIGKILL")
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert read_committed(store)["step"] == 3 and kept(store) == ["step-2"]
    again = train_and_signal(tmp_path, store, "SIGKILL")  # `python -m engine train` once more: from step-2
    assert again.returncode == -signal.SIGKILL, again.stderr[-3000:]
    assert "resuming from its last checkpoint, step-2" in again.stderr
    assert read_committed(store)["step"] == 3 and kept(store) == ["step-2"]
    cfg = Config.from_dict({}, [*OVERRIDES, f"nvme_path={store}", "store.mode=in-place"])
    reference = Reference()
    with pytest.raises(
        DirtyStoreError, match=r"`python -m engine train --from-checkpoint step-2` \(in Python: .*checkpoint='step-2'\)"
    ):
        Engine.resume(build_model(cfg, reference.vocab), cfg)
    assert "'step-2'" in inspect_store(store)["dirty"]
    before = file_hashes(store / "checkpoints" / "step-2")
    resumed = Engine.resume(build_model(cfg, reference.vocab), cfg, checkpoint="step-2")
    assert resumed.global_step == 2
    reference.check_resumed(resumed)
    resumed.close()
    assert file_hashes(store / "checkpoints" / "step-2") == before
    assert inspect_store(store)["dirty"] is None, "the step from the checkpoint rewrote the store whole"
    reference.engine.close()


def test_sigterm_mid_step_finishes_it_and_leaves_a_clean_store(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    store = tmp_path / "store"
    child = train_and_signal(tmp_path, store, "SIGTERM")
    assert child.returncode == 0, child.stderr[-3000:]
    assert "stopping after the step in flight" in child.stderr
    assert read_committed(store)["step"] == 4, "the step in flight was finished and committed"
    assert inspect_store(store)["dirty"] is None and not (store / "DIRTY").exists()
    cfg = Config.from_dict({}, [*OVERRIDES, f"nvme_path={store}", "store.mode=in-place"])
    reference = Reference()
    resumed = Engine.resume(build_model(cfg, reference.vocab), cfg)
    assert resumed.global_step == 4
    reference.check_resumed(resumed)
    resumed.close()
    reference.engine.close()
