"""Gradient shards spilled to disk while the update waits for every gradient.

With clipping or loss scaling no unit can be updated before the global gradient norm (or the
overflow check) is known, which needs every gradient; kept in memory until then, the rank's
fp32 gradient shards of the whole model are 4 bytes a parameter of host RAM. With the
optimizer state on nvme they go to disk instead: each unit's final shard is written to this
rank's scratch store as soon as backward has made it (after the step has taken what it needs
from it: its norm, its overflow check) and freed; at the step each comes back in update order,
read ahead beside its optimizer state, so host memory holds only the read-ahead window.

The scratch store is ``<offload.nvme_path>/scratch/rank-<r>``: outside every generation and
checkpoint, made by the first step (a start refused for a damaged store leaves none), never
fsynced, rewritten every step, removed at ``close`` and swept by the store's writer on resume
(``offload.nodes``), so no crash can leave it where a commit would read it.
Bytes move through the same pipeline (``offload.pipeline``) and chunk route (O_DIRECT, CRC-32C)
as the optimizer state's, through the run's one I/O runner.

With ``offload.grad_spill_dtype = "bf16"`` a shard is stored as bfloat16, rounded to nearest
as a bf16 reduction would leave it (FSDP2's ``reduce_dtype``): a gradient is used once, so
rounding's error does not pile up as it would in a master or a moment, which round
stochastically. On one rank computing in bfloat16 with no accumulation the gradients are
bucketed in bfloat16 from the start (``gradient_dtype``): nothing is widened, summed or
rounded between autograd and the spill. The cast is a quarter of the stochastic
rounding's time (0.13 against 0.51 ns a parameter on 2 threads), spent inside backward. The
update widens the shard back to fp32 in its own pass (``engine.zero.optim.ShardAdamW.update``,
``engine.zero.compact_update``). Disk, I/O and the pool then take 2 bytes a parameter, not 4.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from engine.config import Config, spills_gradients
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.sizing import spill_dtype
from engine.tiers.store_io import StoreIO
from offload import SCRATCH, TOP, BufferPool, HostBuffer, Pipeline, ReadAhead, ShardStore, array_name, shard_bytes

logger = logging.getLogger(__name__)

GRAD = "grad"
"""The kind of a spilled gradient shard's array."""


def scratch_path(nvme_path: str | Path, rank: int) -> Path:
    """The folder of ``rank``'s scratch store under the store at ``nvme_path``."""
    return Path(nvme_path) / SCRATCH / f"rank-{rank}"


def scratch_disk_bytes(config: Config, units: Sequence[UnitLayout]) -> int:
    """Disk the run's spilled gradients take in the scratch folder, all ranks: 4 or 2 bytes a
    parameter (``offload.grad_spill_dtype``), or none where nothing is spilled."""
    return spill_dtype(config.offload).itemsize * sum(u.padded_numel for u in units) if spills_gradients(config) else 0


def grad_bytes(unit: UnitLayout, dtype: torch.dtype = torch.float32) -> int:
    """Host (and disk) bytes of one rank's spilled gradient shard of ``unit``, stored as ``dtype``."""
    return shard_bytes(unit, dtype)


class GradSpill:
    """One rank's spilled gradient shards: written during backward, read back at the step."""

    def __init__(
        self,
        nvme_path: str | Path,
        layout: ModelLayout,
        rank: int,
        io: StoreIO,
        *,
        buffer_bytes: int,
        dtype: torch.dtype = torch.float32,
    ):
        self.dtype = dtype
        self.root = scratch_path(nvme_path, rank)
        self._layout, self._io = layout, io
        self._stripes = io.stripes_of(str(self.root.relative_to(nvme_path)))  # spread like the store's own chunks
        self._store: ShardStore | None = None
        self.pool = BufferPool(buffer_bytes, pin=False)  # host only: no copy to the device reads it
        self.pipeline: Pipeline[UnitLayout] = Pipeline(self.pool, io.runner, window_bytes=buffer_bytes // 2)
        self._bytes_read = self._bytes_written = 0

    @property
    def store(self) -> ShardStore:
        """The scratch store, once the first step has made it (``begin``)."""
        assert self._store is not None, "a step begins before it spills"
        return self._store

    def _create(self) -> ShardStore:
        """The scratch store, made at the first step rather than at start: a start that is
        refused (a damaged store found while resuming) leaves no folder behind."""
        io = self._io
        for folder in (self.root, *self._stripes):
            folder.parent.mkdir(exist_ok=True)
        store = ShardStore.create(
            self.root,
            {},
            runner=io.runner,
            checksum=io.checksum,
            direct_io=io.direct_io,
            overwrite=True,
            scratch=True,
            costs=io.costs,
            stripes=self._stripes,
        )
        for unit in self._layout.units:
            store.create_array(array_name(TOP, unit.name, GRAD), unit.shard_numel, unit.chunk_numel, self.dtype)
        return store

    def _view(self, unit: UnitLayout, buf: HostBuffer) -> torch.Tensor:
        return buf.view(self.dtype, unit.shard_numel)

    def _save(self, unit: UnitLayout, buf: HostBuffer) -> None:
        self.store.write_from(array_name(TOP, unit.name, GRAD), 0, self._view(unit, buf))

    def _load(self, unit: UnitLayout, buf: HostBuffer) -> None:
        self.store.read_into(array_name(TOP, unit.name, GRAD), 0, self._view(unit, buf))

    def begin(self) -> None:
        """A step starts spilling: the writes of a step that never read them back (skipped on
        overflow) land first, so that none lands over this step's shards."""
        self.pipeline.drain()
        if self._store is None:
            self._store = self._create()

    def write(self, unit: UnitLayout, grad: torch.Tensor) -> float:
        """Copy the unit's final shard into a pool buffer (cast to the spill's dtype) and write it
        behind backward (the caller frees ``grad`` at once); the seconds this waited for room in
        the pool."""
        start = time.perf_counter()
        buf = self.pool.acquire(grad_bytes(unit, self.dtype))
        self._view(unit, buf).copy_(grad)
        waited = time.perf_counter() - start
        self._bytes_written += buf.nbytes
        start = time.perf_counter()
        self.pipeline.write_back(unit, buf, self._save, describe=lambda u: f"spilled gradient of unit {u.name}")
        return waited + time.perf_counter() - start

    def read(self, units: Sequence[UnitLayout]) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """Every spilled shard has landed: read them back in ``units``' order, ahead of use (the
        first reads start now). Each shard yielded stays valid until the next is asked for, or
        the iterator is closed."""
        self.pipeline.drain()  # the spill's writes have landed (a failed one raises here)
        reads = self.pipeline.read_ahead(
            units,
            nbytes=lambda u: grad_bytes(u, self.dtype),
            load=self._load,
            describe=lambda u: f"spilled gradient of unit {u.name}",
        )
        return self._hand_over(reads)

    def _hand_over(self, reads: ReadAhead[UnitLayout]) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        with reads:
            for unit, buf in reads:
                self._bytes_read += buf.nbytes
                try:
                    yield unit, self._view(unit, buf)  # in bf16 if spilled so: the update widens it
                finally:
                    self.pipeline.release(buf)

    def take_io_bytes(self) -> tuple[int, int]:
        """Bytes the steps since the last call read back and spilled."""
        counts = self._bytes_read, self._bytes_written
        self._bytes_read = self._bytes_written = 0
        return counts

    def close(self) -> None:
        """Let the writes still out land, then remove this rank's scratch store (the shared
        I/O runner is the engine's to close). Raises nothing: closing must go on."""
        try:
            self.pipeline.drain()
        except Exception as err:  # the shards were for a step that will never read them
            logger.debug("a spilled gradient's write failed at close: %r", err)
        if self._store is None:  # nothing of this run's to remove
            return
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):  # another rank's store is still there
            self.root.parent.rmdir()
