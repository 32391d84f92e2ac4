"""The optimizer state's forms (``optim.state_dtype``): AdamW's moments in fewer bytes.

``fp32`` holds the master and both moments in fp32 (12 B/param), bit-exact with torch.
``bf16`` holds the moments in bfloat16 (8 B/param, a third less to store and move each
step on the ``nvme`` tier); ``int8`` in 8-bit blocks (about 6 B/param, half;
``engine.zero.quantize``). The update widens the moments to fp32, runs AdamW with torch's
arithmetic and rounds them back, in one compiled pass (``engine.zero.compact_update``).

The master is fp32 unless ``optim.master_dtype = "bf16"`` (2 B/param fewer): the update widens
it to fp32 too and rounds it back stochastically, so an update far below its ulp (lr times a
step of about 1, against a weight of about 1, is below bfloat16's 2**-8 for any usual lr)
still moves it on average instead of being lost. At stage 3 with a bf16 compute dtype such a
master is the parameter itself (``engine.tiers.parameters``).

Rounding is stochastic: a moment is an exponential average whose per-step change,
``(1 - beta2) * g**2`` against ``v``, is often below half a bfloat16 ulp (2**-9 relative),
so rounding to nearest would freeze it; stochastic rounding keeps it unbiased. Its random
bits are seeded by the step count (``engine.zero.quantize.noise_table``), so a resumed run
draws the same ones and stays bit-identical to an uninterrupted run; the master's draws are a
stream of their own (``MASTER_SEED``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import OptimConfig
from engine.zero.compact_update import compact_step
from engine.zero.decay import ShardDecay
from engine.zero.optim import ShardAdamW
from engine.zero.precision import DTYPES
from engine.zero.quantize import BLOCK, PACKED, packed_bytes
from offload import array_bytes, shard_bytes
from offload.shards import ShardedUnit

HostAllocator = Callable[[int, torch.dtype, str], torch.Tensor]
"""``Device.empty_host``: ``numel`` elements of ``dtype`` for what the string names."""

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
"""Each ``optim.state_dtype``'s moment dtype as stored (int8: packed blocks, ``engine.zero.quantize``)."""

STATE_DTYPE_ATTR = "state_dtype"
"""The store attribute recording the form its optimizer state was written in (absent: fp32,
a store written before the option existed)."""
MASTER_DTYPE_ATTR = "master_dtype"
"""The store attribute recording its masters' dtype (absent: fp32, as above)."""

MASTER_SEED = 1 << 62
"""Offset of the master's rounding seeds, ``MASTER_SEED + step``: apart from the moments'
``2 * step + i`` at any step count a run reaches."""


@dataclass(frozen=True)
class PackedUnit:
    """A unit's geometry in bytes of packed 8-bit blocks (``engine.zero.quantize``): every size
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

    def offsets(self, unit: ShardedUnit) -> list[int]:
        """Each kind's byte offset in one buffer holding the unit's shard of every kind (the
        master first: every later offset stays a multiple of 4 bytes, a bf16 master's too, its
        shard being a multiple of ``ALIGN_ELEMS`` elements)."""
        sizes = [shard_bytes(g, d) for g, d in zip(self.geometries(unit), self.dtypes(), strict=True)]
        return [sum(sizes[:i]) for i in range(len(sizes))]

    def empty(self, unit: ShardedUnit, allocate: HostAllocator | None = None, **where: Any) -> list[torch.Tensor]:
        """One rank's uninitialised shard of each kind, from ``allocate`` (the pinned pool) if
        given, else as ``torch.empty`` allocates (``where``)."""
        if allocate is not None:
            what = f"the optimizer state of unit {unit.name!r}"
            return [allocate(g.shard_numel, d, what) for g, d in zip(self.geometries(unit), self.dtypes(), strict=True)]
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


class CompactAdamW(ShardAdamW):
    """``ShardAdamW`` on state of any form: fp32 goes straight to torch's kernel (bit-exact as
    before); bf16 and packed 8-bit moments, and a bf16 master, go through one fused pass that
    widens them to fp32, updates and rounds them back stochastically
    (``engine.zero.compact_update``)."""

    def update(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: torch.Tensor,
        lr: float,
        grad_scale: torch.Tensor | None = None,
        decay: ShardDecay | None = None,
    ) -> None:
        if master.dtype == exp_avg.dtype == torch.float32:
            super().update(master, grad, exp_avg, exp_avg_sq, step, lr, grad_scale, decay)
            return
        step.add_(1)  # as torch's kernels count it
        count = int(step.item())
        seeds = (2 * count, 2 * count + 1, MASTER_SEED + count)  # a distinct stream per step and per tensor
        compact_step(self.config, master, grad, (exp_avg, exp_avg_sq), count, lr, seeds, grad_scale, decay)
