"""The compute-dtype parameters on the device: replicated (stages 1, 2) or sharded (stage 3).

Either way each unit's parameters are views into one flat buffer, and an optimizer step
hands each rank's updated shard to ``shard(unit)``. What differs is when the full buffer
exists:

- ``ReplicatedParams`` keeps every unit gathered for the whole run and all-gathers each
  unit right after its shard is updated.
- ``ShardedParams`` keeps only the rank's shard between uses. A unit is gathered just
  before its forward and again just before its backward, and released right after each;
  releasing frees the buffer's storage (resized to zero bytes) while the parameter views,
  and any views autograd saved for backward, stay valid objects that the next gather
  refills in place.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from engine.comm import Comm, Work
from engine.partition import ROOT_UNIT, ModelLayout, UnitLayout

logger = logging.getLogger(__name__)


class ReplicatedParams:
    """Stage 1/2: full compute-dtype parameters on every rank, refreshed by all-gather."""

    def __init__(self, flats: dict[str, torch.Tensor], layout: ModelLayout, comm: Comm):
        self._flats, self._layout, self._comm = flats, layout, comm
        self._gathers: list[Work] = []

    def shard(self, unit: UnitLayout) -> torch.Tensor:
        return self._flats[unit.name][unit.shard_slice(self._comm.rank)]

    def updated(self, unit: UnitLayout) -> None:
        """The unit's shard holds new values: share them with every rank (asynchronously)."""
        self._gathers.append(self._comm.all_gather(self._flats[unit.name], self.shard(unit)))

    def finish_update(self) -> None:
        for work in self._gathers:
            work.wait()
        self._gathers.clear()

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._flats.values())

    @contextmanager
    def gathered(self) -> Iterator[None]:
        yield

    def release_after_backward(self, unit_name: str) -> None:
        return None

    def close(self) -> None:
        return None


class UnitState(enum.Enum):
    """Whether a stage-3 unit's full parameters exist on the device."""

    SHARDED = "sharded"
    GATHERED = "gathered"


class ShardedParams:
    """Stage 3: only this rank's shard of each unit persists; units are gathered on demand."""

    def __init__(
        self,
        flats: dict[str, torch.Tensor],
        modules: dict[str, nn.Module],
        layout: ModelLayout,
        comm: Comm,
    ):
        self._flats, self._layout, self._comm = flats, layout, comm
        self._units = {u.name: u for u in layout.units}
        self._shards = {u.name: flats[u.name][u.shard_slice(comm.rank)].clone() for u in layout.units}
        self.state = {u.name: UnitState.GATHERED for u in layout.units}
        self.high_water_bytes = 0
        for unit in layout.units:
            self.release(unit.name)
        self._handles = []
        for name, module in modules.items():
            if name in self._units:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(name)))
                self._handles.append(module.register_forward_hook(self._post_forward(name)))

    def gather(self, name: str) -> None:
        """Give the unit its full parameters (idempotent)."""
        if self.state[name] is UnitState.GATHERED:
            return
        flat, unit = self._flats[name], self._units[name]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        self._comm.all_gather(flat, self._shards[name]).wait()
        self.state[name] = UnitState.GATHERED
        self.high_water_bytes = max(self.high_water_bytes, self.nbytes())
        logger.debug("gathered unit %s (%d elements)", unit.name, unit.padded_numel)

    def release(self, name: str) -> None:
        """Free the unit's full parameters; its shard stays."""
        if self.state[name] is UnitState.SHARDED:
            return
        self._flats[name].untyped_storage().resize_(0)
        self.state[name] = UnitState.SHARDED

    def _pre_forward(self, name: str):
        def hook(module: nn.Module, args) -> None:
            self.gather(name)

        return hook

    def _post_forward(self, name: str):
        def hook(module: nn.Module, args, output):
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for tensor in tensors:
                # Fires when the gradient of the unit's output is ready: its backward is next.
                tensor.register_hook(lambda grad: self.gather(name))
            if name != ROOT_UNIT:  # the root's parameters are the first backward needs
                self.release(name)

        return hook

    def release_after_backward(self, unit_name: str) -> None:
        """The unit's gradients are reduced: its full parameters are not needed until the next forward."""
        self.release(unit_name)

    def shard(self, unit: UnitLayout) -> torch.Tensor:
        return self._shards[unit.name]

    def updated(self, unit: UnitLayout) -> None:
        return None  # the next forward gathers the new values

    def finish_update(self) -> None:
        return None

    def nbytes(self) -> int:
        """Bytes held on the device now: every shard plus the units currently gathered."""
        shards = sum(t.nbytes for t in self._shards.values())
        return shards + sum(self._flats[n].nbytes for n, s in self.state.items() if s is UnitState.GATHERED)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered (to read or save full parameters outside forward/backward)."""
        before = {n for n, s in self.state.items() if s is UnitState.SHARDED}
        for name in self._units:
            self.gather(name)
        try:
            yield
        finally:
            for name in before:
                self.release(name)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
