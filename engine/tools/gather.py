"""``python -m engine gather OUT STORE...``: the stores of a run's hosts made one store.

A run on several hosts with node-local stores (``offload.nvme_path`` holding ``{node}``)
leaves on each host a store with the full layout of arrays but only the chunks of that host's
ranks. Every chunk belongs to exactly one rank, so the union of their files is the store one
host would have written: copying them side by side into a new folder makes a store that
resumes on any number of hosts and ranks, and that ``consolidate``, ``export`` and
``inspect`` read. The copy is taken at the newest step every host holds
(``engine.tiers.hosts.common_step``), as a resume on the hosts would; the stores themselves
are only read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from engine.tiers.hosts import check_whole, common_step, survey
from engine.tiers.parameters import PARAM_STORE
from engine.tiers.store_io import HOSTS_ATTR
from offload import Generations, IORunner, ShardStore
from offload.lock import LOCK_FILE
from offload.nodes import STAGING, TRASH
from offload.stripes import make_one_folder

logger = logging.getLogger(__name__)

SKIPPED = (LOCK_FILE, PARAM_STORE)
"""Top-level entries not gathered: a host's writer lock, and the parameter shards, which a
resume derives again from the masters."""


def gather(out: str | os.PathLike[str], stores: Sequence[str | os.PathLike[str]], link: bool = False) -> int:
    """Copy the stores of every host of one run into one new store at ``out``; the step it holds.
    With ``link`` the files are hard links where the filesystem allows (nothing is copied): for a
    store only read, since a write into a linked chunk would change the host's store too."""
    out, paths = Path(out), [Path(p) for p in stores]
    if out.exists():
        raise FileExistsError(f"{out} exists: gather writes a new store; name a folder that does not exist yet")
    found = [survey(path, node) for node, path in enumerate(paths)]
    # Passed in any order: each store is taken as the host it records.
    found = sorted(
        (dataclasses.replace(s, node=s.node if s.holds is None else s.holds) for s in found), key=lambda s: s.node
    )
    if [s.node for s in found] != list(range(len(paths))):
        raise ValueError(
            f"the stores are hosts {[s.node for s in found]} of a run: pass the store of every host once, and only those"
        )
    step = common_step(found, len(paths))
    staging = out.with_name(f".{out.name}.gathering")
    shutil.rmtree(staging, ignore_errors=True)  # a gather that was interrupted
    with IORunner(threads=1) as runner:
        for path in paths:  # every folder of a store striped across several, into the one
            for folder in ShardStore.open(path, runner=runner).paths:
                _copy_missing(folder, staging, link)
        make_one_folder(staging)
        store = ShardStore.open(staging, runner=runner)
        generations = Generations(store)
        record = generations.committed()
        if record is not None and record.get("step") != step:
            generations.roll_back()  # this host's store had committed a step the others had not
        store.update_attrs({HOSTS_ATTR: {"node": 0, "nodes": 1}})
        store.sync()
    os.rename(staging, out)
    logger.info("gathered %d hosts' stores into %s at step %d", len(paths), out, step)
    return step


def _copy_missing(source: Path, target: Path, link: bool) -> None:
    """Copy (or ``link``) every file of ``source`` that ``target`` lacks (the first store copies
    whole; the others add their hosts' chunks), leaving out what ``SKIPPED`` names and leftovers."""
    for folder, dirs, files in os.walk(source):
        relative = Path(folder).relative_to(source)
        if relative == Path("."):
            dirs[:] = [d for d in dirs if d not in SKIPPED and not d.startswith((STAGING, TRASH))]
            files = [f for f in files if f not in SKIPPED]
        (target / relative).mkdir(parents=True, exist_ok=True)
        for name in files:
            if not (target / relative / name).exists() and not name.endswith(".tmp"):
                _place(Path(folder) / name, target / relative / name, link)


def _place(source: Path, target: Path, link: bool) -> None:
    if link:
        try:
            os.link(source, target)
            return
        except OSError:  # another filesystem, or one without hard links: copied instead
            pass
    shutil.copy2(source, target)


@contextlib.contextmanager
def gathered(stores: Sequence[str | os.PathLike[str]]) -> Iterator[Path]:
    """One store to read the stores of a run's hosts as (for ``consolidate`` and ``export``): the
    store itself if one holding the whole run is given; else a gather beside the first, of hard
    links where it can be, removed afterwards. A single host's part alone is refused."""
    if len(stores) == 1:
        check_whole(Path(stores[0]), "pass the stores of all its hosts, or make them one")
        yield Path(stores[0])
        return
    with tempfile.TemporaryDirectory(dir=Path(stores[0]).parent, prefix=".gather-") as scratch:
        out = Path(scratch) / "store"
        gather(out, stores, link=True)
        yield out
