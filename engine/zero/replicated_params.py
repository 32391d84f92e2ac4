"""Stage 1/2's compute-dtype parameters: every unit's full buffer on every rank, for the whole
run (``engine.zero.params`` has the protocol they meet and stage 3's sharded ones)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager

import torch
from torch import nn

from engine.runtime.budget import DeviceBudget
from engine.runtime.comm import Comm, Work
from engine.runtime.device import Device
from engine.runtime.staging import StagingRing
from engine.state.partition import ModelLayout, UnitLayout
from engine.zero.unit_params import copy_and_gather


class ReplicatedParams:
    """Stage 1/2: full compute-dtype parameters on every rank, refreshed by all-gather."""

    order = None  # every unit stays gathered: there is no order of gathers to predict

    def __init__(
        self, layout: ModelLayout, comm: Comm, budget: DeviceBudget, device: Device, uploads: StagingRing | None
    ):
        """``uploads``: where host masters are rounded to the compute dtype on their way up
        (None: the masters are on the device, or the device is the host)."""
        self._layout, self._comm, self._budget, self._device = layout, comm, budget, device
        self._uploads = uploads
        self._flats: dict[str, torch.Tensor] = {}
        self._gathers: list[Work] = []

    def add(self, unit: UnitLayout, flat: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Take the unit's full buffer (the module's parameters are views of it), ``values`` copied in if given."""
        self._budget.charge(flat.nbytes, f"the parameters of unit {unit.name!r}")
        self._flats[unit.name] = flat if values is None else flat.copy_(values)

    def write_back(self, unit: UnitLayout, master: torch.Tensor) -> None:
        """The unit's master shard holds new values: share them with every rank (asynchronously).
        ``master`` may be reused once this returns."""
        self._gathers.append(
            copy_and_gather(self._device, self._comm, self._flats[unit.name], unit, master, self._uploads)
        )

    def flush(self) -> None:
        """Wait for the gathers of the written-back shards: the parameters hold the new values."""
        for work in self._gathers:
            work.wait()
        self._gathers.clear()

    def begin_iteration(self) -> None:
        return None

    def ahead_order(self) -> None:
        return None  # every unit stays gathered, its new values gathered as they are stored

    def update_in_forward(self, due: AbstractSet[str], until: Callable[[str], None]) -> None:
        raise ValueError("a deferred update needs zero.stage = 3: here every unit stays gathered")

    def end_update_in_forward(self) -> None:
        return None  # none is ever open

    def frozen_shards(self) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """This rank's shard of each frozen unit (compute dtype), to store once."""
        for unit in self._layout.frozen:
            yield unit, self._flats[unit.name][unit.shard_slice(self._comm.rank)]

    @contextmanager
    def gathered(self) -> Iterator[None]:
        yield

    def release_after_backward(self, unit_name: str) -> None:
        return None

    def hook(self, modules: dict[str, nn.Module], needs: dict[str, list[str]]) -> None:
        return None  # every unit stays gathered: nothing to do around forward and backward

    def check_fits(self, grad_bucket_bytes: dict[str, int], in_flight: int) -> None:
        return None  # the parameters were charged whole when added

    def take_wait_s(self) -> float:
        return 0.0

    def prefetch_counts(self) -> tuple[int, int]:
        return 0, 0

    def take_io_bytes(self) -> tuple[int, int]:
        return 0, 0

    def host_bytes(self) -> int:
        return 0

    def close(self) -> None:
        return None
