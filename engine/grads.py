"""Gradients: from each parameter's ``.grad`` to this rank's fp32 shard of its unit.

Autograd leaves a gradient on a parameter; a post-accumulate hook copies it (as fp32)
into its unit's flat bucket and drops ``.grad``, so no parameter gradient outlives its
hook. What happens to a full bucket is the stage's difference:

- stage 1 keeps each bucket for the whole accumulation window and reduce-scatters it once,
  at the optimizer step;
- stage 2 (and 3) reduce-scatters a bucket as soon as its unit's last gradient arrives,
  overlapped with the rest of backward, frees it, and accumulates only the shard.

Either way the shard ends on the optimizer's tier, averaged over ranks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.comm import Comm, Work
from engine.partition import ModelLayout, ParamSlot, UnitLayout

# Reductions in flight at once during backward: enough to overlap one with the next
# unit's backward, few enough that reduced shards never pile up for the whole model.
MAX_IN_FLIGHT = 2


@dataclass
class _Bucket:
    unit: UnitLayout
    expected: int
    flat: torch.Tensor | None = None
    arrived: int = 0


class GradientShards:
    """Per-unit gradient buckets on the device and accumulated fp32 shards on the grad tier."""

    def __init__(
        self,
        layout: ModelLayout,
        params: dict[str, list[tuple[str, nn.Parameter]]],
        comm: Comm,
        device: torch.device,
        shard_device: torch.device,
        *,
        reduce_per_micro_batch: bool,
        pin_memory: bool = False,
        after_reduce: Callable[[str], None] = lambda unit_name: None,
    ):
        self._comm, self._device = comm, device
        self._early = reduce_per_micro_batch
        self._after_reduce = after_reduce
        self._buckets = [_Bucket(u, len(params[u.name])) for u in layout.units]
        self.shards = {
            u.name: torch.zeros(u.shard_numel, dtype=torch.float32, device=shard_device, pin_memory=pin_memory)
            for u in layout.units
        }
        self._first_micro_batch = True
        self._in_flight: collections.deque[tuple[UnitLayout, Work, torch.Tensor]] = collections.deque()
        self._handles = []
        for bucket in self._buckets:
            slots = {s.name: s for s in bucket.unit.params}
            for name, param in params[bucket.unit.name]:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(bucket, slots[name])))

    def _hook(self, bucket: _Bucket, slot: ParamSlot):
        def on_grad(param: torch.Tensor) -> None:
            self._add(bucket, slot, param.grad)
            param.grad = None

        return on_grad

    def _add(self, bucket: _Bucket, slot: ParamSlot, grad: torch.Tensor) -> None:
        if bucket.flat is None:
            bucket.flat = torch.zeros(bucket.unit.padded_numel, dtype=torch.float32, device=self._device)
        region = bucket.flat[slot.offset : slot.offset + slot.numel]
        # The first gradient of a window is copied, not added to zero, as torch does (keeps -0.0).
        if self._first_micro_batch or self._early:
            region.copy_(grad.reshape(-1))
        else:
            region.add_(grad.reshape(-1))
        bucket.arrived += 1
        if self._early and bucket.arrived == bucket.expected:
            self._reduce(bucket)

    def _reduce(self, bucket: _Bucket) -> None:
        work, shard = self._comm.reduce_scatter(bucket.flat, bucket.unit.shard_numel)
        self._in_flight.append((bucket.unit, work, shard))
        bucket.flat = None
        self._after_reduce(bucket.unit.name)
        self._collect(keep=MAX_IN_FLIGHT - 1)

    def end_backward(self) -> None:
        """After ``loss.backward()``: reduce what backward left (units with unused parameters)
        and, at stage 2+, fold the reduced shards into the accumulated ones."""
        for bucket in self._buckets:
            if self._early and bucket.arrived < bucket.expected:
                if bucket.flat is None:
                    bucket.flat = torch.zeros(bucket.unit.padded_numel, dtype=torch.float32, device=self._device)
                self._reduce(bucket)
            bucket.arrived = 0
        if self._early:
            self._collect()
        self._first_micro_batch = False

    def finalize(self) -> list[torch.Tensor]:
        """At the optimizer step: the averaged, accumulated gradient shards in unit order."""
        if not self._early:
            for bucket in self._buckets:
                if bucket.flat is None:
                    bucket.flat = torch.zeros(bucket.unit.padded_numel, dtype=torch.float32, device=self._device)
                self._reduce(bucket)
            self._collect()
        return [self.shards[b.unit.name] for b in self._buckets]

    def _collect(self, keep: int = 0) -> None:
        """Fold finished reductions into the accumulated shards, oldest first, leaving ``keep`` in flight."""
        while len(self._in_flight) > keep:
            unit, work, shard = self._in_flight.popleft()
            work.wait()
            if self._comm.world_size > 1:
                shard.div_(self._comm.world_size)
            target = self.shards[unit.name]
            target.copy_(shard) if self._first_micro_batch or not self._early else target.add_(shard)

    def zero(self) -> None:
        """Start a new accumulation window."""
        self._first_micro_batch = True
        for bucket in self._buckets:
            bucket.flat = None
            bucket.arrived = 0

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
