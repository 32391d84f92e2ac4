"""Where a rank's compute-dtype parameter shards live between uses (stage 3, ``offload.param``).

``device`` keeps them on the compute device, ``cpu`` in host memory (pinned where an
accelerator exists, so the copy up is asynchronous), ``nvme`` in a store under
``<offload.nvme_path>/params``, read ahead into pooled host buffers. Either way a gather
``read``s a shard early and waits for its ``Fetch`` late, and every optimizer step hands
the new masters back through ``write_back``, then ``flush``es.

The parameter shards are derived data: the masters are the truth, and a resume
rebuilds the shards from the committed masters. So the ``nvme`` tier keeps one copy
outside the store's generations, rewritten in place each step: half the bytes of a
versioned copy, and a crash mid-write loses nothing that resume does not recompute.
A frozen unit's values are not derived, and never change: the store at ``offload.nvme_path``
keeps them once (``engine.tiers.frozen``), and the ``nvme`` tier reads them from there rather
than keeping a second copy.
With bf16 masters (``optim.master_dtype``) a trained unit's shard is its master: bit for bit in
a bf16 compute dtype, and widened by the copy to the device in fp32. The ``nvme`` tier then keeps
no copy at all, and reads each shard as a bf16 master from the optimizer tier
(``OptimizerState.read_master_async``), which writes it each step anyway: 2 B/param read by a
gather whatever the compute dtype.
``write_back`` hands the new shard back in memory (the ``nvme`` tier: its write's own staging
buffer), so that the next forward's first units start up during the update without a read
that could overtake the write.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from engine.runtime.budget import DeviceBudget
from engine.runtime.device import Device
from engine.runtime.staging import StagingRing
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.sizing import param_pool_bytes
from engine.tiers.store_io import StoreIO
from offload import (
    TOP,
    BufferPool,
    HostBuffer,
    ShardStore,
    create_arrays,
    read_shard_async,
    shard_bytes,
    write_shard_async,
)

PARAM_STORE = "params"
"""The sub-folder of ``offload.nvme_path`` holding the ``nvme`` tier's parameter shards."""
PARAM_KIND = "param"
"""The kind of state of the parameter shards' arrays, one per unit at the store's top."""

ShardReader = Callable[[UnitLayout, torch.Tensor], Future | None]
"""Starts reading this rank's shard of a unit kept elsewhere into a tensor: a frozen unit's
values (``engine.tiers.frozen.read_frozen_async``), a trained unit's bf16 master
(``OptimizerState.read_master_async``); None if read already."""


class Fetch:
    """A shard on its way to the host or device; ``wait`` gives it, ``release`` frees its buffer."""

    def __init__(self, shard: torch.Tensor, future: Future | None = None, free: Callable[[], None] | None = None):
        self._shard, self._future, self._free = shard, future, free

    @property
    def in_memory(self) -> bool:
        """Whether the shard was in memory already, with no read to wait for: the same on every
        rank, unlike whether a read has landed yet."""
        return self._future is None

    def wait(self) -> torch.Tensor:
        if self._future is not None:
            self._future.result()
            self._future = None
        return self._shard

    def release(self) -> None:
        """Free the shard's buffer once the read filling it has landed (waited for even where
        there is nothing to free: a read into a buffer of its caller's, ``read_into``)."""
        self.wait()
        if self._free is not None:
            self._free()
            self._free = None


class ParamTier(Protocol):
    """One tier's storage of every unit's parameter shard on this rank, through the same
    lifecycle verbs as the optimizer tiers: ``add`` each unit, ``read`` ahead of use,
    ``write_back`` each step's new values, ``flush`` them, ``close``. Nothing is committed:
    the shards derive from the masters, which a resume reads."""

    @property
    def hands_back_writes(self) -> bool:
        """Whether ``write_back`` returns the new shard in memory: what the next forward's first
        units may start up from during the update, before ``flush`` (a ``read`` then could
        overtake the write)."""
        ...

    def add(self, unit: UnitLayout, shard: torch.Tensor) -> None:
        """Take the unit's initial shard (compute dtype, copied)."""
        ...

    def write_back(self, unit: UnitLayout, master: torch.Tensor) -> Fetch | None:
        """Store the unit's new shard, cast from its master (copied before returning); the new
        shard in memory, to be released by the caller, where ``hands_back_writes``."""
        ...

    def flush(self) -> None:
        """Complete every write issued (a failed one raises here): reads from here on see the new values."""
        ...

    def read(self, unit: UnitLayout) -> Fetch:
        """Start bringing the unit's shard where a copy to the device can take it."""
        ...

    def reads_into(self, unit: UnitLayout, dtype: torch.dtype) -> bool:
        """Whether ``read_into`` can fill a host tensor of ``dtype`` with the unit's shard: not
        where the shard is in memory already, or is read in another dtype."""
        ...

    def read_into(self, unit: UnitLayout, into: torch.Tensor) -> Fetch:
        """Start reading the unit's shard straight into ``into`` (host memory; ``reads_into`` its dtype)."""
        ...

    def host_bytes(self) -> int:
        """Host memory this tier holds now."""
        ...

    def take_io_bytes(self) -> tuple[int, int]:
        """Bytes read from and written to disk since the last call."""
        ...

    def close(self) -> None:
        """Release what the tier holds."""
        ...


class MemoryParamTier:
    """Shards held in memory for the whole run: on the device (``device``, charged to the
    device budget) or in host memory (``cpu``, pinned where an accelerator exists)."""

    hands_back_writes = True

    def __init__(
        self, on_device: bool, device: Device, dtype: torch.dtype, budget: DeviceBudget, uploads: StagingRing | None
    ):
        """``uploads``: where host masters are rounded to the compute dtype on their way to a
        shard on the device (None: the masters are there already, or the device is the host)."""
        self._on_device, self._budget, self._copier = on_device, budget, device
        self._device, self._dtype, self._uploads = device.device, dtype, uploads
        self._shards: dict[str, torch.Tensor] = {}
        self._unread: dict[str, threading.Event] = {}
        """Per host shard: set while no copy to the device reads it (``read`` to ``Fetch.release``)."""

    def add(self, unit: UnitLayout, shard: torch.Tensor) -> None:
        if self._on_device:
            held = torch.empty(unit.shard_numel, dtype=self._dtype, device=self._device)
        else:  # from the pinned pool: copied to the device asynchronously
            held = self._copier.empty_host(unit.shard_numel, self._dtype, f"the parameter shard of unit {unit.name!r}")
            self._unread[unit.name] = threading.Event()
            self._unread[unit.name].set()
        if self._on_device:
            self._budget.charge(held.nbytes, f"the parameter shard of unit {unit.name!r}")
        self._shards[unit.name] = held.copy_(shard)

    def write_back(self, unit: UnitLayout, master: torch.Tensor) -> Fetch:
        held = self._shards[unit.name]
        if not self._on_device:
            self._unread[unit.name].wait()  # a copy to the device still reading the old values
            held.copy_(master)
        elif (
            self._uploads is None
        ):  # the master is on the device: cast on the copy stream, behind the gathers reading ``held``
            self._copier.copy(held, master, to_device=True)
        else:  # a host master, rounded on the host and copied up behind those gathers
            self._uploads.upload(held, master)
        return self.read(unit)

    def flush(self) -> None:
        return None

    def read(self, unit: UnitLayout) -> Fetch:
        unread = self._unread.get(unit.name)
        if unread is None:
            return Fetch(self._shards[unit.name])
        unread.clear()
        return Fetch(self._shards[unit.name], free=unread.set)

    def reads_into(self, unit: UnitLayout, dtype: torch.dtype) -> bool:
        return False  # in memory already: a copy is all there is to do

    def read_into(self, unit: UnitLayout, into: torch.Tensor) -> Fetch:
        raise NotImplementedError("a shard in memory is copied, not read (reads_into is False)")

    def host_bytes(self) -> int:
        return 0 if self._on_device else sum(t.nbytes for t in self._shards.values())

    def take_io_bytes(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        return None


class StoreParamTier:
    """Shards in a store on disk, staged through a bounded pool of host buffers.

    Reads for prefetch and writes of updated shards share the pool, so the host memory
    this tier holds is at most ``buffer_bytes`` (the prefetch window's share of this rank)
    plus two of the largest shards, whatever the model's size: one for a fetch the window
    did not foresee and one for a write. The trainable units' shards are in its own store,
    or with ``read_master`` read from their masters (no store of its own then); the frozen
    units' are read with ``read_frozen`` from where the run keeps them.
    """

    def __init__(
        self,
        path: Path,
        layout: ModelLayout,
        rank: int,
        dtype: torch.dtype,
        io: StoreIO,
        *,
        buffer_bytes: int,
        read_frozen: ShardReader,
        read_master: ShardReader | None = None,
        master_dtype: torch.dtype = torch.bfloat16,
        pin: bool = False,
    ):
        """``pin``: pin the staging buffers, which shards are copied to the device from (their
        budget is reserved in the engine's pinned pool, ``engine.runtime.pinned``).
        ``master_dtype``: the dtype ``read_master`` reads, no wider than ``dtype`` (the pool's
        buffers are sized in ``dtype``)."""
        self._rank, self._dtype, self._read_frozen = rank, dtype, read_frozen
        self._read_master, self._master_dtype = read_master, master_dtype
        self.pool = BufferPool(param_pool_bytes(layout.all_units, dtype, buffer_bytes), pin=pin)
        self.runner = io.runner
        self._writes: list[Future] = []
        self._bytes_read = 0
        self._bytes_written = 0
        self.store: ShardStore | None = None
        if read_master is not None:
            if io.leader and path.is_dir():
                shutil.rmtree(path)  # an earlier run's copies, derived data that nothing reads now
            io.barrier()
            return
        if io.leader:
            # Derived data: whatever an earlier run left here is replaced, never resumed from.
            stripes = io.stripes_of(path.name)
            for folder in (path, *stripes):
                folder.parent.mkdir(parents=True, exist_ok=True)
            store = ShardStore.create(
                path,
                {"content": "compute-dtype parameter shards, derived from the masters"},
                runner=self.runner,
                checksum=io.checksum,
                direct_io=io.direct_io,
                overwrite=True,
                stripes=stripes,
            )
            create_arrays(store, TOP, layout.units, (PARAM_KIND,), dtype)
            store.sync()
        io.barrier()
        self.store = ShardStore.open(
            path, runner=self.runner, direct_io=io.direct_io, costs=io.costs, stripes=io.stripes_of(path.name)
        )

    @property
    def hands_back_writes(self) -> bool:
        """True but where a trained unit's shard is read from its master, which the optimizer
        tier writes: this tier writes nothing then."""
        return self._read_master is None

    def add(self, unit: UnitLayout, shard: torch.Tensor) -> None:
        if self.store is not None and unit.trainable:  # else stored already, where it is read from
            self._write(self.store, unit, shard)

    def write_back(self, unit: UnitLayout, master: torch.Tensor) -> Fetch | None:
        """The new shard is handed back in its write's staging buffer, which stays leased until
        both the write and the caller let go of it."""
        # A frozen unit's are only handed back on resume, as stored; a shared master is written
        # by the optimizer tier.
        if self.store is None or not unit.trainable:
            return None
        shared = self._write(self.store, unit, master, holders=2)
        return Fetch(shared.buffer.view(self._dtype, unit.shard_numel), None, shared.drop)

    def _write(self, store: ShardStore, unit: UnitLayout, values: torch.Tensor, holders: int = 1) -> SharedBuffer:
        """Write the shard from a staging buffer leased to the write and ``holders - 1`` others."""
        buf = self.pool.acquire(shard_bytes(unit, self._dtype))
        staged = buf.view(self._dtype, unit.shard_numel)
        staged.copy_(values)
        shared = SharedBuffer(buf, self.pool, holders)
        [future] = write_shard_async(store, TOP, unit, self._rank, [(PARAM_KIND, staged)])
        future.add_done_callback(lambda _: shared.drop())  # the next write may need it at once
        self._writes.append(future)
        self._bytes_written += buf.nbytes
        return shared

    def flush(self) -> None:
        """Wait for the step's writes (fsynced with them: cheap after direct I/O, and it keeps
        the store's record of unsynced writes from growing); a failed one raises here."""
        writes, self._writes = self._writes, []
        for future in writes:
            future.result()
        if self.store is not None:
            self.store.sync()

    def read(self, unit: UnitLayout) -> Fetch:
        """The shard in the compute dtype, or a trained unit's in its master's where the masters
        are read (the copy to the device casts it), in a buffer of the pool."""
        dtype = self._read_dtype(unit)
        buf = self.pool.acquire(shard_bytes(unit, dtype))
        shard = buf.view(dtype, unit.shard_numel)
        self._bytes_read += buf.nbytes
        return Fetch(shard, self._start_read(unit, shard), lambda: self.pool.release(buf))

    def reads_into(self, unit: UnitLayout, dtype: torch.dtype) -> bool:
        return self._read_dtype(unit) == dtype

    def read_into(self, unit: UnitLayout, into: torch.Tensor) -> Fetch:
        """The shard read into ``into``: no pool buffer, and no copy after it."""
        self._bytes_read += into.nbytes
        return Fetch(into, self._start_read(unit, into))

    def _read_dtype(self, unit: UnitLayout) -> torch.dtype:
        return self._master_dtype if unit.trainable and self._read_master is not None else self._dtype

    def _start_read(self, unit: UnitLayout, shard: torch.Tensor) -> Future | None:
        if not unit.trainable:
            return self._read_frozen(unit, shard)
        if self._read_master is not None:
            return self._read_master(unit, shard)
        assert self.store is not None  # kept wherever the masters are not read
        [future] = read_shard_async(self.store, TOP, unit, self._rank, [(PARAM_KIND, shard)])
        return future

    def host_bytes(self) -> int:
        return self.pool.allocated_bytes

    def take_io_bytes(self) -> tuple[int, int]:
        counts = self._bytes_read, self._bytes_written
        self._bytes_read = self._bytes_written = 0
        return counts

    def close(self) -> None:
        """Nothing to release: the shared I/O runner, which the engine closes after every tier,
        finishes the writes still in flight."""
        return None


class SharedBuffer:
    """A pool buffer with several holders (a write and what shares its values), handed back to
    the pool when the last lets go."""

    def __init__(self, buffer: HostBuffer, pool: BufferPool, holders: int):
        self.buffer, self._pool = buffer, pool
        self._holders = holders
        self._lock = threading.Lock()

    def drop(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._pool.release(self.buffer)
