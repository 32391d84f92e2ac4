"""The bytes one training step moves through the nvme store, moved with no compute at all.

A step of a tier plan moves, per unit and on one rank:

- optimizer state on ``nvme``: the fp32 master, exp_avg and exp_avg_sq shards, read from
  the committed generation and written to the next one (or back to the same one, with
  ``store.mode = "in-place"``);
- parameter shards on ``nvme`` (stage 3): the compute-dtype shard, read before the unit's
  forward and again before its backward, and the updated shard written once. They are
  derived from the masters, so the engine keeps one copy, rewritten in place each step,
  outside the generations;
- spilled gradients (``offload.grad_spill``, with clipping or loss scaling): the fp32 gradient
  shard, written in backward and read back with the unit's optimizer state, in one scratch
  copy outside the generations.

Tiers held in memory move nothing through the store (on a CPU-only build the ``cpu``
tier is the device's own memory). The bytes go through the same offload parts as the
engine's nvme tier, with the engine's settings: a `ShardStore` on an `IORunner` of
``offload.io_threads`` threads, a `BufferPool` of ``offload.buffer_mb`` and a `Pipeline`
whose window is half of it; in a step's order (forward reads, backward reads, then each
unit's optimizer read and write-back), ending, as a committed step does, with a sync
that makes every write durable. Its time is what the step's I/O costs alone:
``max(compute, movement)`` is the step that overlapping them perfectly would give.
"""

from __future__ import annotations

import functools
import itertools
import resource
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import torch

from benchmarks.plans import TierPlan
from engine.config import Config, OffloadConfig, spills_gradients
from engine.runtime.native_dtype import settle_compute_dtype
from engine.state.dtypes import compute_dtype
from engine.state.forms import STATE_KINDS
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.grad_spill import GRAD
from engine.tiers.parameters import PARAM_KIND, PARAM_STORE
from engine.tiers.sizing import optimizer_buffer_bytes, read_ahead_bytes
from engine.tiers.store_io import settle_io
from offload import (
    SCRATCH,
    BufferPool,
    HostBuffer,
    IORunner,
    Pipeline,
    ShardStore,
    create_arrays,
    generation_prefix,
    read_shard,
    shard_bytes,
    write_shard,
)


@dataclass(frozen=True)
class Segment:
    """One array's shard of a unit, at ``offset`` bytes into the transfer's host buffer."""

    kind: str
    numel: int
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Transfer:
    """What one unit moves at one point of the step: ``reads`` into one host buffer, then ``writes`` out of it."""

    unit: UnitLayout
    phase: str
    reads: tuple[Segment, ...]
    writes: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return max(s.offset + s.nbytes for s in (*self.reads, *self.writes))

    def describe(self) -> str:
        """How an I/O error names the transfer."""
        return f"{self.phase} of unit {self.unit.name}"


def _packed(unit: UnitLayout, kinds: list[tuple[str, torch.dtype]]) -> tuple[Segment, ...]:
    """The unit's shards of ``kinds``, laid end to end in one buffer (each stays 4 KiB-aligned:
    a shard is a multiple of 2048 elements of at least 2 bytes)."""
    segments, offset = [], 0
    for kind, dtype in kinds:
        segments.append(Segment(kind, unit.shard_numel, dtype, offset))
        offset += shard_bytes(unit, dtype)
    return tuple(segments)


def step_transfers(
    layout: ModelLayout, plan: TierPlan, param_dtype: torch.dtype, spill: bool = False
) -> list[Transfer]:
    """Every transfer of one step of ``plan``, in the order the step makes them (``spill``: the
    gradient shards spilled in backward and read back for the update); empty when nothing is on nvme."""
    param = [(PARAM_KIND, param_dtype)] if plan.param == "nvme" else []
    state = [(kind, torch.float32) for kind in STATE_KINDS] if plan.optimizer == "nvme" else []
    grad = [(GRAD, torch.float32)] if spill else []
    transfers: list[Transfer] = []
    if param:
        fetch = {u.name: _packed(u, param) for u in layout.units}
        transfers += [Transfer(u, "forward", fetch[u.name], ()) for u in layout.units]
    if param or grad:
        transfers += [Transfer(u, "backward", _packed(u, param), _packed(u, grad)) for u in reversed(layout.units)]
    if param or state:
        for unit in layout.units:
            segments = _packed(unit, state + param + grad)
            reads = tuple(s for s in segments if s.kind in STATE_KINDS or s.kind == GRAD)
            transfers.append(Transfer(unit, "optimizer", reads, tuple(s for s in segments if s.kind != GRAD)))
    return transfers


class StoreTraffic:
    """A store holding every array a step touches, and that step's transfers over it. As the
    engine's ``store.mode`` does, each step reads one generation and writes the other, or with
    ``in_place`` rewrites the one it reads."""

    def __init__(self, path: Path, transfers: list[Transfer], offload: OffloadConfig, *, in_place: bool) -> None:
        self.transfers = transfers
        self.in_place = in_place
        self.runner = IORunner(threads=offload.io_threads)
        self.store = ShardStore.create(
            path, {}, runner=self.runner, checksum=offload.checksum, direct_io=offload.direct_io
        )
        budget = optimizer_buffer_bytes(offload, [t.unit for t in transfers])
        self.pool = BufferPool(budget)
        self.pipeline: Pipeline[Transfer] = Pipeline(self.pool, self.runner, window_bytes=read_ahead_bytes(budget))
        self._read_generation = 0
        arrays = {(t.unit.name, s.kind): (t.unit, s) for t in transfers for s in (*t.reads, *t.writes)}
        for unit, segment in arrays.values():
            for prefix in {self._prefix(generation, segment) for generation in {0, self._written()}}:
                create_arrays(self.store, prefix, [unit], (segment.kind,), segment.dtype)
        for unit, segment in arrays.values():  # the first step reads generation 0: give it chunks
            with self.pool.acquire(segment.nbytes) as buf:
                view = buf.view(segment.dtype, segment.numel)
                write_shard(self.store, self._prefix(0, segment), unit, 0, [(segment.kind, view)])
        self.store.sync()

    def _written(self) -> int:
        """The generation the next step writes."""
        return self._read_generation if self.in_place else 1 - self._read_generation

    @staticmethod
    def _prefix(generation: int, segment: Segment) -> str:
        """Where a segment lives: optimizer state in a generation, parameter shards and spilled
        gradients in their one copy (the engine's parameter and scratch stores, here groups of
        the one store)."""
        return {PARAM_KIND: PARAM_STORE, GRAD: SCRATCH}.get(segment.kind, generation_prefix(generation))

    def _move(self, generation: int, write: bool, transfer: Transfer, buf: HostBuffer) -> None:
        """Read or write the transfer's segments (one rank: a shard is its whole array)."""
        for segment in transfer.writes if write else transfer.reads:
            views = [(segment.kind, buf.view(segment.dtype, segment.numel, segment.offset))]
            move = write_shard if write else read_shard
            move(self.store, self._prefix(generation, segment), transfer.unit, 0, views)

    def step(self) -> tuple[float, float]:
        """Move one step's bytes and make the writes durable; the seconds it took, and the CPU
        seconds this process spent on it (I/O threads included: system calls, checksums)."""
        start, cpu_start = time.perf_counter(), process_cpu_s()
        load = functools.partial(self._move, self._read_generation, False)
        save = functools.partial(self._move, self._written(), True)
        # A phase's writes land before the next phase reads (the spilled gradients backward
        # writes are what the update reads), as the engine drains its spill before reading it.
        for _, phase in itertools.groupby(self.transfers, key=lambda t: t.phase):
            for transfer, buf in self.pipeline.read_ahead(
                list(phase), nbytes=lambda t: t.nbytes, load=load, describe=Transfer.describe
            ):
                if transfer.writes:
                    self.pipeline.write_back(transfer, buf, save, describe=Transfer.describe)
                else:
                    self.pipeline.release(buf)
            self.pipeline.drain()
        self.store.sync()
        self._read_generation = self._written()
        return time.perf_counter() - start, process_cpu_s() - cpu_start

    def close(self) -> None:
        """Stop the I/O threads and delete the store."""
        self.runner.close()
        shutil.rmtree(self.store.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def process_cpu_s() -> float:
    """User and system CPU seconds of this process so far, every thread counted."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Movement:
    """The data-movement-only time of one plan's step: median and every timed step, its bytes,
    and the CPU seconds moving them takes (median): cores a compute-bound step must share."""

    seconds: float
    runs: list[float]
    bytes_read: int
    bytes_written: int
    cpu_s: float = 0.0


def measure_movement(path: Path, layout: ModelLayout, config: Config, plan: TierPlan, reps: int) -> Movement:
    """``reps`` timed steps of ``plan``'s store traffic after an untimed one (which also writes the
    second generation's files for the first time), with ``config``'s ``[offload]`` settings and
    ``store.mode``, in a store at ``path`` deleted afterwards."""
    config, _ = settle_io(config, resume=False)  # as the engine settles "auto" I/O and compute dtype
    config = settle_compute_dtype(config)
    transfers = step_transfers(layout, plan, compute_dtype(config.precision.compute_dtype), spills_gradients(config))
    if not transfers:
        return Movement(0.0, [], 0, 0)
    bytes_read = sum(s.nbytes for t in transfers for s in t.reads)
    bytes_written = sum(s.nbytes for t in transfers for s in t.writes)
    with StoreTraffic(path, transfers, config.offload, in_place=config.store.mode == "in-place") as traffic:
        traffic.step()
        runs, cpu = zip(*(traffic.step() for _ in range(reps)), strict=True)
    return Movement(statistics.median(runs), list(runs), bytes_read, bytes_written, statistics.median(cpu))
