"""8-bit block-wise moments (``optim.state_dtype = "int8"``), as in 8-bit Adam (Dettmers et
al. 2022): each block of ``BLOCK`` values is stored as ``BLOCK`` one-byte codes and its fp32
absolute maximum, ``PACKED`` bytes in all, so a block's bytes sit together and a shard of
whole blocks is a plain byte range (any world size reads any other's store).

The codes are a companded (power-law) map, not linear: an Adam moment spans orders of
magnitude within a block, and a linear code would round most of the small second moments to
zero, whose update ``m / (sqrt(v) + eps)`` then explodes. ``exp_avg`` (signed) keeps
``sign * sqrt(|m| / absmax)`` on 127 levels a side, resolving down to 1/127**2 of the block's
largest; ``exp_avg_sq`` (non-negative) keeps ``(v / absmax) ** (1/4)`` on 255 levels, down to
1/255**4, so ``sqrt(v)`` is resolved to 1/255**2 of the block's largest, finer than ``m``.
Both play the part of bitsandbytes' dynamic quantisation map, with a closed-form encode and
decode instead of a search over its 256 values, so the code is a few vectorised torch ops.

Rounding to a code is stochastic, with noise seeded by the step count (``add_noise_``; as
for bf16 moments, ``engine.zero.moments``): small per-step changes to a moment survive on
average, and a resumed run draws the same noise.
"""

from __future__ import annotations

import torch

BLOCK = 256
"""Values per block (one fp32 scale each)."""
PACKED = BLOCK + 4
"""Bytes per stored block: its codes, then its scale."""

_LEVELS = {True: 127.0, False: 255.0}  # signed: codes -127..127; non-negative: 0..255
_POWER = {True: 2.0, False: 4.0}  # value / absmax = (code / levels) ** power


NOISE_PERIOD = 1 << 16
"""Random draws made per rounding call, repeated along the tensor (``add_noise_``)."""


def add_noise_(flat: torch.Tensor, seed: int) -> None:
    """Add uniform noise to each element of ``flat``: integers in [0, 2**16) to int32, floats in
    [0, 1) to float32, drawn from a generator seeded by ``seed``. One table of ``NOISE_PERIOD``
    draws repeats along the tensor: each element still gets a fresh uniform draw at each call,
    which is all stochastic rounding needs for each value's rounding to be unbiased over the
    steps, at a small fraction of the cost of one draw per element (which made the update
    several times slower than the AdamW kernel itself)."""
    generator = torch.Generator(device=flat.device).manual_seed(seed)
    if flat.dtype == torch.int32:
        table = torch.randint(0, 1 << 16, (NOISE_PERIOD,), dtype=torch.int32, device=flat.device, generator=generator)
    else:
        table = torch.rand(NOISE_PERIOD, device=flat.device, generator=generator)
    whole = flat.numel() // NOISE_PERIOD * NOISE_PERIOD
    flat[:whole].view(-1, NOISE_PERIOD).add_(table)
    flat[whole:].add_(table[: flat.numel() - whole])


def packed_bytes(numel: int) -> int:
    """Bytes holding ``numel`` values (a multiple of ``BLOCK``) as blocks."""
    return numel // BLOCK * PACKED


def _blocks(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (blocks x ``BLOCK`` bytes) and scales (blocks x 1 fp32) of a packed tensor."""
    rows = packed.view(-1, PACKED)
    return rows[:, :BLOCK], rows[:, BLOCK:].view(torch.float32)


def dequantize(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values a packed tensor (uint8, ``packed_bytes(n)``) holds, as a new flat tensor."""
    codes, scales = _blocks(packed)
    levels = _LEVELS[signed]
    values = (codes.view(torch.int8) if signed else codes).float()
    if signed:
        values.square_().copysign_(codes.view(torch.int8)).mul_(scales / levels**2)  # sign * code**2
    else:
        values.square_().square_().mul_(scales / levels**4)
    return values.view(-1)


def quantize_(packed: torch.Tensor, values: torch.Tensor, signed: bool, seed: int) -> None:
    """Store fp32 ``values`` (flat, a multiple of ``BLOCK``) into ``packed``, rounding each code
    stochastically; ``values`` is overwritten (non-negative) or kept (signed)."""
    rows = values.view(-1, BLOCK)
    codes, scales = _blocks(packed)
    levels = _LEVELS[signed]
    magnitude = rows.abs() if signed else rows
    absmax = magnitude.amax(dim=1, keepdim=True)
    scales.copy_(absmax)
    factor = torch.where(absmax > 0, levels ** _POWER[signed] / absmax, 0.0)
    companded = magnitude.mul_(factor).sqrt_()  # code = levels * (x / absmax) ** (1/p)
    if not signed:
        companded.sqrt_()
    add_noise_(companded.view(-1), seed)
    companded.floor_()
    if signed:
        codes.view(torch.int8).copy_(companded.clamp_(max=levels).copysign_(rows))
    else:
        # No code 0: a v decoded as 0 would make ``m / (sqrt(v) + eps)`` a step of m / eps; the
        # least code keeps sqrt(v) at 1/255**2 of the block's largest (for a v that is truly 0,
        # m is 0 too, and so is the step).
        codes.copy_(companded.clamp_(1.0, levels))
