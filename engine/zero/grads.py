"""Gradients: from each parameter's ``.grad`` to this rank's fp32 shard of its unit.

Autograd leaves a gradient on a parameter; a post-accumulate hook copies it (as fp32, or in
the compute dtype where nothing needs the width: ``engine.tiers.sizing.gradient_dtype``)
into its unit's flat bucket and drops ``.grad``, so no parameter gradient outlives its
hook. What happens to a full bucket is the stage's difference:

- stage 1 keeps each bucket for the whole accumulation window and reduce-scatters it once,
  at the optimizer step;
- stage 2 (and 3) reduce-scatters a bucket as soon as its unit's last gradient arrives,
  overlapped with the rest of backward, frees it, and accumulates only the shard.

Either way the shard ends on the optimizer's tier, averaged over ranks: copied there on the
copy stream while backward goes on, and read only through ``ready``, which waits for that
copy (the reduced shard on the device is kept until then, so its memory is not reused). Shards are made
when their first gradient arrives and can be dropped as soon as the optimizer has used
them (``release_shard``), so when the update overlaps backward no gradient shard of the
whole model ever exists at once. Buckets on the device are charged to the device budget.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm, Work
from engine.runtime.device import Device, Event
from engine.runtime.staging import StagingRing, ring_bytes
from engine.state.partition import ModelLayout, ParamSlot, UnitLayout
from engine.tiers.sizing import MAX_IN_FLIGHT
from engine.zero.order import TracedOrder


def bucket_bytes(unit: UnitLayout, dtype: torch.dtype = torch.float32) -> int:
    """Device bytes of a unit's gradient bucket."""
    return unit.padded_numel * dtype.itemsize


def grad_shard_bytes(unit: UnitLayout, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of this rank's gradient shard of a unit."""
    return unit.shard_numel * dtype.itemsize


def _add(target: torch.Tensor, staged: torch.Tensor, reduced: torch.Tensor) -> None:
    """Add a staged shard into the accumulated one; ``reduced``, the device shard the copy
    read, is held until then (so that its memory is not reused under the copy)."""
    target.add_(staged)


@dataclass
class PendingShard:
    """A unit's accumulated gradient shard with the copy that may still be filling it: read it
    only through ``wait``, on any thread (the host optimizer worker waits here, not the
    training thread)."""

    shard: torch.Tensor
    copied: Event | None = None
    reduced: torch.Tensor | None = None
    """The reduced shard on the device that the copy reads, kept alive until it is done."""
    added: Future | None = None
    """The later micro-batches' additions into the shard, run after their copies."""

    def wait(self) -> torch.Tensor:
        """The shard, once the copy filling it (and any addition into it) is done."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = self.reduced = None
        if self.added is not None:
            self.added.result()
            self.added = None
        return self.shard


@dataclass
class _Reduction:
    """A unit's reduction in flight, and whether its shard's copy has been queued already."""

    unit: UnitLayout
    work: Work
    shard: torch.Tensor
    folded: bool = False


@dataclass
class _Bucket:
    unit: UnitLayout
    expected: int
    flat: torch.Tensor | None = None
    written: set[str] = field(default_factory=set)
    """The parameters whose gradients this micro-batch wrote into ``flat``."""


class GradientShards:
    """Per-unit gradient buckets on the device and accumulated fp32 shards on the grad tier."""

    def __init__(
        self,
        layout: ModelLayout,
        params: dict[str, list[tuple[str, nn.Parameter]]],
        comm: Comm,
        device: Device,
        shard_device: torch.device,
        *,
        reduce_per_micro_batch: bool,
        budget: DeviceBudget,
        shards_on_device: bool,
        after_reduce: Callable[[str], None] = lambda unit_name: None,
        dtype: torch.dtype = torch.float32,
    ):
        self.dtype = dtype
        """The buckets' and shards' dtype (``gradient_dtype``)."""
        self._comm, self._device = comm, device
        self._shard_device = shard_device
        self._budget, self._shards_on_device = budget, shards_on_device
        self._early = reduce_per_micro_batch
        self._after_reduce = after_reduce
        self._buckets = [_Bucket(u, len(params[u.name])) for u in layout.units]
        self.shards: dict[str, torch.Tensor] = {}
        self._adding: StagingRing | None = None
        """Where later micro-batches' reduced shards land before they are added (made at the first)."""
        self._copies: dict[str, tuple[Event, torch.Tensor | None]] = {}
        """Each unit's copy to its shard not yet waited for, with the reduced shard it reads
        until it is done (then dropped, so the device memory returns at once)."""
        self._adds: dict[str, Future] = {}
        """Each unit's latest addition into its shard, run after its copy (``_fold``)."""
        self._newest_copy: Event | None = None
        """The last copy queued to a shard: once it is done, all are (one stream, in order)."""
        self.on_ready: Callable[[str], None] | None = None
        """Called with a unit's name once its shard is final for the step (last micro-batch, stage >= 2)."""
        self.order = TracedOrder("the order gradient shards complete in")
        self._last_micro_batch = False
        self._first_micro_batch = True
        self._in_flight: collections.deque[_Reduction] = collections.deque()
        self._trains = [(name, p, unit.trainable) for unit in layout.all_units for name, p in params[unit.name]]
        """Each parameter with whether it was trainable when the engine was built."""
        self._handles = []
        for bucket in self._buckets:
            slots = {s.name: s for s in bucket.unit.params}
            for name, param in params[bucket.unit.name]:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(bucket, slots[name])))

    def _hook(self, bucket: _Bucket, slot: ParamSlot):
        def on_grad(param: torch.Tensor) -> None:
            assert param.grad is not None  # the hook runs once a gradient is accumulated
            self._add(bucket, slot, param.grad)
            param.grad = None

        return on_grad

    def _add(self, bucket: _Bucket, slot: ParamSlot, grad: torch.Tensor) -> None:
        if bucket.flat is None and self._adoptable(bucket, slot, grad):
            self._charge_bucket(bucket.unit)
            bucket.flat = grad.view(-1)
        else:
            if bucket.flat is None:
                bucket.flat = self._new_bucket(bucket.unit)
            region = bucket.flat[slot.offset : slot.offset + slot.numel]
            # The first gradient of a window is copied, not added to zero, as torch does (keeps -0.0).
            if self._first_micro_batch or self._early:
                region.copy_(grad.reshape(-1))
            else:
                region.add_(grad.reshape(-1))
        bucket.written.add(slot.name)
        if self._early and len(bucket.written) == bucket.expected:
            self._reduce(bucket)

    def _adoptable(self, bucket: _Bucket, slot: ParamSlot, grad: torch.Tensor) -> bool:
        """Whether ``grad`` can be the unit's bucket itself: the unit's one parameter, filling it
        without padding, reduced as it comes (stage 2+), its gradient in the bucket's dtype and
        place, in memory of its own that the reduction may clobber (the engine drops the
        parameter's reference to it). Copying it instead moved 2-4 bytes per parameter a step
        into fresh memory, for units of one weight each (a Llama's projections)."""
        return (
            self._early
            and bucket.expected == 1
            and slot.offset == 0
            and slot.numel == bucket.unit.padded_numel
            and grad.dtype == self.dtype
            and grad.device == self._device.device
            and grad._base is None
            and grad.is_contiguous()
            and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == grad.nbytes
        )

    def _charge_bucket(self, unit: UnitLayout) -> None:
        self._budget.charge(bucket_bytes(unit, self.dtype), f"the gradient bucket of unit {unit.name!r}")

    def _new_bucket(self, unit: UnitLayout) -> torch.Tensor:
        """A unit's bucket with zeros where no gradient will be copied: its padding (reduced with
        the rest). Zeroing it whole would write 4 bytes per parameter that every gradient's copy
        overwrites (a tenth of the training thread's time at 3B on the CPU); stage 1 adds later
        micro-batches into it, so there it starts at zero."""
        self._charge_bucket(unit)
        if not self._early:
            return torch.zeros(unit.padded_numel, dtype=self.dtype, device=self._device.device)
        flat = torch.empty(unit.padded_numel, dtype=self.dtype, device=self._device.device)
        flat[unit.numel :].zero_()
        return flat

    def start_backward(self, last_micro_batch: bool) -> None:
        """Before ``loss.backward()``: whether this micro-batch ends the accumulation window.
        Refuses a parameter frozen or unfrozen since the engine was built: its gradient would go
        nowhere, or be taken as zero."""
        for name, param, trainable in self._trains:
            if param.requires_grad != trainable:
                now = "requires grad" if param.requires_grad else "is frozen"
                raise ValueError(
                    f"parameter {name!r} {now} since the engine was built: the engine lays out trainable and frozen "
                    f"parameters once; set requires_grad before Engine(model, config) and build a new engine"
                )
        self._last_micro_batch = last_micro_batch
        if last_micro_batch:
            self.order.start()

    def _reduce(self, bucket: _Bucket) -> None:
        assert bucket.flat is not None  # a bucket is reduced once it holds gradients
        work, shard = self._comm.reduce_scatter(bucket.flat, bucket.unit.shard_numel)
        self._in_flight.append(_Reduction(bucket.unit, work, shard))
        bucket.flat = None
        self._after_reduce(bucket.unit.name)
        self._collect(keep=MAX_IN_FLIGHT - 1)

    def end_backward(self) -> None:
        """After ``loss.backward()``: reduce what backward left (units with unused parameters)
        and, at stage 2+, fold the reduced shards into the accumulated ones."""
        for bucket in self._buckets:
            if self._early and len(bucket.written) < bucket.expected:
                if bucket.flat is None:
                    bucket.flat = self._new_bucket(bucket.unit)
                for slot in bucket.unit.params:  # a parameter this backward did not use: zero gradient
                    if slot.name not in bucket.written:
                        bucket.flat[slot.offset : slot.offset + slot.numel].zero_()
                self._reduce(bucket)
            bucket.written.clear()
        if self._early:
            self._collect()
        self._first_micro_batch = False

    def final_shards(self) -> list[torch.Tensor]:
        """At the optimizer step: the averaged, accumulated gradient shards not yet released,
        in unit order."""
        if not self._early:
            for bucket in self._buckets:
                if bucket.flat is None:
                    bucket.flat = self._new_bucket(bucket.unit)
                self._reduce(bucket)
            self._collect()
        if self._newest_copy is not None:  # one wait for every copy to the shards, not one per unit
            self._newest_copy.synchronize()
            self._newest_copy = None
            self._copies.clear()
        return [self.ready(b.unit.name) for b in self._buckets if b.unit.name in self.shards]

    def _collect(self, keep: int = 0) -> None:
        """Fold finished reductions into the accumulated shards, oldest first, leaving ``keep`` in
        flight. With the shards on the host a reduction already complete is folded at once,
        whatever ``keep``: its copy then goes on behind the next unit's backward rather than
        after it. That is this rank's own decision, so nothing that depends on it is collective:
        the budget's credit and the unit's announcement (``on_ready``, whose update gathers)
        wait for the fixed point. With the shards on the device folding charges the budget for
        the shard, and the budget's room decides which parameters are gathered next (stage 3):
        there the fold waits for the fixed point too, so every rank gathers in the same order."""
        for name, (event, reduced) in self._copies.items():
            if reduced is not None and event.query():
                self._copies[name] = (event, None)
        if not self._shards_on_device:
            for reduction in self._in_flight:
                if not reduction.folded and reduction.work.is_completed():
                    self._finish_reduction(reduction)
        while len(self._in_flight) > keep:
            reduction = self._in_flight.popleft()
            if not reduction.folded:
                self._finish_reduction(reduction)
            unit = reduction.unit
            self._budget.credit(bucket_bytes(unit, self.dtype))
            if self._last_micro_batch and self._early:
                self.order.visit(unit.name)
                if self.on_ready is not None:
                    self.on_ready(unit.name)

    def _finish_reduction(self, reduction: _Reduction) -> None:
        """Wait for the reduction, average it over ranks and fold it into the unit's shard."""
        reduction.work.wait()
        if self._comm.world_size > 1:
            reduction.shard.div_(self._comm.world_size)
        self._fold(reduction.unit, reduction.shard)
        reduction.folded = True

    def _fold(self, unit: UnitLayout, reduced: torch.Tensor) -> None:
        """Keep (``_keeps``) or copy the first micro-batch's reduced shard as the unit's
        accumulated one, or add a later one into it: on the device behind the copy that made
        the shard, or on the host once its copy into the staging ring lands, run after the
        copy's event (``Device.after``) so that no thread launching kernels waits for it."""
        if (self._first_micro_batch or not self._early) and self._keeps(unit, reduced):
            self._charge_shard(unit)
            self.shards[unit.name] = reduced
            return
        target = self._shard(unit)
        if self._first_micro_batch or not self._early:
            copied = self._device.copy(
                target, reduced, to_device=False
            )  # ``reduced`` is held only while the copy reads it
            self._copies[unit.name] = (copied, None if copied.query() else reduced)
            self._newest_copy = copied
            return
        if self._shards_on_device:
            first = self.take(unit.name)
            if first.copied is not None:
                self._device.wait_for(first.copied)
            target.add_(reduced)
            return
        ring = self._adding_ring()
        staged = ring.take(unit.shard_numel, self.dtype)
        copied = self._device.copy(staged, reduced, to_device=False)
        self._newest_copy = copied
        self._adds[unit.name] = ring.give_back_after(
            copied, staged, then=functools.partial(_add, target, staged, reduced)
        )

    def ready(self, unit_name: str) -> torch.Tensor:
        """The unit's accumulated shard, once the copy filling it is done."""
        return self.take(unit_name).wait()

    def take(self, unit_name: str) -> PendingShard:
        """The unit's accumulated shard with the copy still filling it, if any, for another
        thread to wait on: from here the copy is the caller's to wait for before reading."""
        event, reduced = self._copies.pop(unit_name, (None, None))
        return PendingShard(self.shards[unit_name], event, reduced, self._adds.pop(unit_name, None))

    def _shard(self, unit: UnitLayout) -> torch.Tensor:
        """The unit's accumulated shard, made at its first gradient of the window."""
        shard = self.shards.get(unit.name)
        if shard is None:
            shard = self._empty_shard(unit, f"the gradient shard of unit {unit.name!r}")
            self._charge_shard(unit)
            self.shards[unit.name] = shard
        return shard

    def _charge_shard(self, unit: UnitLayout) -> None:
        if self._shards_on_device:
            self._budget.charge(grad_shard_bytes(unit, self.dtype), f"the gradient shard of unit {unit.name!r}")

    def _keeps(self, unit: UnitLayout, reduced: torch.Tensor) -> bool:
        """Whether the window's first reduced shard of the unit becomes its accumulated shard as
        it is, sparing a copy of 4 bytes per parameter and a fresh shard: it is already where
        shards are made by a plain allocation (the optimizer's device; or the host, where the
        device is the host and nothing is pinned), and holds no more memory than a shard (one
        rank, or a collective that made it apart from the bucket: not gloo's view of it)."""
        if unit.name in self.shards:
            return False
        if self._shards_on_device:
            home = self._shard_device
        elif self._device.pinned is None:
            home = torch.device("cpu")
        else:
            return False
        return (
            reduced.device == home
            and reduced.dtype == self.dtype
            and reduced.untyped_storage().nbytes() <= grad_shard_bytes(unit, self.dtype)
        )

    def release_shard(self, unit_name: str) -> None:
        """The optimizer has used the unit's shard: free it until the next window."""
        self.ready(unit_name)  # no copy may land in a freed shard
        shard = self.shards.pop(unit_name)
        if self._shards_on_device:
            self._budget.credit(shard.nbytes)
        self._free_shard(shard)

    def _adding_ring(self) -> StagingRing:
        """The ring later micro-batches' shards land in: two of the largest shard, made at the
        first addition and kept for the run."""
        if self._adding is None:
            largest = max(b.unit.shard_numel for b in self._buckets) * self.dtype.itemsize
            self._adding = StagingRing(self._device, ring_bytes(largest), "the gradient shards being added")
        return self._adding

    def _empty_shard(self, unit: UnitLayout, what: str) -> torch.Tensor:
        """A gradient shard's memory: on the device with the optimizer, else from the host's
        pinned pool, which the shard's copy fills asynchronously."""
        if self._shards_on_device:
            return torch.empty(unit.shard_numel, dtype=self.dtype, device=self._shard_device)
        return self._device.empty_host(unit.shard_numel, self.dtype, what)

    def _free_shard(self, shard: torch.Tensor) -> None:
        if not self._shards_on_device:
            self._device.free_host(shard)

    def zero(self, keep: AbstractSet[str] = frozenset()) -> None:
        """Start a new accumulation window; the shards of the units in ``keep`` stay until they
        are released one by one (those a deferred update has not reached: ``optim.defer_update``,
        which ends before the window's first backward adds to any shard)."""
        self._first_micro_batch = True
        for bucket in self._buckets:
            if bucket.flat is not None:
                self._budget.credit(bucket_bytes(bucket.unit, self.dtype))
            bucket.flat = None
            bucket.written.clear()
        for name in [name for name in self.shards if name not in keep]:
            self.release_shard(name)

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    def host_bytes(self) -> int:
        """Bytes of the gradient shards held in host memory (beside a host optimizer)."""
        return 0 if self._shards_on_device else self.nbytes()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
