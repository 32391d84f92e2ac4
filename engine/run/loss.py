"""The causal-LM cross-entropy over chunks of tokens: a micro-batch's fp32 logits never exist whole.

The plain loss, ``F.cross_entropy(head(hidden).float().flatten(0, 1), targets.flatten())``,
makes the logits of every token at once and autograd keeps their fp32 log-softmax until
backward. At a 128k vocabulary (131,072) and 4,096 tokens that is 4,096 x 131,072 x 4 B =
2 GiB of fp32 logits per sequence (1.96 GiB at Llama 3's 128,256), kept from the loss to its
backward, and backward makes two more tensors of that size (the gradients of the
log-softmax's output and input). ``chunked_cross_entropy`` makes one chunk of ``chunk_tokens``
tokens at a time: at the default 1,024 tokens one chunk's fp32 logits are 1,024 x 131,072 x 4 B
= 512 MiB, a quarter of that, freed before the next chunk, and it keeps nothing of them for
backward: only the hidden states (which the head's matmul keeps in the plain loss too), the
head's weight (a reference, no copy), the targets, and a scalar.

Backward recomputes each chunk's logits (one more matmul per chunk, a third more of the
head's work) rather than computing the gradients in forward as Liger's fused linear
cross-entropy does. Recomputing is exact, because the same ops run on the same inputs, and
simpler: forward computes only the loss (an evaluation forward costs no gradients, and the
upstream gradient, scaled for accumulation or fp16, is applied where autograd would apply
it), and no weight-sized gradient is held from forward to backward. What it asks is that the
head's weight hold its values again when backward runs: at ZeRO stage 3 the engine
re-gathers the unit that owns it when the loss's gradient arrives, before this backward
(``engine.zero.params``).

Each chunk's logits are made in the head's dtype (or autocast's, as ``F.linear`` would under
it) and widened to fp32 for the softmax, as the plain loss does. The head's gradient is each
chunk's product in that dtype (bf16 rounds each chunk's share, where the plain loss rounds
its one product), summed over chunks in fp32 and cast to the weight's dtype once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CHUNK_TOKENS", "IGNORE_INDEX", "chunked_cross_entropy", "loss_through_head"]

CHUNK_TOKENS = 1024
"""Tokens whose logits exist at once, unless the caller says otherwise: at 1,024 one chunk's
fp32 logits are 4 KiB per vocabulary entry (512 MiB at 128k), while the matmuls stay large
enough to run at full speed."""
IGNORE_INDEX = -100
"""A target that the loss does not count (padding, prompt tokens): Hugging Face's value."""


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """The mean cross-entropy (fp32) of the logits ``hidden @ weight.T + bias`` against
    ``targets``, over the tokens whose target is not ``IGNORE_INDEX``: the sum of their losses
    over their count (0, with a graph, if none counts).

    ``hidden`` is ``[..., d]`` in any dtype, ``weight`` the output head's ``[vocab, d]``,
    ``targets`` int64 ``[...]``. ``chunk_tokens`` (default ``CHUNK_TOKENS``, read at the call)
    bounds the tokens whose logits exist at once, in forward and in backward.
    """
    chunk = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match hidden states of shape {tuple(hidden.shape)}: "
            f"give one target per token, [batch, seq] for hidden [batch, seq, d]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"the head's weight has shape {tuple(weight.shape)}, not [vocab, {hidden.shape[-1]}]: pass the output "
            f"head's weight (nn.Linear(d, vocab).weight)"
        )
    if hidden.shape[:-1].numel() <= chunk:
        # One chunk: its logits are all there is, and autograd's own loss is the deterministic
        # one (the recomputing Function gave last-bit differences between runs of one step
        # inside the engine, with two threads, that this path does not).
        logits = _logits(hidden, weight, bias, F.linear(hidden[..., :0, :], weight, bias).dtype)
        total = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1).to(torch.float32)
    loss = _ChunkedCrossEntropy.apply(hidden, weight, targets, bias, chunk)
    assert isinstance(loss, torch.Tensor)
    return loss


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One chunk's logits made in ``dtype`` (the head's, or autocast's), widened to fp32."""
    b = None if bias is None else bias.to(dtype)
    return F.linear(hidden.to(dtype), weight.to(dtype), b).float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward: the loss, chunk by chunk, keeping no logits. Backward: each chunk's logits
    again, turned in place into their gradient, then into the chunk's share of the gradients
    of ``hidden``, ``weight`` and ``bias``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None,
        chunk: int,
    ) -> torch.Tensor:
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        # The dtype F.linear gives here (autocast's, if it is on): backward, run outside
        # autocast, casts to it explicitly, which is what autocast does.
        dtype = F.linear(flat[:0], weight, bias).dtype
        w = weight.to(dtype)  # cast once, not per chunk
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, flat.shape[0], chunk):
            logits = _logits(flat[start : start + chunk], w, bias, dtype)
            part = flat_targets[start : start + chunk]
            total += F.cross_entropy(logits, part, ignore_index=IGNORE_INDEX, reduction="sum")
            del logits  # the next chunk's logits take its place
        count = (flat_targets != IGNORE_INDEX).sum().clamp(min=1).to(torch.float32)
        ctx.save_for_backward(hidden, weight, targets, bias, count)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, bias, count = ctx.saved_tensors
        want_hidden, want_weight, _, want_bias, _ = ctx.needs_input_grad
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        scale = grad.float() / count  # d(mean)/d(token loss), times the upstream gradient
        dtype = ctx.dtype
        w = weight.to(dtype)  # cast once, not per chunk
        grad_hidden = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, flat.shape[0], ctx.chunk):
                h = flat[start : start + ctx.chunk].to(dtype)
                logits = _logits(h, w, bias, dtype)
                d_logits = _logits_grad_(logits, flat_targets[start : start + ctx.chunk], scale).to(dtype)
                del logits
                if grad_hidden is not None:
                    grad_hidden[start : start + ctx.chunk] = d_logits @ w
                if grad_weight is not None:
                    _accumulate(grad_weight, d_logits.t(), h)
                if grad_bias is not None:
                    grad_bias += d_logits.sum(0, dtype=torch.float32)
        return (
            None if grad_hidden is None else grad_hidden.view_as(hidden),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
        )


def _logits_grad_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The gradient of ``scale`` x (sum of the chunk's counted token losses) with respect to
    its fp32 ``logits``, made in their place: ``(softmax - one_hot(target)) * scale`` on
    counted rows, zero on ignored ones (no data-dependent shapes: no host sync)."""
    counted = targets != IGNORE_INDEX
    logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()  # the softmax
    minus_one = logits.new_full((logits.shape[0], 1), -1.0)
    logits.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), minus_one)  # an ignored row's is zeroed next
    return logits.mul_((counted * scale).unsqueeze(1))


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` into fp32 ``total``, in place where the dtypes allow."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total += a @ b


def loss_through_head(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``chunked_cross_entropy`` of ``hidden`` through ``head``, computed inside a call of the
    head module (on one position, whose logits are thrown away): an engine that gathers a
    unit's parameters only while its module runs (ZeRO stage 3, the head a unit of its own) has
    the weight gathered then, and, the loss being the head's output, gathers it again for the
    loss's backward, which recomputes the logits from it."""

    def loss_of(module: nn.Module, args: Any, output: Any) -> torch.Tensor:
        return chunked_cross_entropy(hidden, head.weight, targets, head.bias)

    handle = head.register_forward_hook(loss_of, prepend=True)  # before the engine's own hook
    try:
        return head(hidden[..., :1, :])
    finally:
        handle.remove()
