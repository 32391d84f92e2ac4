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

Rounding to a code is stochastic, with noise from a generator seeded by the step count (as
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
    ratio = (codes.view(torch.int8) if signed else codes).float().div_(_LEVELS[signed])
    values = ratio.abs().pow_(_POWER[signed]).mul_(scales)
    if signed:
        values.mul_(ratio.sign())
    return values.view(-1)


def quantize_(packed: torch.Tensor, values: torch.Tensor, signed: bool, seed: int) -> None:
    """Store fp32 ``values`` (flat, a multiple of ``BLOCK``; overwritten as scratch) into
    ``packed``, rounding each code stochastically."""
    rows = values.view(-1, BLOCK)
    codes, scales = _blocks(packed)
    # Signed: the sign, kept apart. Non-negative: which values are positive, none of which may
    # decode to 0 (``m / (sqrt(v) + eps)`` would take a step of m / eps), so their least code
    # is 1: sqrt(v) at least 1/255**2 of the block's largest.
    mark = rows.signbit() if signed else rows > 0
    absmax = rows.abs_().amax(dim=1, keepdim=True)
    scales.copy_(absmax)
    companded = rows.div_(absmax.clamp_min_(torch.finfo(torch.float32).tiny))
    companded.pow_(1.0 / _POWER[signed]).mul_(_LEVELS[signed])
    generator = torch.Generator(device=values.device).manual_seed(seed)
    companded.add_(torch.rand(companded.shape, device=values.device, generator=generator)).floor_()
    companded.clamp_(max=_LEVELS[signed])
    if signed:
        codes.view(torch.int8).copy_(torch.where(mark, -companded, companded))
    else:
        codes.copy_(torch.maximum(companded, mark))
