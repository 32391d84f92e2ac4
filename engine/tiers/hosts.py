"""A run on several hosts with a store on each (``offload.nvme_path`` holding ``{node}``):
the steps are committed together, and a resume starts from the newest step every host holds.

Each host's store holds the shards of the ranks on that host, in the layout of one store, and
its own ``COMMITTED``. A step commits in two rounds (``StoreOptimizerState._commit``): every
host makes its generation durable, the hosts agree (a barrier), each host's leader moves its
``COMMITTED``, which keeps the record it replaces (``Generations.commit(together=True)``); the
hosts agree again, and only then is the superseded generation recycled or kept. So a crash at
any instant leaves every host at step N or N + 1, for one N, and a host at N + 1 still holds
step N's generation and record.

A resume gathers what each host's store holds (``agree_on_resume``, read-only, before any
lock), takes the newest step all hold, and has each host past it go back one commit
(``roll_back``, once its lock is taken). Anything else is refused, naming every host and what
its store holds, before anything is written: a store missing, a host behind by more than the
protocol allows, stores written by another number of hosts (``python -m engine gather`` makes
them one store).
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from pathlib import Path

from engine.config import Config
from engine.runtime.comm import Comm
from engine.tiers.store_io import HOSTS_ATTR, StoreIO
from offload import Generations, IORunner, ShardStore, group_attrs

GATHER = "python -m engine gather"
"""The command that makes the stores of several hosts one store (``engine.tools.gather``)."""


@dataclass(frozen=True)
class HostStore:
    """What one host's store holds, as its leader finds it."""

    node: int
    host: str
    path: str
    step: int | None = None
    """The committed step (None: no store, or none committed)."""
    previous: int | None = None
    """The step before it, while the store still holds it (it can roll back to it)."""
    nodes: int | None = None
    """How many hosts' stores the run was written to, as the store records it."""
    holds: int | None = None
    """The host whose part of the run the store records it holds."""
    tags: tuple[str, ...] = ()
    problem: str | None = None
    """Why the store cannot be resumed on its own (missing, unreadable)."""

    def describe(self) -> str:
        where = f"host {self.node} ({self.host}, {self.path})"
        if self.problem:
            return f"{where}: {self.problem}"
        if self.step is None:
            return f"{where}: no committed step"
        behind = f" (and step {self.previous} before it)" if self.previous is not None else ""
        return f"{where}: step {self.step}{behind}"


def survey(path: Path, node: int) -> HostStore:
    """What the store at ``path`` holds, without changing it."""
    found = HostStore(node, socket.gethostname(), str(path))
    if not (path / "zarr.json").is_file():
        return dataclasses.replace(found, problem="no store there (deleted, or never made)")
    try:
        with IORunner(threads=1) as runner:
            store = ShardStore.open(path, runner=runner)
            generations = Generations(store)
            record, previous = generations.committed(), generations.previous()
            recorded = store.attrs.get(HOSTS_ATTR, {"node": 0, "nodes": 1})
            tags = tuple(generations.checkpoints())
    except (OSError, ValueError) as err:
        return dataclasses.replace(found, problem=f"unreadable ({err})")
    step = record.get("step") if record else None
    before = previous.get("step") if previous else None
    nodes, holds = recorded.get("nodes"), recorded.get("node")
    return dataclasses.replace(found, step=step, previous=before, nodes=nodes, holds=holds, tags=tags)


def agree_on_resume(config: Config, comm: Comm, io: StoreIO, checkpoint: str | None) -> int | None:
    """The step every host resumes from, agreed by all ranks (None: one store holds the run, or
    the run resumes from checkpoint ``checkpoint``, which every host's store holds); refused, on
    every rank alike, naming each host and what its store holds, when no such step exists. A
    store a run on several hosts wrote is refused on one host, naming ``GATHER``. Nothing is written."""
    path = Path(config.offload.store_path)
    if io.hosts == 1:
        check_whole(path, "resume on those hosts, or make their stores one")
        return None
    mine = survey(path, comm.node) if io.leader else None
    stores = sorted((s for s in comm.all_gather_object(mine) if s is not None), key=lambda s: s.node)
    if checkpoint is None:
        return common_step(stores, io.hosts)
    common_step(stores, io.hosts, any_step=True)
    without = [s for s in stores if checkpoint not in s.tags]
    if without:
        raise FileNotFoundError(
            f"checkpoint {checkpoint!r} is not in the store of host {without[0].node} ({without[0].path}): a "
            f"checkpoint is resumed on every host or none; pass a tag every host holds"
        )
    return None


def check_whole(path: Path, way_out: str) -> None:
    """Refuse the store at ``path`` if it holds only one host's part of a run (``way_out``: what
    to do instead, before the ``GATHER`` command that makes the parts one)."""
    try:
        recorded = group_attrs(path).get(HOSTS_ATTR, {})
    except (OSError, ValueError):  # no store, or a damaged one: opening it says so, naming the file
        return
    if recorded.get("nodes", 1) != 1:
        raise ValueError(
            f"store {path} holds host {recorded.get('node')}'s part of a run on {recorded['nodes']} hosts: "
            f"{way_out} with `{GATHER} OUT STORE...`"
        )


def common_step(stores: list[HostStore], hosts: int, any_step: bool = False) -> int:
    """The newest step the stores of the ``hosts`` hosts of one run all hold (``any_step``: only
    check they are those stores); refused, naming each and what it holds, where there is none."""
    held = "; ".join(s.describe() for s in stores)
    lost = [s for s in stores if s.problem]
    if lost:
        raise FileNotFoundError(
            f"the store of host {lost[0].node} ({lost[0].path}) is missing or unreadable, so the run cannot go on "
            f"from its {len(stores)} stores: {held}; restore it from a copy, or start the run afresh in new folders"
        )
    others = [s for s in stores if s.nodes != hosts]
    if others:
        raise ValueError(
            f"the stores were written by a run on {others[0].nodes} host(s), not {hosts}: {held}; use the stores of "
            f"all {others[0].nodes} hosts, or make them one with `{GATHER} OUT STORE...` and resume from OUT"
        )
    swapped = [s for s in stores if s.holds != s.node]
    if swapped:
        raise ValueError(
            f"the store of host {swapped[0].node} ({swapped[0].path}) holds the part of host {swapped[0].holds}: "
            f"{held}; give each host its own store back"
        )
    newest_common = min(s.step if s.step is not None else -1 for s in stores)
    behind = [s for s in stores if s.step not in (newest_common, newest_common + 1)]
    ahead_without = [s for s in stores if s.step == newest_common + 1 and s.previous != newest_common]
    if not any_step and (newest_common < 0 or behind or ahead_without):
        raise ValueError(
            f"the stores of the {len(stores)} hosts hold no step in common, so the run cannot go on: {held}; a "
            f"crash leaves hosts at most one step apart, so a store was changed or replaced outside the run: "
            f"restore the stores of one run, or start afresh in new folders"
        )
    return newest_common


def roll_back(path: str, step: int | None, comm: Comm, io: StoreIO) -> None:
    """Bring each host's store at ``path`` back to ``step`` (None: nothing to agree on) where
    it committed the one after: by its leader, holding its lock; every rank hears of a failure."""

    def go_back() -> None:
        with IORunner(threads=1) as runner:
            generations = Generations(ShardStore.open(path, runner=runner))
            record = generations.committed()
            if record is not None and record.get("step") != step:
                generations.roll_back()

    if step is not None:
        comm.on_leader(go_back, leader=io.leader)


def any_resumes(resume: bool, checkpoint: str | None) -> tuple[bool, str | None]:
    """Where this host found its store (``store_checks.resume_point``), as every host continues:
    from its store if any host's holds a step, so that a host whose store is missing is refused
    by ``agree_on_resume``, never started afresh beside hosts that resume."""
    comm = Comm.join()  # the group the engine then joins
    found = [point for point in comm.all_gather_object((resume, checkpoint)) if point[0]]
    return found[0] if found else (False, None)
