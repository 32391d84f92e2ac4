"""AdamW on compact optimizer state (``engine.state.forms``) as one fused, compiled pass, and
``CompactAdamW``, which sends state of each form to its kernel.

The update widens the moments (and a bf16 master) to fp32, runs AdamW with torch's
arithmetic and rounds them back. Rounding is stochastic: a moment is an exponential average
whose per-step change, ``(1 - beta2) * g**2`` against ``v``, is often below half a bfloat16 ulp
(2**-9 relative), so rounding to nearest would freeze it; stochastic rounding keeps it
unbiased. A bf16 master's update far below its ulp (lr times a step of about 1, against a
weight of about 1, is below bfloat16's 2**-8 for any usual lr) likewise still moves it on
average instead of being lost. The random bits are seeded by the step count
(``engine.state.quantize.noise_table``), so a resumed run draws the same ones and stays
bit-identical to an uninterrupted run; the master's draws are a stream of their own
(``MASTER_SEED``).

Widening a bf16 master and the moments to fp32, running AdamW, and rounding all three back
stochastically is some forty elementwise passes in eager torch, each over memory: measured
here, 26 ns per parameter for 8-bit moments and a bf16 master, against 0.4 for fp32 state in
torch's fused kernel, which made the compact forms' arithmetic, not the disk, the step's
limit at 10B parameters. Written as one function of pure tensor operations and compiled
(``engine.runtime.compiled``), the same arithmetic reads each value once and writes it once:
about 1.7 ns per parameter (``RECOMPUTE``; 8-bit moments and a bf16 master, 2 threads), and
3.7-4.4 ns on a 2-core AVX-512 Xeon. On the host, int8 moments go to a hand-written loop of the
same formula instead, 1.2 ns there (``engine.zero.host_update``).
"""

from __future__ import annotations

import functools
import logging
import math
import threading

import torch

from engine.config import OptimConfig
from engine.runtime.compiled import LazyCompiled
from engine.state.quantize import BLOCK, blocks, decode, encode, noise_table, packed_bytes, periodic, round_bits
from engine.zero import host_update
from engine.zero.decay import ShardDecay
from engine.zero.optim import ShardAdamW

logger = logging.getLogger(__name__)

MASTER_SEED = 1 << 62
"""Offset of the master's rounding seeds, ``MASTER_SEED + step``: apart from the moments'
``2 * step + i`` at any step count a run reaches."""

MomentHeld = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A moment as the kernel takes it: a flat bf16/fp32 tensor, or int8 blocks' codes and scales,
both as bytes (blocks x ``BLOCK`` and blocks x 4): the compiler writes into a view of an
input only in the input's own dtype."""


def _widen(held: MomentHeld, signed: bool) -> torch.Tensor:
    """A moment as flat fp32."""
    if isinstance(held, tuple):
        codes, scales = held
        return decode(codes, scales.view(torch.float32), signed).view(-1)
    return held.float()


def _store(held: MomentHeld, value: torch.Tensor, noise: torch.Tensor, signed: bool, skip: torch.Tensor) -> None:
    """Write fp32 ``value`` back into ``held``'s form, rounding stochastically with ``noise``;
    where ``skip`` (bool) is true, leave ``held`` as it was: its stored bytes are kept, since
    decoding int8 blocks and encoding them again need not give the same blocks back."""
    if isinstance(held, tuple):
        codes, scales = held
        code, absmax = encode(value.view(-1, BLOCK), noise.view(-1, BLOCK), signed)
        # A select by arithmetic (bytes wrap around): a ``where`` over bytes is not vectorized by
        # Inductor's C++ backend, which made the whole update twice as slow (measured here).
        codes.copy_(code + (codes - code) * skip.to(torch.uint8))
        # Flat first: Inductor may lay the blocks x 1 reduction out with a last stride other than
        # 1, which a view as bytes refuses (on CUDA with dynamic shapes: the update ran uncompiled).
        scales.copy_(torch.where(skip, scales, absmax.reshape(-1).view(torch.uint8).view_as(scales)))
    elif held.dtype == torch.bfloat16:
        held.copy_(torch.where(skip, held, round_bits(value, noise)))
    else:
        held.copy_(torch.where(skip, held, value))


def compact_adamw_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: MomentHeld,
    exp_avg_sq: MomentHeld,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    hyper: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    decays: torch.Tensor | None = None,
) -> None:
    """One AdamW step, in place, with torch's arithmetic (decoupled weight decay, bias
    correction, ``eps`` outside the square root); ``hyper`` holds lr, beta1, beta2, eps,
    weight decay and the two bias corrections (a tensor: new values never recompile), and
    ``tables`` the noise of exp_avg, exp_avg_sq and the master (``noise_table``). The gradient
    (fp32, or a spilled one in bf16) is widened and multiplied by ``grad_scale`` (clipping's
    coefficient, or 1) in the same pass. ``skip`` (one fp32 value, as torch's fused kernels
    take theirs) nonzero leaves the shard as it was: a gradient found not finite on the device
    is skipped without the host reading the finding. ``decays`` (bool per element), if given,
    limits the weight decay to the elements it marks: per element, since a shard's runs of
    decayed parameters need not fall on the int8 moments' blocks, which cannot be cut."""
    lr, beta1, beta2, eps, weight_decay, correction1, correction2_sqrt = hyper.unbind()
    numel = master.numel()
    shrink = 1 - lr * weight_decay
    param = master.float() * (shrink if decays is None else torch.where(decays, shrink, 1.0))
    g = grad.float() * grad_scale
    m = _widen(exp_avg, signed=True)
    v = _widen(exp_avg_sq, signed=False)
    m = m + (g - m) * (1 - beta1)
    v = v * beta2 + g * g * (1 - beta2)
    param = param - (lr / correction1) * m / (v.sqrt() / correction2_sqrt + eps)
    skipped = skip != 0
    _store(exp_avg, m, periodic(tables[0], numel), True, skipped)
    _store(exp_avg_sq, v, periodic(tables[1], numel), False, skipped)
    _store(master, param, periodic(tables[2], numel), True, skipped)


RECOMPUTE = {
    key: 1 << 10
    for key in (
        "realize_opcount_threshold",
        "realize_cpu_opcount_threshold",
        "realize_reads_threshold",
        "realize_acc_reads_threshold",
        "realize_cpu_acc_reads_threshold",
    )
}
"""Inductor's settings for the update: the new moments feed both their blocks' absolute maximum
and their codes, and by default Inductor writes them to fresh fp32 buffers in between (8 bytes
per parameter written, read back, and page-faulted in each call); recomputing them from the
inputs instead is cheaper. Measured on the machine of the 1.7 ns above: 1.66 against 3.6 ns per
parameter."""

ADAMW = LazyCompiled(compact_adamw_, "the compact optimizer state's update", RECOMPUTE)


def held(moment: torch.Tensor) -> MomentHeld:
    """A stored moment as the kernel takes it (packed int8 blocks split into codes and scales)."""
    if moment.dtype != torch.uint8:
        return moment
    codes, scales = blocks(moment)
    return codes, scales.view(torch.uint8)


def compact_step(
    config: OptimConfig,
    master: torch.Tensor,
    grad: torch.Tensor,
    moments: tuple[torch.Tensor, torch.Tensor],
    step: int,
    lr: float,
    seeds: tuple[int, int, int],
    grad_scale: torch.Tensor | None = None,
    decay: ShardDecay | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """AdamW's ``step``-th update (1-based) of one shard whose master or moments are compact;
    ``seeds`` draw the rounding noise of exp_avg, exp_avg_sq and the master (unused by one in
    fp32); ``grad_scale`` multiplies the gradient first, ``decay`` says which elements take
    weight decay (None: all; ``ShardAdamW.update``), and ``skip`` (one fp32 value, on the
    shard's device) nonzero leaves the shard as it was. Only a shard holding both kinds of
    decay pays for a mask, a byte per element written and read."""
    beta1, beta2 = config.betas
    device = master.device
    uniform = True if decay is None else decay.uniform
    weight_decay = config.weight_decay if uniform is not False else 0.0
    values = (lr, beta1, beta2, config.eps, weight_decay, 1 - beta1**step, math.sqrt(1 - beta2**step))
    kinds = (moments[0].dtype == torch.uint8, moments[1].dtype == torch.uint8, False)
    tables = tuple(noise_table(seed, not floats, device) for seed, floats in zip(seeds, kinds, strict=True))
    scale = constant((1.0,), device) if grad_scale is None else grad_scale
    skip = constant((0.0,), device) if skip is None else skip
    mask = None if decay is None or uniform is not None or weight_decay == 0 else decay.mask(device)
    hyper = constant(values, device)
    if not host_update.update(master, grad, moments, tables, hyper, scale, skip, mask):
        ADAMW(master, grad, held(moments[0]), held(moments[1]), tables, hyper, scale, skip, mask)


@functools.lru_cache(maxsize=16)
def constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``values`` as fp32 on ``device`` (one value: a 0-d tensor), made once and shared, read
    only: every unit of a step takes the same hyper-parameters, and making them anew for each
    would copy them from pageable host memory each time, which on an accelerator waits for
    the copy."""
    return torch.tensor(values if len(values) > 1 else values[0], dtype=torch.float32, device=device)


class CompactAdamW(ShardAdamW):
    """``ShardAdamW`` on state of any form: fp32 goes straight to torch's kernel (bit-exact as
    before); bf16 and packed 8-bit moments, and a bf16 master, go through one fused pass that
    widens them to fp32, updates and rounds them back stochastically
    (``compact_step``)."""

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
        skip: torch.Tensor | None = None,
        count: int | None = None,
    ) -> None:
        """``ShardAdamW.update``; ``count`` is the step's number after it (what ``step`` then
        holds), where the caller knows it on the host: else it is read from ``step``, which on
        an accelerator waits for the device."""
        if master.dtype == exp_avg.dtype == torch.float32:
            super().update(master, grad, exp_avg, exp_avg_sq, step, lr, grad_scale, decay, skip)
            return
        step.add_(1)  # as torch's kernels count it (a skipped shard's step diverged: nothing steps after it)
        if count is None:
            count = int(step.item())
        seeds = (2 * count, 2 * count + 1, MASTER_SEED + count)  # a distinct stream per step and per tensor
        moments = (exp_avg, exp_avg_sq)
        compact_step(self.config, master, grad, moments, count, lr, seeds, grad_scale, decay, skip)


def compile_ahead(
    config: OptimConfig, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype], device: torch.device, masked: bool
) -> threading.Thread | None:
    """Start compiling the update for state of ``dtypes`` (master, moments, gradient) on
    ``device``, on a thread of its own, so that a process's first update finds its kernel built
    instead of waiting for the compiler on the step's path (measured: 9 s of a 2B-parameter
    fine-tune's first step on two cores; Triton's on a GPU is several seconds too). Run on two
    blocks of zeros, its shapes symbolic: the steps' shards of any length take the same kernel;
    ``masked`` builds the kernel for shards whose weight decay is per element too. Where the host
    kernel serves these dtypes (``host_update``), the thread builds that instead, in a fraction
    of a second, or, where it cannot be built, the torch kernel after all. None where nothing
    compiles: fp32 state goes to torch's fused kernel."""
    master, moment, _ = dtypes
    if master == moment == torch.float32:
        return None
    thread = threading.Thread(target=_warm, args=(config, dtypes, device, masked), name="offload-compile", daemon=True)
    thread.start()
    return thread


def _warm(
    config: OptimConfig, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype], device: torch.device, masked: bool
) -> None:
    """Each kernel ``compile_ahead`` builds, run once on zeros (lr 0); a failure is the first
    real update's to report (``LazyCompiled`` falls back there, or raises)."""
    master_dtype, moment_dtype, grad_dtype = dtypes
    if host_update.takes(device, master_dtype, moment_dtype, grad_dtype) and host_update.kernel() is not None:
        return  # built: the host kernel serves every shard of these dtypes, and nothing is compiled
    numel = 2 * BLOCK
    moment_numel = packed_bytes(numel) if moment_dtype == torch.uint8 else numel
    mixed = ShardDecay(((0, BLOCK, True), (BLOCK, numel, False)))
    try:
        if device.type != "cpu":
            torch.get_device_module(device.type).set_device(device)
        for decay in (None, mixed) if masked else (None,):
            master = torch.zeros(numel, dtype=master_dtype, device=device)
            grad = torch.zeros(numel, dtype=grad_dtype, device=device)
            exp_avg, exp_avg_sq = (torch.zeros(moment_numel, dtype=moment_dtype, device=device) for _ in range(2))
            compact_step(config, master, grad, (exp_avg, exp_avg_sq), 1, 0.0, (0, 1, MASTER_SEED), decay=decay)
    except Exception as err:  # the first real update compiles again and reports it
        logger.debug("compiling the update ahead failed: %s", err)
