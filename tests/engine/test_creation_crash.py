"""A crash at any point of creating a generation resumes, unaided, to the committed step.

A fresh generation is created after every checkpoint of a store written by generations (no
superseded generation is left to recycle) and for every checkpoint of a store rewritten in
place (its copy). Here the run "crashes" at each filesystem change of that creation in turn,
before it and after it (every mkdir, rename and replace: each folder and metadata file of each
array, each staging and final rename), leaving the store exactly as a kill would; the next
resume must need no hand repair and continue bit-identically.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from offload.generations import Generations
from tests.engine.test_resume import params, run
from tests.training import config, tiny_gpt

CHANGES = ("mkdir", "rename", "replace")


def one_unit(root: Path, mode: str = "generations") -> Config:
    """The store at ``root/store``, every parameter in the root unit (3 arrays a generation)."""
    root.mkdir(parents=True, exist_ok=True)
    return config(
        zero={"unit_classes": ["GPT"]},
        offload={"optimizer": "nvme", "nvme_path": str(root / "store")},
        store={"mode": mode},
    )


class InjectedCrash(Exception):
    """Stands for the process dying at this instant."""


class Injector:
    """Counts filesystem changes while armed and fails at one of them (before or after it)."""

    def __init__(self, point: int):
        self.point, self.count, self.armed = point, 0, False

    def tick(self, when: str, name: str, args: tuple) -> None:
        if self.armed:
            self.count += 1
            if self.count == self.point:
                raise InjectedCrash(f"{when} {name}{args}")

    @contextlib.contextmanager
    def installed(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        with monkeypatch.context() as patch:
            for name in CHANGES:
                real = getattr(os, name)

                def changed(*args, _real=real, _name=name, **kwargs):
                    self.tick("before", _name, args)
                    result = _real(*args, **kwargs)
                    self.tick("after", _name, args)
                    return result

                patch.setattr(os, name, changed)
            yield

    def arm(self, monkeypatch: pytest.MonkeyPatch, owner: type, method: str) -> None:
        """Count only inside ``owner.method``: the creation under test."""
        real = getattr(owner, method)

        def armed(*args, **kwargs):
            self.armed = True
            try:
                return real(*args, **kwargs)
            finally:
                self.armed = False

        monkeypatch.setattr(owner, method, armed)


def die(eng: Engine) -> None:
    """Drop a crashed engine as the kernel drops a killed process: its lock and threads go."""
    eng._store_lock.release()
    eng.optimizer_state.runner.close()


def template(tmp_path: Path, mode: str) -> tuple[Path, list[dict[str, torch.Tensor]], list[float]]:
    """A store committed at step 1 (with checkpoint 'a' asked for, in generations mode), and a
    straight run's parameters after steps 0 to 3 and its losses."""
    straight = Engine(tiny_gpt(), one_unit(tmp_path / "straight"), total_steps=4)
    trajectory, losses = [params(straight)], []
    for _ in range(3):
        losses += run(straight, 1)
        trajectory.append(params(straight))
    straight.close()
    eng = Engine(tiny_gpt(), one_unit(tmp_path / "template", mode), total_steps=4)
    run(eng, 1)
    if mode == "generations":
        eng.save("a")  # kept by rename when step 2 commits: then gen-3 must be created afresh
    eng.close()
    return tmp_path / "template" / "store", trajectory, losses


@pytest.mark.slow  # in place 70 s, generations 9 s: kept out of the default run's 10 minutes
@pytest.mark.parametrize("mode", ["generations", "in-place"])
def test_a_crash_at_any_point_of_creating_a_generation_resumes_to_the_committed_step(
    tmp_path, monkeypatch, mode
) -> None:
    source, trajectory, losses = template(tmp_path, mode)
    creation = (Generations, "prepare") if mode == "generations" else (Generations, "create_like")
    crashes = 0
    for point in range(1, 1000):
        work = tmp_path / f"point-{point}"
        shutil.copytree(source, work / "store")
        cfg = one_unit(work, mode)
        injector = Injector(point)
        eng = Engine.resume(tiny_gpt(), cfg, total_steps=4)
        with monkeypatch.context() as patch, injector.installed(patch):
            injector.arm(patch, *creation)
            try:
                if mode == "generations":
                    run(eng, 1)
                    eng.flush()  # commits step 2, keeps step 1, creates the next generation
                else:
                    eng.save("a")  # a copy of the committed generation into a fresh one
            except InjectedCrash:
                crashed = True
            else:
                crashed = False
        if not crashed:
            eng.close()
            break
        crashes += 1
        die(eng)
        del eng

        resumed = Engine.resume(tiny_gpt(seed=5), cfg, total_steps=4)
        step = resumed.global_step
        assert step in (1, 2), f"point {point}"
        got = params(resumed)
        assert all(torch.equal(got[k], v) for k, v in trajectory[step].items()), (
            f"point {point}: not the committed step {step}"
        )
        assert run(resumed, 3 - step) == losses[step:], f"point {point}: the steps after resuming diverged"
        got = params(resumed)
        assert all(torch.equal(got[k], v) for k, v in trajectory[3].items()), f"point {point}: diverged after resuming"
        if mode == "in-place":
            resumed.save("a")  # the interrupted checkpoint can be taken again
        resumed.close()
        shutil.rmtree(work)
    assert crashes >= 20, f"only {crashes} crash points: the injection missed the creation"


def test_a_store_whose_first_commit_never_happened_is_replaced_by_the_next_run(tmp_path, monkeypatch) -> None:
    straight = Engine(tiny_gpt(), one_unit(tmp_path / "straight"), total_steps=4)
    losses = run(straight, 2)
    expected = params(straight)
    straight.close()

    cfg = one_unit(tmp_path / "run")
    with monkeypatch.context() as patch:
        patch.setattr(
            Generations,
            "commit",
            lambda *args, **kwargs: (_ for _ in ()).throw(InjectedCrash("before the first commit")),
        )
        with pytest.raises(InjectedCrash):
            Engine(tiny_gpt(), cfg, total_steps=4)
    gc.collect()  # the failed engine, and with it its lock, is gone as with a dead process
    store = tmp_path / "run" / "store"
    assert (store / "zarr.json").exists() and not (store / "COMMITTED").exists()

    eng = Engine(tiny_gpt(), cfg, total_steps=4)  # no hand repair: the abandoned store is replaced
    assert run(eng, 2) == losses
    got = params(eng)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    eng.close()
