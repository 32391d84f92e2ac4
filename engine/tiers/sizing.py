"""How many bytes the tiers hold, as pure functions of the layout and the config.

The engine sizes its pools and windows with these, and ``engine.tools.estimate`` predicts a
run's memory and disk with the same functions, so a change in how a tier holds memory is
made once and the estimate follows it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import torch

from engine.config import Config, OffloadConfig, ZeroConfig, spills_gradients
from engine.runtime.pinned import aligned
from engine.runtime.sizes import MIB
from engine.runtime.staging import ring_bytes
from engine.state.dtypes import DTYPES, compute_dtype
from engine.state.forms import FP32_STATE, STATE_KINDS, StateForm
from engine.state.partition import FROZEN_SUFFIX, ROOT_UNIT, ModelLayout, UnitLayout
from engine.tiers.store_checks import IN_PLACE, store_bytes
from offload import shard_bytes

# Reductions in flight at once during backward: enough to overlap one with the next
# unit's backward, few enough that reduced shards never pile up for the whole model.
MAX_IN_FLIGHT = 2

SPILL_HELD = 2 * MAX_IN_FLIGHT
"""Gradient shards a rank that spills them holds at once, at most: ``MAX_IN_FLIGHT`` being
made (their reductions in flight) and ``MAX_IN_FLIGHT`` handed to the spill and not yet in its
buffers, past which backward waits for the oldest (``engine.zero.spilling``). So the shards of
a spilling rank are a window, not the model's gradient (in pinned memory, on a GPU)."""

AUTO_PREFETCH_FLOOR_MB = 64
"""The least window ``zero.prefetch_mb = "auto"`` gives: several small units ahead, whose reads
each wait more on their latency than on their bytes."""


def module_numels(layout: ModelLayout) -> dict[str, int]:
    """Padded elements gathered when each unit's module runs: its trainable unit and its frozen
    one (``FROZEN_SUFFIX``) together."""
    numels: dict[str, int] = {}
    for unit in layout.all_units:
        name = unit.name.removesuffix(FROZEN_SUFFIX)
        numels[name] = numels.get(name, 0) + unit.padded_numel
    return numels


def block_numels(layout: ModelLayout) -> list[int]:
    """``module_numels`` of every module but the root, whose unit stays gathered through the step."""
    return [numel for name, numel in module_numels(layout).items() if name != ROOT_UNIT]


def prefetch_bytes(zero: ZeroConfig, layout: ModelLayout, dtype: torch.dtype) -> int:
    """Stage 3: device bytes of the units gathered ahead of use: ``zero.prefetch_mb``, or for
    ``"auto"`` two of the largest module's units in the compute dtype (the root's aside: it stays
    gathered through the step), at least ``AUTO_PREFETCH_FLOOR_MB``. With two, the next unit's
    read is in flight while the one after it is read: with one, a 2.9B fp32 fine-tune waited
    9-13 s a step for its reads, with two under 0.6 s."""
    if zero.prefetch_mb != "auto":
        return int(zero.prefetch_mb * MIB)
    return max(2 * max(block_numels(layout), default=0) * dtype.itemsize, AUTO_PREFETCH_FLOOR_MB * MIB)


def param_window_bytes(zero: ZeroConfig, layout: ModelLayout, dtype: torch.dtype) -> int:
    """The ``nvme`` parameter tier: host bytes of shards read ahead, this rank's share of the
    prefetch window."""
    return prefetch_bytes(zero, layout, dtype) // max(layout.world_size, 1)


def param_pool_bytes(units: Iterable[UnitLayout], dtype: torch.dtype, window_bytes: int) -> int:
    """The ``nvme`` parameter tier's host pool: the read-ahead window plus two of the largest
    shards, one for a fetch the window did not foresee and one for a write."""
    return window_bytes + 2 * max(shard_bytes(u, dtype) for u in units)


AUTO_BUFFER_FLOOR_MB = 256
"""The least host pool ``offload.buffer_mb = "auto"`` gives the ``nvme`` optimizer tier: room
to read several small units ahead."""


def optimizer_buffer_bytes(offload: OffloadConfig, units: Iterable[UnitLayout], form: StateForm = FP32_STATE) -> int:
    """The ``nvme`` optimizer tier's host pool budget: ``offload.buffer_mb``, or for ``"auto"``
    the least pool that reads one unit's state while another's is written (twice the largest
    unit's, ``store_checks.check_buffer``'s minimum) rounded up to whole MiB, and at least
    ``AUTO_BUFFER_FLOOR_MB``."""
    if offload.buffer_mb != "auto":
        return offload.buffer_mb * MIB
    need_mb = -(-2 * max(form.unit_bytes(u) for u in units) // MIB)
    return max(need_mb, AUTO_BUFFER_FLOOR_MB) * MIB


def read_ahead_bytes(buffer_bytes: int) -> int:
    """The ``nvme`` optimizer tier's read-ahead window, in bytes of state, whatever the units'
    sizes: half its pool, so that as many bytes again can be written back behind the update
    while the window is full (``offload.Pipeline``). Its loads run chunk by chunk on every I/O
    thread, so a window holding one large unit keeps them all as busy as many small ones."""
    return buffer_bytes // 2


def spill_dtype(offload: OffloadConfig) -> torch.dtype:
    """The dtype ``offload.grad_spill_dtype`` stores spilled gradient shards in."""
    return DTYPES[offload.grad_spill_dtype]


def gradient_dtype(config: Config, world_size: int) -> torch.dtype:
    """The dtype a rank buckets, shards and copies its gradients in: fp32, or the compute dtype
    where nothing is summed or scaled in them (one rank, one micro-batch a step, no loss
    scaling). The update widens each gradient as it reads it (and clips it in the same pass), a
    spill in fp32 as it stores it; both are exact, so the result is the fp32 bucket's bit for
    bit, for half the bucket's memory and half the bytes each gradient moves from the device to
    the host (FSDP2's ``reduce_dtype``, where no reduction needs the width)."""
    compute = compute_dtype(config.precision.compute_dtype)
    narrow = world_size == 1 and config.zero.grad_accum_steps == 1 and config.precision.loss_scaling == "none"
    return compute if narrow else torch.float32


def spill_buffer_bytes(offload: OffloadConfig, units: Iterable[UnitLayout], dtype: torch.dtype = torch.float32) -> int:
    """The host pool of gradient shards spilled to the store (``engine.tiers.grad_spill``) as
    ``dtype``: a third of the optimizer tier's for fp32 (half that for bf16), as an fp32
    gradient is a third of a unit's optimizer state, so its read-ahead keeps pace with the
    state's; at least two of the largest shards (one written while the next is filled)."""
    units = list(units)
    largest = max(shard_bytes(u, dtype) for u in units)
    share = optimizer_buffer_bytes(offload, units) * dtype.itemsize // (len(STATE_KINDS) * torch.float32.itemsize)
    return max(share, 2 * largest)


def checkpoint_bytes(layout: ModelLayout, form: StateForm = FP32_STATE) -> int:
    """Disk of one kept checkpoint, all ranks: one generation of optimizer state (what the
    in-place mode keeps live), whichever tier wrote it."""
    return store_bytes(layout, IN_PLACE, form)


def pinned_bytes(config: Config, layout: ModelLayout, dtype: torch.dtype) -> dict[str, int]:
    """What a rank's host<->device copies go through, by term, on a device apart from the host
    (``engine.runtime.pinned``): the host memory a copy reads or fills (gradient shards beside a
    host optimizer, parameter shards on the ``cpu`` tier), each tensor aligned as the pool cuts
    it; the rings that stage the masters' uploads and the gradients being added
    (``engine.runtime.staging``); and the staging pool of the ``nvme`` parameter tier, whose
    shards are copied from its buffers. No optimizer state is pinned: a master reaches the
    device rounded to the compute dtype, through its ring."""
    offload, zero = config.offload, config.zero
    trained = [u for u in layout.all_units if u.trainable]
    terms: dict[str, int] = {}
    if not offload.optimizer_on_device and trained:
        grad_dtype = gradient_dtype(config, layout.world_size)
        grads = [aligned(shard_bytes(u, grad_dtype)) for u in trained]
        terms["gradient shards"] = held_grad_shard_bytes(config, grads)
        if zero.grad_accum_steps > 1:  # later micro-batches' shards land in a ring before they are added
            terms["gradient additions"] = ring_bytes(max(grads))
        terms["master uploads"] = master_upload_bytes(layout, dtype)
    if zero.stage == 3 and offload.params_in_host_memory:
        terms["parameter shards"] = sum(aligned(shard_bytes(u, dtype)) for u in layout.all_units)
    elif zero.stage == 3 and offload.params_in_store:
        terms["parameter staging"] = param_pool_bytes(layout.all_units, dtype, param_window_bytes(zero, layout, dtype))
    return terms


def held_grad_shard_bytes(config: Config, shard_sizes: Sequence[int]) -> int:
    """Bytes of the gradient shards (of ``shard_sizes``) a rank holds at once while backward
    makes them, where each waits for the step in memory or is spilled: every one, or, spilled
    with one micro-batch a step, ``SPILL_HELD`` of each size (the pinned pool reuses a freed
    shard's piece only for one of its size)."""
    if not spills_gradients(config) or config.zero.grad_accum_steps > 1:
        return sum(shard_sizes)
    return sum(min(count, SPILL_HELD) * size for size, count in collections.Counter(shard_sizes).items())


def master_upload_bytes(layout: ModelLayout, dtype: torch.dtype) -> int:
    """The ring host masters are rounded to ``dtype`` in on their way to the device
    (``engine.runtime.staging``): two of the largest trained shard."""
    return ring_bytes(max((shard_bytes(u, dtype) for u in layout.all_units if u.trainable), default=0))


def pinned_limit_bytes(offload: OffloadConfig, need: dict[str, int]) -> int:
    """The pinned pool's bound: ``offload.pinned_mb``, or for ``"auto"`` what the plan needs."""
    return sum(need.values()) if offload.pinned_mb == "auto" else round(offload.pinned_mb * MIB)
