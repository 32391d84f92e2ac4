"""The I/O settings every store a run opens shares, built once from the config.

The optimizer tier, the parameter tier and the memory tiers' checkpoints all read and write
through one ``IORunner``: one pool of I/O threads for the process, so ``offload.io_threads``
bounds the threads the run starts, whichever tiers are on disk. The engine closes it once,
after every tier.

``offload.chunk_mb`` and ``offload.io_threads`` may be ``"auto"``: ``settle_io`` turns them
into numbers before anything is built, from the machine's I/O profile of the store's disk
(``offload.tuning``, measured once per disk), except that a resumed store keeps the chunk
size its layout was cut with.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import Config, OffloadConfig
from engine.runtime.comm import Comm
from engine.runtime.sizes import FP32, MIB
from engine.state.partition import ModelLayout
from engine.tiers.sizing import AUTO_BUFFER_FLOOR_MB
from offload import CHUNK_RANGE, CostAccount, IORunner, IOSettings, auto_settings, group_attrs

logger = logging.getLogger(__name__)

HOSTS_ATTR = "hosts"
"""The store attribute of a node-local store: ``{"node", "nodes"}``, which host's part of the run it holds."""


@dataclass(frozen=True)
class StoreIO:
    """How the tiers' stores move bytes: the shared runner, checksums, direct I/O, the barrier
    that orders the ranks' work on a store, which rank does a store's one-writer duties, and the
    one cost account of every store's I/O (``offload.costs``), which the step statistics take
    each step."""

    runner: IORunner
    checksum: bool
    direct_io: bool
    barrier: Callable[[], None]
    leader: bool = True
    """Whether this rank creates, commits and recycles its store's generations: global rank 0
    of a store every rank shares, the lowest rank on each host of node-local stores."""
    hosts: int = 1
    """How many stores commit each step together: the hosts of node-local stores, else 1."""
    node: int = 0
    """The host this rank is on."""
    costs: CostAccount = field(default_factory=CostAccount)
    stripes: tuple[Path, ...] = ()
    """The store's other folders (``offload.nvme_path`` a list), holding shares of its chunks."""

    @classmethod
    def from_config(cls, offload: OffloadConfig, comm: Comm, node_local: bool) -> StoreIO:
        """The settings of ``offload`` for this rank; ``node_local``: each host has its own store."""
        if offload.io_threads == "auto":
            raise ValueError('offload.io_threads = "auto" must be settled first (engine.tiers.store_io.settle_io)')
        leader = comm.node_leader if node_local else comm.rank == 0
        hosts = comm.nodes if node_local else 1
        runner = IORunner(threads=offload.io_threads)
        stripes = tuple(Path(p) for p in offload.stripe_paths)
        return cls(runner, offload.checksum, offload.direct_io, comm.barrier, leader, hosts, comm.node, stripes=stripes)

    def stripes_of(self, folder: str = "") -> tuple[Path, ...]:
        """The other folders of the store nested at ``folder`` of the run's store (its own: "")."""
        return tuple(p / folder for p in self.stripes) if folder else self.stripes

    def host_attrs(self) -> dict[str, dict[str, int]]:
        """What a new store records of the hosts it belongs with (``HOSTS_ATTR``): the node it is
        on and how many stores hold the run between them; nothing for a store that holds it all."""
        return {HOSTS_ATTR: {"node": self.node, "nodes": self.hosts}} if self.hosts > 1 else {}

    def close(self) -> None:
        """Finish the pending I/O and stop the threads (after every tier is closed)."""
        self.runner.close()


def stored_chunk_mb(path: Path) -> int | None:
    """The ``chunk_mb`` that cuts the layout recorded in the store at ``path`` as it is cut
    (the MiB holding its largest chunk), or None where there is no store with a layout."""
    try:
        layout = ModelLayout.from_dict(group_attrs(path)["layout"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # With at most this many MiB a chunk, every shard is cut into as many chunks as before: the
    # largest chunk fits, and no more chunks than before can be needed, since this is no more than
    # the chunk size the store was made with.
    return -(-max(u.chunk_numel for u in layout.units) * FP32 // MIB)


def settle_io(config: Config, *, resume: bool, measure: bool = True) -> tuple[Config, str]:
    """``config`` with ``auto`` I/O settings replaced by numbers, and one line saying what was
    chosen and why. Measures the store's disk (a few seconds) if ``measure``, a disk tier is
    configured and the machine's profile does not know that disk yet."""
    o = config.offload
    chunk, threads = o.chunk_mb, o.io_threads
    if chunk != "auto" and threads != "auto":
        return config, f"I/O: {chunk} MiB chunks x {threads} threads, set in the config"
    path = Path(o.store_path)
    reasons = []
    kept = stored_chunk_mb(path) if resume and chunk == "auto" else None
    if kept is not None:
        chunk = kept
        reasons.append("chunk size kept from the store's layout")
    if chunk == "auto" or threads == "auto":
        on_disk = o.uses_store
        buffer_mb = AUTO_BUFFER_FLOOR_MB if o.buffer_mb == "auto" else o.buffer_mb  # auto is never less
        max_chunk = max(CHUNK_RANGE[0], min(CHUNK_RANGE[1], buffer_mb // 3))
        auto: IOSettings = auto_settings(
            path, max_chunk_mb=max_chunk, measure=measure and on_disk, direct_io=o.direct_io
        )
        chunk = auto.chunk_mb if chunk == "auto" else chunk
        threads = auto.io_threads if threads == "auto" else threads
        reasons.append(auto.why)
    settled = dataclasses.replace(config, offload=dataclasses.replace(o, chunk_mb=chunk, io_threads=threads))
    why = f"I/O: {chunk} MiB chunks x {threads} threads ({'; '.join(reasons)})"
    return settled, why


def settle_for_ranks(config: Config, resume: bool, comm: Comm) -> Config:
    """``config`` as this rank runs it: ``offload.nvme_path`` its host's store (``{node}``
    replaced), and ``settle_io`` on rank 0 (the only one that may measure), its choice on every
    rank: the layout's chunk size must be one on all of them. Logs the line saying why."""
    config = dataclasses.replace(config, offload=config.offload.on_node(comm.node))
    settled = comm.all_gather_object(comm.on_leader(lambda: settle_io(config, resume=resume)))[0]
    assert settled is not None  # rank 0 always returns, or raises on every rank
    chosen, why = settled
    if comm.rank == 0:
        logger.info("%s", why)
    chunk_mb, io_threads = chosen.offload.chunk_mb, chosen.offload.io_threads
    return dataclasses.replace(
        config, offload=dataclasses.replace(config.offload, chunk_mb=chunk_mb, io_threads=io_threads)
    )
