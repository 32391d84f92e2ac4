"""The compute-dtype parameters on the device: replicated (stages 1, 2) or sharded (stage 3).

Each unit's parameters are views into one flat buffer; a step hands each rank's updated
master shard to ``write_back`` (then ``flush``), except for frozen units. What differs is when
the full buffer exists:

- ``ReplicatedParams`` (``engine.zero.replicated_params``) keeps every unit gathered and
  all-gathers each after its update.
- ``ShardedParams`` keeps only the rank's shard, on its tier (``engine.tiers.parameters``). A
  unit is gathered just before its forward and its backward and released right after each;
  releasing frees the buffer's storage (resized to zero bytes) while the parameter views,
  and any views autograd saved for backward, stay objects that the next gather refills. The units that come next in the traced
  order (``engine.zero.order``) are fetched and gathered ahead, within ``zero.prefetch_mb`` and
  the device budget. Each unit's own life cycle, from its shard to its full parameters and
  back, is ``engine.zero.unit_params``'.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm
from engine.runtime.device import Device
from engine.runtime.staging import StagingRing
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.parameters import Fetch, ParamTier
from engine.zero.order import TracedOrder
from engine.zero.unit_fits import check_units_fit
from engine.zero.unit_params import UnitParams, UnitState, copy_and_gather

logger = logging.getLogger(__name__)


class Params(Protocol):
    """The compute-dtype parameters on the device, whatever the stage: what building the units,
    the gradients' hooks, the step and the engine ask of them (``ReplicatedParams`` in
    ``engine.zero.replicated_params``, ``ShardedParams``)."""

    @property
    def order(self) -> TracedOrder | None:
        """The traced order of the units' gathers, which prefetching follows (None: nothing is gathered)."""
        ...

    def add(self, unit: UnitLayout, flat: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Take the unit's full buffer (the module's parameters are views of it), whose values ``values`` holds if given."""
        ...

    def write_back(self, unit: UnitLayout, master: torch.Tensor) -> None:
        """The unit's master shard holds new values; ``master`` may be reused once this returns."""
        ...

    def flush(self) -> None:
        """Complete what the written-back shards started: the parameters hold the new values."""
        ...

    def begin_iteration(self) -> None:
        """A forward starts."""
        ...

    def ahead_order(self) -> list[str] | None:
        """The order the next forward gathers the units in, where their new values are sent
        ahead of it as they are stored; None where they are not."""
        ...

    def update_in_forward(self, due: AbstractSet[str], until: Callable[[str], None]) -> None:
        """A step's update is deferred (``optim.defer_update``): each unit of ``due`` (the
        update's live set of those not handed on yet) is updated, with those due before it, by
        ``until`` when the next forward first needs it."""
        ...

    def end_update_in_forward(self) -> None:
        """The deferred update is done, or goes on outside a forward: gathers no longer drive it."""
        ...

    def frozen_shards(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """This rank's shard of each frozen unit (compute dtype), to store once."""
        ...

    def gathered(self) -> AbstractContextManager[None]:
        """A context in which every unit holds its full parameters."""
        ...

    def release_after_backward(self, unit_name: str) -> None:
        """The unit's gradients are reduced: its full parameters are not needed until the next forward."""
        ...

    def hook(self, modules: dict[str, nn.Module], needs: dict[str, list[str]]) -> None:
        """Gather and release around each unit module's forward and backward, where that is needed."""
        ...

    def check_fits(self, grad_bucket_bytes: dict[str, int], in_flight: int) -> None:
        """Refuse, before the first forward, a device memory limit that no step can meet."""
        ...

    def take_wait_s(self) -> float:
        """Seconds blocked on parameter fetches and gathers since the last call."""
        ...

    def prefetch_counts(self) -> tuple[int, int]:
        """Gathers that found their unit gathered or on its way, and those that did not, since the last call."""
        ...

    def take_io_bytes(self) -> tuple[int, int]:
        """Bytes the parameters' tier read and wrote since the last call."""
        ...

    def host_bytes(self) -> int:
        """Bytes the parameters hold in host memory."""
        ...

    def close(self) -> None: ...


class ShardedParams:
    """Stage 3: only this rank's shard of each unit persists; units are gathered on demand.

    ``needs`` maps each hooked module (a unit's module) to the units whose parameters it
    uses: its own, and those it borrows (a tied weight owned by another unit).
    """

    def __init__(
        self,
        layout: ModelLayout,
        comm: Comm,
        tier: ParamTier,
        budget: DeviceBudget,
        device: Device,
        *,
        prefetch_bytes: int,
        persistence_threshold: int,
        reserve_bytes: int,
        uploads: StagingRing | None,
        defers_update: bool = False,
    ):
        self._layout, self._comm, self._tier, self._budget = layout, comm, tier, budget
        self._defers_update = defers_update
        self._due: AbstractSet[str] = frozenset()
        """Units a deferred update has not handed on yet (its own live set): their stored values
        are the step before's."""
        self._until: Callable[[str], None] | None = None
        self._wanted: set[str] = set()
        """Units whose deferred update a gather waits for: they go up from their new masters."""
        self._device, self._uploads = device, uploads
        self._prefetch_bytes = prefetch_bytes
        self._persistence_threshold = persistence_threshold
        self._reserve = reserve_bytes
        """Device bytes that gathering ahead and keeping a unit for its next use leave free for
        what a step must allocate (a unit gathered on demand, gradient buckets)."""
        self._units: dict[str, UnitParams] = {}
        self.order = TracedOrder("the order units run in")
        self._handles: list = []
        self._sendable: set[str] = set()
        """Units updated since the iteration began that may go ahead from their new values in
        memory (not one whose new shard was let go untaken: its write may not have landed)."""
        self._fresh: dict[str, Fetch] = {}
        """The new shards the tier handed back from ``write_back``, until ``_advance`` takes them."""
        self._ahead: set[str] = set()
        """Units on their way for the next iteration since their new values were stored, which
        its start keeps (``_prefetch_updated``)."""
        self._wait_s = 0.0
        self.hits = 0
        self.misses = 0

    # ------------------------------------------------------------ set-up

    def add(self, unit: UnitLayout, flat: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Take the unit's full buffer: its initial values' shard goes to the tier, and unless the unit
        is small enough to persist (``values`` copied in), its memory is freed until the unit runs."""
        values = flat if values is None else values
        self._tier.add(unit, values[unit.shard_slice(self._comm.rank)])
        persistent = unit.numel < self._persistence_threshold
        if persistent and values is not flat:
            flat.copy_(values)
        entry = UnitParams(
            unit,
            flat,
            persistent,
            UnitState.GATHERED,
            tier=self._tier,
            comm=self._comm,
            device=self._device,
            budget=self._budget,
        )
        self._units[unit.name] = entry
        self._budget.charge(entry.nbytes, f"the gathered parameters of unit {unit.name!r}")
        if not persistent:
            entry.free()

    def hook(self, modules: dict[str, nn.Module], needs: dict[str, list[str]]) -> None:
        """Gather before and release after every unit module's forward and backward."""
        for name, module in modules.items():
            units = [u for u in needs.get(name, []) if u in self._units]
            if units:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(units)))
                self._handles.append(module.register_forward_hook(self._post_forward(units)))

    def check_fits(self, grad_bucket_bytes: dict[str, int], in_flight: int) -> None:
        """Refuse, before the first forward, a limit that even one unit at a time cannot meet
        (``engine.zero.unit_fits``)."""
        persistent = {name: entry.persistent for name, entry in self._units.items()}
        sizes = {name: entry.nbytes for name, entry in self._units.items()}
        check_units_fit(self._budget, sizes, persistent, grad_bucket_bytes, in_flight)

    # --------------------------------------------------------------- hooks

    def _pre_forward(self, units: list[str]):
        def hook(module: nn.Module, args) -> None:
            self._gather_all(units)

        return hook

    def _post_forward(self, units: list[str]):
        def hook(module: nn.Module, args, output):
            if torch._C._current_graph_task_id() != -1:
                # A forward inside backward: a recomputation (activation checkpointing) of a unit
                # nested in a recomputed one, whose own backward comes next: keep it gathered.
                return
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            waiting = True

            def before_backward(grad: torch.Tensor) -> None:
                # The first of the unit's output gradients is ready: its backward is next.
                nonlocal waiting
                if waiting:
                    waiting = False
                    self._gather_all(units)

            for tensor in tensors:
                tensor.register_hook(before_backward)
            for name in units:
                self._release_unless_next(name)

        return hook

    def _gather_all(self, units: list[str]) -> None:
        for name in units:
            self.gather(name)

    # ----------------------------------------------------- the life cycle

    def begin_iteration(self) -> None:
        """A forward is about to start: what the last iteration gathered ahead is dropped, but
        not what the update started on its way for this one."""
        for name, entry in self._units.items():
            if not entry.persistent and name not in self._ahead:
                entry.free()
        self._ahead.clear()
        self._sendable.clear()
        self.order.start()

    def update_in_forward(self, due: AbstractSet[str], until: Callable[[str], None]) -> None:
        """Nothing is sent ahead during a deferred update, and a unit whose gather waits for its
        update goes up from its new master at once (``write_back``)."""
        self._due, self._until = due, until

    def end_update_in_forward(self) -> None:
        self._due, self._until = frozenset(), None

    def gather(self, name: str) -> None:
        """Give the unit its full parameters (updated first, if a deferred update has not
        reached it), then start gathering the units that follow it."""
        following = self._due_next(name) if self._until is not None else None
        self._wanted = {n for n in (name, following) if n is not None and n in self._due}
        if self._wanted:
            assert self._until is not None  # units are due only while a deferred update is open
            try:
                self._until(following or name)
            finally:
                self._wanted = set()
        entry = self._units[name]
        self.order.visit(name)
        if entry.persistent and entry.work is not None:  # regathered from its new master
            entry.work.wait()
            entry.work = None
        if entry.persistent or entry.state is UnitState.GATHERED:
            self.hits += not entry.persistent
        else:
            ahead = entry.state is not UnitState.SHARDED
            self.hits += ahead
            self.misses += not ahead
            self._waited(entry.complete)
        self._prefetch()

    def _waited(self, move: Callable[[], None]) -> None:
        """Move a unit on, counting the time as a wait for parameters: a prefetch pass's move
        waits for the unit's read too (gathering one read in place, copying a fetched one)."""
        start = time.perf_counter()
        move()
        self._wait_s += time.perf_counter() - start

    def _due_next(self, name: str) -> str | None:
        """The unit after ``name`` in the traced order, if a deferred update has not reached it,
        prefetching is on and the device budget lets it go up with ``name`` (whatever its size,
        as ``_advance`` moves the next unit): it is then updated and sent up ahead, its copy
        beside ``name``'s forward. The same on every rank: the trace and the byte counts are."""
        after = [n for n in self.order.upcoming() if n != name and not self._units[n].persistent][:1]
        both = self._units[name].nbytes + sum(self._units[n].nbytes for n in after)
        if self._prefetch_bytes and after and after[0] in self._due and self._budget.fits(both + self._reserve):
            return after[0]
        return None

    def _prefetch(self) -> None:
        """Move the units next in the traced order on (``_advance``)."""
        self._advance(self.order.upcoming())

    def _advance(self, names: list[str], gather: bool = True) -> None:
        """Move each unit of ``names`` one stage on, in turn, while their bytes fit the
        window and the device budget: fetch it, copy a fetched one into place, and (with
        ``gather``) all-gather the first one copied, the next to run. A copy is given a pass to
        land before its gather waits for it; one gather a pass, because where waiting for a
        copy holds the host (the simulated device) gathering every copied unit at once would
        hold it until the last copy landed, with nothing computed meanwhile. Where copies are
        synchronous, as on the CPU, a unit is gathered as it is copied. A shard held in memory
        is copied in the pass that fetches it, queued from the step's first gather.

        The next unit is moved on whatever its size: a window smaller than one unit (a 7B
        model's layers are over 400 MB in bf16) would otherwise prefetch nothing at all, and
        every gather would wait for its read.

        Every rank takes the same decisions from the same trace and the same byte counts,
        so the all-gathers are issued in the same order everywhere."""
        if self._prefetch_bytes == 0:
            return
        window = 0
        seen: set[str] = set()
        for name in names:
            if name in self._due:
                return  # its stored values are the step before's until it is updated
            entry = self._units[name]
            if name in seen or entry.persistent:
                continue
            seen.add(name)
            window += entry.nbytes
            if window > self._prefetch_bytes and len(seen) > 1:
                return
            if entry.state is UnitState.COPYING:
                if gather:
                    self._waited(entry.start_gather)
                    gather = False
            elif entry.state is UnitState.SHARDED:
                if name in self._fresh and not self._budget.fits(entry.nbytes + self._reserve):
                    return  # a new shard is taken only to be copied at once (the tier's writes may need its buffer)
                in_place = self._budget.fits(entry.nbytes + self._reserve)  # its full buffer then held from the read
                entry.start_fetch(self._fresh.pop(name, None), in_place=in_place)
                if not (entry.fetch and entry.fetch.in_memory):
                    continue  # a read from disk: copied at a later call (on every rank alike: gathers follow)
            if entry.state is UnitState.FETCHING:
                if not entry.in_place and not self._budget.fits(entry.nbytes + self._reserve):
                    return  # (a unit read in place holds its buffer already)
                self._waited(entry.start_copy)
                if self._device.copies_are_synchronous:
                    self._waited(entry.start_gather)

    def _release_unless_next(self, name: str) -> None:
        """Release after use, unless the unit is used again within the prefetch window
        (the last block's forward is followed at once by its backward) and keeping it leaves
        the device budget room for what must be allocated before then."""
        if not self._budget.fits(self._reserve):
            self.release(name)
            return
        window = 0
        for upcoming in self.order.upcoming():
            if upcoming == name:
                return
            window += self._units[upcoming].nbytes
            if window > self._prefetch_bytes:
                break
        self.release(name)

    def release(self, name: str) -> None:
        """Free the unit's full parameters; its shard stays (persistent units are kept)."""
        entry = self._units[name]
        if not entry.persistent:
            entry.free()

    def release_after_backward(self, unit_name: str) -> None:
        """The unit's gradients are reduced: its full parameters are not needed until the next forward."""
        self.release(unit_name)

    # ---------------------------------------------------------- the update

    def write_back(self, unit: UnitLayout, master: torch.Tensor) -> None:
        """Store the unit's new shard on its tier; a persistent unit is re-gathered at once, and
        the next iteration's first units whose new values are stored start on their way."""
        fresh = self._tier.write_back(unit, master)
        self._sendable.add(unit.name)
        entry = self._units[unit.name]
        if entry.persistent or self._defers_update:
            if fresh is not None:
                fresh.release()  # gathered from the master instead, or read when it is next used
            if entry.persistent:
                entry.work = copy_and_gather(self._device, self._comm, entry.flat, unit, master, self._uploads)
            elif unit.name in self._wanted:
                entry.free()  # what went up before this update carries the values before it
                entry.gather_from(master, self._uploads)
            return
        if fresh is not None:
            self._fresh[unit.name] = fresh
        self._prefetch_updated()

    def ahead_order(self) -> list[str] | None:
        """This iteration's order of gathers, which the next follows, where the tier hands back
        the shards it writes (``_prefetch_updated``)."""
        return self.order.iteration() if self._tier.hands_back_writes else None

    def _prefetch_updated(self) -> None:
        """Move the next iteration's first units on (``_advance``) as far as their new values are
        stored (or they are frozen), so that their copies to the device run beside the update
        of the units after them: after clipping the units are updated in the order the next
        forward uses them (``StepControl.update_order``). A trained unit goes from the new shard
        its tier handed back (``write_back``), never from a read, which on disk could overtake
        the write; one whose new shard was let go (the window full) stops the leading units, so
        every rank sends the same units ahead, each one in memory."""
        order = self.ahead_order()
        if order is not None:
            ready = lambda name: name in self._sendable or not self._units[name].layout.trainable  # noqa: E731
            leading = list(itertools.takewhile(ready, order))
            self._advance(leading, gather=False)  # gathered one a pass in the forward, behind its compute
            self._ahead |= {n for n in leading if self._units[n].state is not UnitState.SHARDED}
        for name, fetch in self._fresh.items():
            fetch.release()
            self._sendable.discard(name)
        self._fresh.clear()

    def flush(self) -> None:
        """The tier's writes complete and the persistent units' gathers done: the new values are in place."""
        self._tier.flush()
        for entry in self._units.values():
            if entry.persistent and entry.work is not None:
                entry.work.wait()
                entry.work = None

    def frozen_shards(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """This rank's shard of each frozen unit (compute dtype), read from its tier one at a time,
        to store once."""
        for unit in self._layout.frozen:
            fetch = self._tier.read(unit)
            try:
                yield unit, fetch.wait()
            finally:
                fetch.release()

    @property
    def state(self) -> dict[str, UnitState]:
        return {name: entry.state for name, entry in self._units.items()}

    def unit(self, name: str) -> UnitParams:
        """The unit's full parameters, with where they are in their life cycle."""
        return self._units[name]

    def take_wait_s(self) -> float:
        """Seconds spent blocked on parameter fetches and all-gathers since the last call."""
        seconds, self._wait_s = self._wait_s, 0.0
        return seconds

    def prefetch_counts(self) -> tuple[int, int]:
        """Gathers that found their unit gathered or on its way, and those that did not,
        since the last call."""
        counts = self.hits, self.misses
        self.hits = self.misses = 0
        return counts

    def take_io_bytes(self) -> tuple[int, int]:
        """Bytes the tier read and wrote since the last call."""
        return self._tier.take_io_bytes()

    def host_bytes(self) -> int:
        return self._tier.host_bytes()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered (to read or save full parameters outside forward/backward)."""
        before = {n for n, s in self.state.items() if s is UnitState.SHARDED}
        for entry in self._units.values():
            if entry.state is not UnitState.GATHERED:
                entry.complete()
        try:
            yield
        finally:
            for name in before:
                self.release(name)

    def close(self) -> None:
        """Remove the hooks; the gathers started for an iteration that never came land first."""
        for handle in self._handles:
            handle.remove()
        for name in self._ahead:
            self._units[name].free()
        self._tier.close()
