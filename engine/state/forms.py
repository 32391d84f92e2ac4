"""The optimizer state's kinds and forms: what one unit's state is made of on a rank
(``ShardState``: a master and AdamW's two moments), and how it is held and stored
(``StateForm``: ``optim.state_dtype`` and ``optim.master_dtype``), with the store arrays it
takes. Below the tiers that hold the state and the step that updates it.

``fp32`` holds the master and both moments in fp32 (12 B/param), bit-exact with torch.
``bf16`` holds the moments in bfloat16 (8 B/param, a third less to store and move each
step on the ``nvme`` tier); ``int8`` in 8-bit blocks (about 6 B/param, half;
``engine.state.quantize``). The master is fp32 unless ``optim.master_dtype = "bf16"``
(2 B/param fewer); at stage 3 with the parameters on nvme such a master is the parameter itself
(``engine.tiers.parameters``). How the update widens, updates and rounds back each form is
``engine.zero.compact_update``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import OptimConfig
from engine.state.dtypes import DTYPES
from engine.state.partition import ALIGN_ELEMS, UnitLayout
from engine.state.quantize import BLOCK, DIRECT_BLOCKS_ELEMS, PACKED, packed_bytes
from offload import (
    ShardedUnit,
    ShardStore,
    array_bytes,
    create_arrays,
    shard_bytes,
    write_shard_async,
    zero_shard_async,
)

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
"""Each ``optim.state_dtype``'s moment dtype as stored (int8: packed blocks, ``engine.state.quantize``)."""

STATE_DTYPE_ATTR = "state_dtype"
"""The store attribute recording the form its optimizer state was written in (absent: fp32,
a store written before the option existed)."""
MASTER_DTYPE_ATTR = "master_dtype"
"""The store attribute recording its masters' dtype (absent: fp32, as above)."""


@dataclass(frozen=True)
class PackedUnit:
    """A unit's geometry in bytes of packed 8-bit blocks (``engine.state.quantize``): every size
    a multiple of ``BLOCK`` elements (shards and chunks are, see ``ALIGN_ELEMS``) scaled to
    ``PACKED`` bytes per block, so rank ``r``'s shard is still ``shard_slice(r)``."""

    unit: ShardedUnit

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def numel(self) -> int:
        return packed_bytes(-(-self.unit.numel // BLOCK) * BLOCK)

    @property
    def padded_numel(self) -> int:
        return packed_bytes(self.unit.padded_numel)

    @property
    def chunk_numel(self) -> int:
        return packed_bytes(self.unit.chunk_numel)

    @property
    def shard_numel(self) -> int:
        return packed_bytes(self.unit.shard_numel)

    def shard_slice(self, rank: int) -> slice:
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)


@dataclass(frozen=True)
class StateForm:
    """How one unit's optimizer state (master, exp_avg, exp_avg_sq) is held and stored:
    ``name`` is the moments' form (``optim.state_dtype``), ``master`` the master's
    (``optim.master_dtype``)."""

    name: str = "fp32"
    master: str = "fp32"

    @classmethod
    def of(cls, optim: OptimConfig) -> StateForm:
        """The form a run's ``optim`` section asks for."""
        return cls(optim.state_dtype, optim.master_dtype)

    @classmethod
    def stored(cls, attrs: dict) -> StateForm:
        """The form a store's attributes record (fp32 for what a store written before an option lacks)."""
        return cls(str(attrs.get(STATE_DTYPE_ATTR, "fp32")), str(attrs.get(MASTER_DTYPE_ATTR, "fp32")))

    def attrs(self) -> dict[str, str]:
        """The store attributes recording this form."""
        return {STATE_DTYPE_ATTR: self.name, MASTER_DTYPE_ATTR: self.master}

    def dtypes(self) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """Each kind's dtype, in ``STATE_KINDS`` order."""
        moment = STATE_DTYPES[self.name]
        return DTYPES[self.master], moment, moment

    def geometries(self, unit: ShardedUnit) -> tuple[ShardedUnit, ShardedUnit, ShardedUnit]:
        """Each kind's array geometry, in ``STATE_KINDS`` order: the unit's own, or for int8
        moments its packed blocks'."""
        moment = PackedUnit(unit) if self.name == "int8" else unit
        return unit, moment, moment

    @property
    def chunk_align(self) -> int:
        """The multiple of elements a large chunk is rounded to (``build_layout``'s ``align``):
        packed int8 moments' chunk files are whole O_DIRECT blocks only at ``DIRECT_BLOCKS_ELEMS``
        (measured on 200M parameters: the step 1.5x as long when the moments went through the
        page cache), every other kind's at any shard size."""
        return DIRECT_BLOCKS_ELEMS if self.name == "int8" else ALIGN_ELEMS

    @property
    def bytes_per_param(self) -> float:
        """Bytes of state per trainable parameter: held on its tier, and on the ``nvme`` tier
        read and written once each step."""
        moment = PACKED / BLOCK if self.name == "int8" else STATE_DTYPES[self.name].itemsize
        return DTYPES[self.master].itemsize + 2 * moment

    def unit_bytes(self, unit: ShardedUnit) -> int:
        """Host bytes of one rank's shard of one unit's whole state."""
        return sum(shard_bytes(g, d) for g, d in zip(self.geometries(unit), self.dtypes(), strict=True))

    def array_bytes(self, unit: ShardedUnit) -> int:
        """Disk bytes of one unit's whole state, all ranks (padding included)."""
        return sum(array_bytes(g, d) for g, d in zip(self.geometries(unit), self.dtypes(), strict=True))

    def write_new(
        self, store: ShardStore, prefix: str, unit: UnitLayout, rank: int, master: torch.Tensor
    ) -> list[Future]:
        """Start storing a new unit's state under ``prefix``: its master written; its moments,
        which every form starts from all-zero bytes, made zeros with nothing but their checksums
        written (``offload.zero_shard_async``: half a compact import's bytes, none read back)."""
        geometries = self.geometries(unit)
        futures = write_shard_async(store, prefix, geometries[0], rank, [(STATE_KINDS[0], master)])
        for kind, geometry in zip(STATE_KINDS[1:], geometries[1:], strict=True):
            futures += zero_shard_async(store, prefix, geometry, rank, [kind])
        return futures

    def offsets(self, unit: ShardedUnit) -> list[int]:
        """Each kind's byte offset in one buffer holding the unit's shard of every kind (the
        master first: every later offset stays a multiple of 4 bytes, a bf16 master's too, its
        shard being a multiple of ``ALIGN_ELEMS`` elements)."""
        sizes = [shard_bytes(g, d) for g, d in zip(self.geometries(unit), self.dtypes(), strict=True)]
        return [sum(sizes[:i]) for i in range(len(sizes))]

    def empty(self, unit: ShardedUnit, **where: Any) -> list[torch.Tensor]:
        """One rank's uninitialised shard of each kind, as ``torch.empty`` allocates (``where``).
        None is pinned: the host's AdamW alone reads and writes them, and a master reaches the
        device rounded to the compute dtype through ``engine.runtime.staging``."""
        return [
            torch.empty(g.shard_numel, dtype=d, **where)
            for g, d in zip(self.geometries(unit), self.dtypes(), strict=True)
        ]

    def check_stored(self, attrs: dict, path: Path | str) -> None:
        """Refuse resuming a store whose state is in another form: its arrays hold other dtypes."""
        stored = StateForm.stored(attrs)
        for key, held, asked in (("state_dtype", stored.name, self.name), ("master_dtype", stored.master, self.master)):
            if held != asked:
                raise ValueError(
                    f"store {path} holds its optimizer state with optim.{key} = {held!r}, this run asks for "
                    f"{asked!r}: set optim.{key} = {held!r} to resume it (or start a new store)"
                )


FP32_STATE = StateForm()


Views = list[tuple[str, torch.Tensor]]


@dataclass
class ShardState:
    """One unit's optimizer state on this rank (``shard_numel`` elements each: a master and
    moments of the run's ``StateForm``)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """Each kind's name (its store array's) with its tensor."""
        return list(zip(STATE_KINDS, self.tensors(), strict=True))


STATE_KINDS = tuple(field.name for field in dataclasses.fields(ShardState))
"""The kinds of optimizer state a unit has, by name: the names of its arrays in a store."""


def create_state_arrays(store: ShardStore, prefix: str, units: Iterable[UnitLayout], form: StateForm) -> None:
    """Every unit's optimizer state arrays under ``prefix``, each kind in its ``form`` dtype and geometry."""
    for unit in units:
        for kind, geometry, dtype in zip(STATE_KINDS, form.geometries(unit), form.dtypes(), strict=True):
            create_arrays(store, prefix, (geometry,), (kind,), dtype)


def state_groups(form: StateForm, unit: UnitLayout, state: ShardState) -> list[tuple[ShardedUnit, Views]]:
    """The state's ``(kind, tensor)`` views grouped by array geometry (one group but for int8
    moments), each to read or write in one call of ``offload``'s shard functions."""
    groups: dict[ShardedUnit, Views] = {}
    for geometry, view in zip(form.geometries(unit), state.views(), strict=True):
        groups.setdefault(geometry, []).append(view)
    return list(groups.items())
