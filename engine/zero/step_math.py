"""The arithmetic of an optimizer step, apart from its control path (``engine.zero.step``):
AdamW over every unit's shard with each unit's step count and weight decay, and the global
gradient norm, taken as torch takes it.

On one rank the norm is ``torch.nn.utils.clip_grad_norm_``'s bit for bit: the norm of each
parameter's gradient in the model's parameter order. With spilled gradients
(``engine.tiers.grad_spill``) those pieces' norms are taken as backward finishes each shard,
before it goes to disk, and combined at the step into the same norm.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
from torch import nn

from engine.config import OptimConfig
from engine.runtime.comm import Comm
from engine.state.forms import ShardState, StateForm
from engine.state.partition import ModelLayout, UnitLayout, param_views
from engine.zero.compact_update import CompactAdamW, compile_ahead
from engine.zero.decay import no_decay_names, shard_decays
from engine.zero.divergence import nonfinite_units
from engine.zero.optim import global_norm, norm_of_norms, piece_norms


class UnitAdamW:
    """AdamW on each unit's shard: the unit's own step count (the bias correction's) and which
    of its elements take weight decay (``optim.no_decay``), with the kernel its state's form takes.

    Each unit's count is a tensor beside the state, as torch's kernels take it, mirrored by a
    number on the host: the compact kernel's seeds and the step's record read that one, since
    reading the tensor on an accelerator waits for the device, once per unit."""

    def __init__(self, optim: OptimConfig, layout: ModelLayout, rank: int, model: nn.Module, device: torch.device):
        self._adam = CompactAdamW(optim)
        self._counters = {u.name: self._adam.new_step_counter(device) for u in layout.units}
        self._counts = dict.fromkeys(self._counters, 0)
        """Each counter's value, kept on the host (a unit skipped for a gradient not finite counts
        here, though torch's fused kernel leaves its tensor: its step diverged, nothing steps after)."""
        self._decay = shard_decays(layout, rank, no_decay_names(model, optim.no_decay))
        self._device = device

    def compile_ahead(self, grad_dtype: torch.dtype) -> threading.Thread | None:
        """Start building the update's kernel for this run's state and gradients in
        ``grad_dtype`` (``compact_update.compile_ahead``), behind the first forward."""
        optim = self._adam.config
        master, moment, _ = StateForm.of(optim).dtypes()
        masked = optim.weight_decay != 0 and any(d.uniform is None for d in self._decay.values())
        return compile_ahead(optim, (master, moment, grad_dtype), self._device, masked)

    def update(
        self,
        unit: UnitLayout,
        state: ShardState,
        grad: torch.Tensor,
        lr: float,
        scale: torch.Tensor | None,
        skip: torch.Tensor | None = None,
    ) -> None:
        """One AdamW step on the unit's shard, in place; ``scale`` multiplies the gradient first
        (clipping's coefficient); ``skip`` (one fp32 value on the shard's device) nonzero
        leaves the shard as it was."""
        counter, decay = self._counters[unit.name], self._decay[unit.name]
        count = self._counts[unit.name] = self._counts[unit.name] + 1
        moments = (state.exp_avg, state.exp_avg_sq)
        self._adam.update(state.master, grad, *moments, counter, lr, scale, decay, skip, count)

    def steps_taken(self) -> int:
        """AdamW steps taken (the bias correction's count), for the step's record."""
        return next(iter(self._counts.values()))

    def restore(self, steps: int) -> None:
        for counter in self._counters.values():
            counter.fill_(steps)
        self._counts = dict.fromkeys(self._counters, steps)


class GradNorms:
    """The global gradient norm over the pieces it is taken over: on one rank each parameter's
    gradient (views of the unit shards, which are whole there) in the model's parameter order,
    as ``torch.nn.utils.clip_grad_norm_`` takes it; on several ranks a parameter may span
    shards, so each rank's shards."""

    def __init__(self, layout: ModelLayout, comm: Comm, model: nn.Module):
        self._layout, self._comm = layout, comm
        self._param_order = [name for name, param in model.named_parameters() if param.requires_grad]
        """The model's own parameter order, which torch's gradient norm follows."""

    def pieces(self, unit: UnitLayout, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's pieces, by name: its parameters' views (one rank), or its shard (several)."""
        return param_views(grad, unit) if self._comm.world_size == 1 else {unit.name: grad}

    def piece_norms(self, unit: UnitLayout, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """The norms of the unit's pieces, by name, for ``of_piece_norms`` to combine later."""
        pieces = self.pieces(unit, grad)
        return dict(zip(pieces, piece_norms(list(pieces.values())), strict=True))

    def in_memory(self, shard: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The norm of the gradient shards in memory, ``shard`` each unit's by name: taken piece
        by piece as ``of_piece_norms`` combines them (``piece_norms``, which widens shards kept
        in the compute dtype one piece at a time)."""
        norms: dict[str, torch.Tensor] = {}
        for unit in self._layout.units:
            norms.update(self.piece_norms(unit, shard(unit.name)))
        return self.of_piece_norms(norms)

    def of_piece_norms(self, norms: dict[str, torch.Tensor]) -> torch.Tensor:
        """The norm combined from every piece's norm (``piece_norms``), in the order ``in_memory`` takes them."""
        order = self._param_order if self._comm.world_size == 1 else [u.name for u in self._layout.units]
        return global_norm(norm_of_norms([norms[name] for name in order]), self._comm)

    def of_unit_norms(self, norms: dict[str, torch.Tensor]) -> tuple[float, str | None]:
        """The global norm from each unit's own (each a tensor on the optimizer's device, read
        here at once, one copy to the host for the step), and what is not finite on any rank
        (None if nothing): one all-reduce of the squared norms agrees on it on every rank (nan
        and inf survive the sum)."""
        read = torch.stack(list(norms.values())).tolist() if norms else []
        unit_norms = dict(zip(norms, read, strict=True))
        squares = sum(norm * norm for norm in unit_norms.values())
        norm = math.sqrt(self._comm.all_reduce_value(squares, op="sum"))
        if math.isfinite(norm):
            return norm, None
        left_out = [(name, n) for name, n in unit_norms.items() if not math.isfinite(n)]
        return norm, nonfinite_units(self._comm.all_gather_object(left_out))
