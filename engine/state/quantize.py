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

Rounding to a code is stochastic, with noise seeded by the step count (``noise_table``; as
for bf16 moments, ``engine.zero.compact_update``): small per-step changes to a moment survive on
average, and a resumed run draws the same noise. ``encode`` and ``decode`` are pure tensor
functions, so the update fuses them with AdamW into one compiled pass
(``engine.zero.compact_update``).
"""

from __future__ import annotations

import math

import torch

from offload import DIRECT_ALIGN

BLOCK = 256
"""Values per block (one fp32 scale each)."""
PACKED = BLOCK + 4
"""Bytes per stored block: its codes, then its scale."""
DIRECT_BLOCKS_ELEMS = BLOCK * (DIRECT_ALIGN // math.gcd(PACKED, DIRECT_ALIGN))
"""The fewest values whose packed bytes are a whole number of O_DIRECT blocks (2**18): a chunk
of a multiple of them is read and written with O_DIRECT, any other through the page cache."""

# Integers: a float constant here reached the compiler as a symbolic float, which it then
# specialised and traced the whole update again (2.8 s more of a process's first update).
_LEVELS = {True: 127, False: 255}  # signed: codes -127..127; non-negative: 0..255
_POWER = {True: 2, False: 4}  # value / absmax = (code / levels) ** power
_FULL_SCALE = {signed: float(_LEVELS[signed] ** _POWER[signed]) for signed in (True, False)}
"""``levels ** power``, worked out here: written in the update, a compiled kernel raises it
again for every vector (``std::pow``, half the fused update's time)."""


NOISE_PERIOD = 1 << 16
"""Random draws made per rounding call, repeated along the tensor (``noise_table``)."""


def noise_table(seed: int, integer: bool, device: torch.device) -> torch.Tensor:
    """``NOISE_PERIOD`` uniform draws from a generator seeded by ``seed``: integers in [0, 2**16)
    (int32) to add to an fp32 value's bits below bfloat16's mantissa, or floats in [0, 1) to add
    to a code before flooring. The table repeats along the tensor it rounds (element ``i`` takes
    draw ``i % NOISE_PERIOD``, ``periodic``): each element still gets a fresh uniform draw at each call, which
    is all stochastic rounding needs for each value's rounding to be unbiased over the steps, at
    a small fraction of the cost of one draw per element."""
    generator = torch.Generator(device=device).manual_seed(seed)
    if integer:
        return torch.randint(0, 1 << 16, (NOISE_PERIOD,), dtype=torch.int32, device=device, generator=generator)
    return torch.rand(NOISE_PERIOD, device=device, generator=generator)


def periodic(table: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` draws: ``table`` repeated, element ``i`` taking draw ``i % NOISE_PERIOD``. Indexed
    a row of ``BLOCK`` at a time, so that compiled code reads each row's draws contiguously (an
    index per element is 3x slower)."""
    rows = table.view(-1, BLOCK)
    index = torch.arange(-(-numel // BLOCK), device=table.device) % rows.shape[0]
    return rows[index].view(-1)[:numel]


def round_bits(value: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to bfloat16, given integer ``noise`` in [0, 2**16)
    per element: the noise added to the bits below bfloat16's mantissa, then those bits dropped,
    so the result is exact and rounds up with probability equal to the dropped fraction."""
    bits = (value.view(torch.int32) + noise) & -(1 << 16)
    return bits.view(torch.float32).to(torch.bfloat16)


def packed_bytes(numel: int) -> int:
    """Bytes holding ``numel`` values (a multiple of ``BLOCK``) as blocks."""
    return numel // BLOCK * PACKED


def blocks(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (blocks x ``BLOCK`` bytes) and scales (blocks x 1 fp32) of a packed tensor."""
    rows = packed.view(-1, PACKED)
    return rows[:, :BLOCK], rows[:, BLOCK:].view(torch.float32)


def decode(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values (blocks x ``BLOCK``) that ``blocks`` hold."""
    if signed:
        code = codes.view(torch.int8).float()
        return code * code.abs() * (scales / _FULL_SCALE[signed])  # sign * code**2
    code = codes.float()
    return (code * code) * (code * code) * (scales / _FULL_SCALE[signed])


def encode(rows: torch.Tensor, noise: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8, as ``blocks`` holds them) and scales of fp32 ``rows`` (blocks x
    ``BLOCK``), each code rounded up with probability its fraction, ``noise`` being uniform in
    [0, 1) per element."""
    levels = _LEVELS[signed]
    magnitude = rows.abs() if signed else rows
    absmax = magnitude.amax(dim=1, keepdim=True)
    factor = torch.where(absmax > 0, _FULL_SCALE[signed] / absmax, 0.0)
    companded = (magnitude * factor).sqrt()  # code = levels * (x / absmax) ** (1/p)
    if signed:
        code = (companded + noise).floor().clamp(max=levels).copysign(rows)
        return code.to(torch.int8).view(torch.uint8), absmax
    # No code 0: a v decoded as 0 would make ``m / (sqrt(v) + eps)`` a step of m / eps; the
    # least code keeps sqrt(v) at 1/255**2 of the block's largest (for a v that is truly 0,
    # m is 0 too, and so is the step).
    return (companded.sqrt() + noise).floor().clamp(1.0, levels).to(torch.uint8), absmax
