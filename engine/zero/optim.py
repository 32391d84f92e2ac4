"""AdamW on fp32 shards, the learning-rate schedule, and the global gradient norm and its clipping.

The update runs one unit's shard at a time (so shards can pass through host memory
from disk) with torch's own AdamW kernels called functionally: ``fused`` is the fastest
on CPU (see ``benchmarks.optimizer``) and bit-identical to ``AdamW(fused=True)``;
``foreach`` is bit-identical to torch's default ``AdamW``. Elementwise kernels give the
same bits on a flat shard as on the separate parameters it concatenates, and on a run of a
shard's elements as on the parameters of one group: so the parameters exempt from weight decay
(``engine.zero.decay``) are updated as torch updates a group with ``weight_decay = 0``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.adamw import adamw

from engine.config import OptimConfig
from engine.runtime.comm import Comm
from engine.runtime.scratch import scratch
from engine.zero.decay import ShardDecay


def lr_factor(step: int, config: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``config.lr`` at optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps``, then ``constant``, or a decay to ``min_lr_ratio`` over ``decay_steps`` (0:
    the rest of ``total_steps``), along a half cosine (``cosine``) or a straight line (``linear``,
    Hugging Face's default), held there after."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    decay_steps = config.decay_steps or max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    left = 1.0 - progress if config.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * left


def schedule_change(config: OptimConfig, step: int, planned: int | None, total: int) -> str | None:
    """What training for ``total`` steps changes of a run planned for ``planned`` (None: not
    recorded), resumed at ``step``: a decay (cosine or linear) over ``train.steps``
    (``optim.decay_steps = 0``) is stretched or squeezed from there on, so the learning rate
    jumps. None where the schedule is the same."""
    if planned is None or planned == total or config.schedule == "constant" or config.decay_steps:
        return None
    before, after = (config.lr * lr_factor(step, config, steps) for steps in (planned, total))
    keep = max(1, planned - config.warmup_steps)
    return (
        f"train.steps is {total} where the run was planned for {planned}: its {config.schedule} decay runs over "
        f"train.steps (optim.decay_steps = 0), so from step {step} the learning rate follows a new curve "
        f"({before:.3g} -> {after:.3g} now); to keep the old one, set optim.decay_steps = {keep}"
    )


class ShardAdamW:
    """Decoupled-weight-decay Adam with bias correction, applied to flat fp32 shards."""

    def __init__(self, config: OptimConfig):
        self.config = config
        self._fused = config.kernel == "fused"

    def new_step_counter(self, device: torch.device) -> torch.Tensor:
        """The per-shard step count the kernels increment (torch keeps it as a float32 tensor)."""
        return torch.zeros((), dtype=torch.float32, device=device if self._fused else "cpu")

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
    ) -> None:
        """One AdamW step on one shard, in place. A ``grad`` spilled in bf16 is widened first,
        and multiplied by ``grad_scale`` (clipping's coefficient, ``clip_coefficient``) if given:
        the gradient is scratch, overwritten. ``decay`` says which elements take weight decay
        (None: all); a shard holding both kinds is updated as torch's ``AdamW`` updates two
        parameter groups: the kernel once over the runs that decay, once, at no decay, over
        the others (views, no copy), each run with its own copy of the step count. ``skip``
        (one fp32 value on the shard's device, torch's ``found_inf``) nonzero leaves the shard
        and its count as they were, without the host reading it: the fused kernel takes it;
        the foreach kernel cannot, so there it is read."""
        if skip is not None and not self._fused:
            if skip.item():
                return
            skip = None
        grad = grad.float()
        if grad_scale is not None:
            torch._foreach_mul_([grad], grad_scale)
        uniform = True if decay is None else decay.uniform
        if uniform is not None or self.config.weight_decay == 0:
            weight_decay = self.config.weight_decay if uniform is not False else 0.0
            self._adamw([master], [grad], [exp_avg], [exp_avg_sq], [step], lr, weight_decay, skip)
            return
        assert decay is not None  # a uniform shard returned above
        for decays in (True, False):
            parts = decay.slices(decays)
            params, grads, exp_avgs, exp_avg_sqs = ([t[p] for p in parts] for t in (master, grad, exp_avg, exp_avg_sq))
            steps = [step.clone() for _ in parts]  # the kernels add 1 to each: the shard's step counts once
            wd = self.config.weight_decay if decays else 0.0
            self._adamw(params, grads, exp_avgs, exp_avg_sqs, steps, lr, wd, skip)
        step.add_(1 if skip is None else 1 - skip)

    def _adamw(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
        lr: float,
        weight_decay: float,
        skip: torch.Tensor | None = None,
    ) -> None:
        """torch's AdamW kernel (fused or foreach) on one group of tensors, as ``torch.optim.AdamW``
        calls it on one parameter group; the fused one skipped where ``skip`` is nonzero."""
        beta1, beta2 = self.config.betas
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=not self._fused,
            fused=self._fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=weight_decay,
            eps=self.config.eps,
            maximize=False,
            found_inf=skip,
        )


def piece_norms(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each host tensor's L2 norm as ``get_total_norm`` takes it (one foreach pass, whose result
    for a tensor does not depend on the others in the list), to be combined later by
    ``norm_of_norms``: the pieces need not all be in memory at once. A bf16 piece is widened to
    fp32 and normed there by the same kernel, which gives its fp32 copy's norm bit for bit."""
    if not pieces or pieces[0].dtype == torch.float32:
        return list(torch._foreach_norm(pieces, 2.0))
    return [_widened_norm(piece) for piece in pieces]


NORM_SCRATCH_NUMEL = 64 << 20
"""Elements of the largest narrow piece ``piece_norms`` widens in the thread's scratch (256 MiB
of fp32: a 7-8B Llama's largest projection, 59M). Widened by torch, each piece's fp32 copy is
fresh memory: a 2B Llama's layers' norms took 1.39 s a step that way against 0.64 s in a buffer
written over (``engine.runtime.scratch``), an 8B's 5.35 s against 4.08 (``benchmarks.grad_norms``),
CPU the optimizer worker takes from the compute's cores. A larger piece (a vocabulary's
embedding) is widened by torch, so that the buffer the thread keeps for the run stays this size."""


def norm_scratch_numel(piece_numels: Iterable[int]) -> int:
    """Elements of the scratch ``piece_norms`` keeps to widen narrow pieces of these sizes."""
    return max((n for n in piece_numels if n <= NORM_SCRATCH_NUMEL), default=0)


def _widened_norm(piece: torch.Tensor) -> torch.Tensor:
    if piece.numel() > NORM_SCRATCH_NUMEL:
        return torch._foreach_norm([piece], 2.0, dtype=torch.float32)[0]
    wide = scratch("piece norm", piece.numel(), torch.float32, piece.device).view(piece.shape)
    return torch._foreach_norm([wide.copy_(piece)], 2.0)[0]


UNIT_NORM_PIECE = 1 << 20
"""Elements per piece of ``unit_norm``: few enough pieces that each norm's parallel region is
worth its threads' meeting (in pieces of 2**16 the meetings were most of a 1B-parameter
step's norms, the other core being busy with I/O), and a bf16 piece's fp32 copy (4 MiB) is
reused, not fresh memory."""


def unit_norm(grad: torch.Tensor) -> torch.Tensor:
    """One gradient shard's L2 norm (fp32), combined from the norms of its pieces of
    ``UNIT_NORM_PIECE`` elements; a bf16 shard's pieces are each widened into one fp32
    scratch piece (``engine.runtime.scratch``) and normed there, with the kernel that norms an
    fp32 shard's own, so both give the same bits. Widened whole, a 36M-element bf16 shard took
    88 ms, its fp32 copy being fresh memory; in these pieces, 18 ms."""
    pieces = grad.split(UNIT_NORM_PIECE)
    if grad.dtype != torch.float32:
        wide = scratch("unit norm", min(grad.numel(), UNIT_NORM_PIECE), torch.float32, grad.device)
        return norm_of_norms([torch.linalg.vector_norm(wide[: p.numel()].copy_(p)) for p in pieces])
    return norm_of_norms([torch.linalg.vector_norm(p) for p in pieces])


def norm_of_norms(norms: list[torch.Tensor]) -> torch.Tensor:
    """``get_total_norm`` of the pieces whose ``piece_norms`` these are, in the same order."""
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def global_norm(local: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The norm over every rank of each rank's ``local`` norm (squared, summed in float64)."""
    if comm.world_size == 1:
        return local
    total = math.sqrt(comm.all_reduce_value(float(local) ** 2, op="sum"))
    return torch.tensor(total, dtype=torch.float32, device=local.device)


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """What clipping multiplies each gradient by so that a global norm of ``total`` becomes at
    most ``max_norm``: the arithmetic of ``torch.nn.utils.clip_grads_with_norm_`` (``max_norm /
    (total + 1e-6)`` clamped to 1, and always applied), so that one rank matches torch bit for
    bit."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)
