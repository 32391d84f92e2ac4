"""One stage-3 unit's full parameters through their life cycle: fetched from the unit's tier,
copied into place on the device (where the device is the host, read into place), all-gathered,
and freed again (``engine.zero.params`` decides when). Each step of the cycle is a method here,
and refused, before any of its work, from a state that does not lead to it."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm, Work
from engine.runtime.device import Device, Event
from engine.runtime.staging import StagingRing
from engine.state.partition import UnitLayout
from engine.tiers.parameters import Fetch, ParamTier
from offload import DIRECT_ALIGN, alias


class UnitStateError(RuntimeError):
    """A stage-3 unit asked to enter a state its life cycle does not lead to from the one it
    is in (a unit gathered twice, or completed before its gather started): the unit is left
    as it was, before any of the transition's work."""


class UnitState(enum.Enum):
    """Where a stage-3 unit's full parameters are in their life cycle."""

    SHARDED = "sharded"
    """Only this rank's shard exists, on its tier."""
    FETCHING = "fetching"
    """The shard is on its way from its tier to where the device can copy it."""
    COPYING = "copying"
    """The shard's copy into the full buffer is queued on the copy stream."""
    GATHERING = "gathering"
    """The all-gather into the full buffer is in flight."""
    GATHERED = "gathered"


COMES_FROM = {
    UnitState.FETCHING: frozenset({UnitState.SHARDED}),
    UnitState.COPYING: frozenset({UnitState.FETCHING}),
    UnitState.GATHERING: frozenset({UnitState.COPYING, UnitState.SHARDED}),
    UnitState.GATHERED: frozenset({UnitState.GATHERING}),
    UnitState.SHARDED: frozenset({UnitState.FETCHING, UnitState.COPYING, UnitState.GATHERING, UnitState.GATHERED}),
}
"""The states each state is entered from: a unit is fetched, copied, gathered and completed
in turn (or gathered at once from its new master in hand, ``gather_from``), and freed from
any of them."""


class UnitParams:
    """A stage-3 unit's full compute-dtype buffer (its parameters are views of it), where it is
    in its life cycle, and what is in flight for it."""

    def __init__(
        self,
        layout: UnitLayout,
        flat: torch.Tensor,
        persistent: bool,
        state: UnitState,
        *,
        tier: ParamTier,
        comm: Comm,
        device: Device,
        budget: DeviceBudget,
    ):
        self.layout, self.flat, self.persistent, self.state = layout, flat, persistent, state
        self._tier, self._comm, self._device, self._budget = tier, comm, device, budget
        self.fetch: Fetch | None = None
        self.in_place = False
        """Whether ``fetch`` reads into the full buffer itself (``_read_in_place``)."""
        self.copied: Event | None = None
        """The copy of the fetched shard into place: the fetch's buffer is released only after it."""
        self.work: Work | None = None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @contextmanager
    def becoming(self, state: UnitState) -> Iterator[None]:
        """One transition to ``state``, its work inside: refused before any of it unless the
        unit is in a state that leads there (``COMES_FROM``), made once the work is done."""
        if self.state not in COMES_FROM[state]:
            allowed = " or ".join(sorted(s.name for s in COMES_FROM[state]))
            raise UnitStateError(
                f"unit {self.layout.name!r} cannot become {state.name} from {self.state.name}: only from {allowed}"
            )
        yield
        self.state = state

    def own(self) -> torch.Tensor:
        """This rank's shard of the full buffer."""
        return self.flat[self.layout.shard_slice(self._comm.rank)]

    def start_fetch(self, fetch: Fetch | None = None, *, in_place: bool = False) -> None:
        """Start reading the shard from its tier, or take ``fetch``, the shard already in hand.
        ``in_place`` (the budget has room for the full buffer now): where the device is the
        host, read it straight into its place in the full buffer, which then needs no copy."""
        with self.becoming(UnitState.FETCHING):
            if fetch is None and in_place and self._device.computes_on_host_memory:
                fetch = self._read_in_place()
                self.in_place = fetch is not None
            self.fetch = fetch if fetch is not None else self._tier.read(self.layout)

    def _read_in_place(self) -> Fetch | None:
        """The shard read into its place in the full buffer, given its memory here; None (no
        memory given) where the tier cannot read it there, or where the place is not aligned
        for direct I/O: a read through the page cache would copy it all the same. The read is
        given an alias of the place: the store's views of what it reads into leave their
        storage unable to change size, and the full buffer's must be freed after."""
        if not self._tier.reads_into(self.layout, self.flat.dtype):
            return None
        self._give_buffer()
        own = self.own()
        if own.data_ptr() % DIRECT_ALIGN:
            self._drop_buffer()
            return None
        return self._tier.read_into(self.layout, alias(own))

    def start_copy(self) -> None:
        """The shard is fetched: give the full buffer its memory and queue the shard's copy into
        place on the copy stream (read in place, it is there already). The fetch's buffer goes
        back once the copy's event has completed (``release_fetch``), on the device's completion
        thread: what a tier's writes wait for never waits for this thread."""
        if self.state is UnitState.SHARDED:
            self.start_fetch(in_place=True)  # charged now rather than below, as the copy would be
        with self.becoming(UnitState.COPYING):
            assert self.fetch is not None  # FETCHING holds it
            if self.in_place:
                return  # the read is the copy: the gather waits for it
            self._give_buffer()
            self.copied = self._device.copy(self.own(), self.fetch.wait(), to_device=True)
            self.release_fetch()

    def _give_buffer(self) -> None:
        self._budget.charge(self.nbytes, f"gathering unit {self.layout.name!r}")
        self.flat.untyped_storage().resize_(self.nbytes)

    def _drop_buffer(self) -> None:
        self.flat.untyped_storage().resize_(0)
        self._budget.credit(self.nbytes)

    def start_gather(self) -> None:
        """All-gather the full buffer once the shard's copy is done (asynchronously)."""
        with self.becoming(UnitState.GATHERING):
            if self.copied is not None:
                self._device.wait_for(self.copied)  # the all-gather reads the shard
            else:
                assert self.fetch is not None  # COPYING holds the copy's event, or the read in place
                self.release_fetch()  # waits for the read
            self.work = self.all_gather()

    def gather_from(self, master: torch.Tensor, uploads: StagingRing | None) -> None:
        """Give the full buffer its memory, put the rank's new master into its shard and start
        the all-gather: a deferred update hands each unit on just before its forward, which
        then needs no read of the values just written (``copy_and_gather``)."""
        with self.becoming(UnitState.GATHERING):
            self._give_buffer()
            self.work = copy_and_gather(self._device, self._comm, self.flat, self.layout, master, uploads)

    def all_gather(self) -> Work:
        """The all-gather of the full buffer from every rank's shard, started."""
        return self._comm.all_gather(self.flat, self.own())

    def release_fetch(self) -> None:
        """Hand the fetched shard's buffer back once the copy reading it is done (on the
        device's completion thread if it is not yet: this thread does not wait for it)."""
        fetch, self.fetch, self.in_place = self.fetch, None, False
        if fetch is None:
            return
        if self.copied is None:
            fetch.release()
        else:
            self._device.after(self.copied, fetch.release)

    def complete(self) -> None:
        """Take the unit through what is left of its cycle until it is gathered, and wait for that."""
        if self.state in (UnitState.SHARDED, UnitState.FETCHING):
            self.start_copy()
        if self.state is UnitState.COPYING:
            self.start_gather()
        with self.becoming(UnitState.GATHERED):
            assert self.work is not None  # GATHERING holds it
            self.work.wait()
            self.work = None
            self.release_fetch()

    def free(self) -> None:
        """Back to the shard alone, from wherever the unit is in its cycle."""
        if self.state is UnitState.SHARDED:
            return
        with self.becoming(UnitState.SHARDED):
            if self.work is not None:  # an all-gather nobody waited for: it must land before its buffer goes
                self.work.wait()
                self.work = None
            # The copy into the buffer must land before the buffer goes. After a gather the
            # compute stream has waited for it, so it has (a query, no wait); a prefetch dropped
            # with its copy in flight waits here.
            if self.copied is not None and not self.copied.query():
                self.copied.synchronize()
            self.release_fetch()  # a read in flight lands first, in place or in its pool buffer
            self.copied = None
            if self.flat.untyped_storage().nbytes():
                self._drop_buffer()


def copy_and_gather(
    device: Device, comm: Comm, flat: torch.Tensor, unit: UnitLayout, master: torch.Tensor, uploads: StagingRing | None
) -> Work:
    """Put the rank's new master into its shard of ``flat`` (in the compute dtype), then
    all-gather ``flat`` once it is there. A host master is rounded in ``uploads`` and copied
    from there on the copy stream, so that its buffer may be reused when this returns and
    nothing here waits for the copy; a master on the device (or where the device is the host,
    ``uploads`` None) is cast in place on the compute stream."""
    own = flat[unit.shard_slice(comm.rank)]
    if uploads is None:
        own.copy_(master)
    else:
        device.wait_for(uploads.upload(own, master))  # the all-gather reads ``own``
    return comm.all_gather(flat, own)
