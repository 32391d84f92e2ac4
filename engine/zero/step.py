"""The arithmetic of an optimizer step, apart from the engine's phases: AdamW on each unit's
shard, the global gradient norm and clipping, and the per-unit norms that tell whether a step
updated inside backward diverged. The engine decides when each runs and what a divergence
does; this decides the numbers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import Config
from engine.runtime.comm import Comm
from engine.tiers.optimizer import ShardState
from engine.zero.divergence import nonfinite_units
from engine.zero.grads import GradientShards
from engine.zero.moments import CompactAdamW
from engine.zero.optim import clip_grads_, grad_norm
from engine.zero.params import ReplicatedParams, ShardedParams
from engine.zero.partition import ModelLayout, UnitLayout, param_views
from engine.zero.update import overlaps_backward


class StepMath:
    """AdamW over the units' shards, with the norms that guard it."""

    def __init__(
        self,
        config: Config,
        layout: ModelLayout,
        comm: Comm,
        grads: GradientShards,
        params: ReplicatedParams | ShardedParams,
        model: nn.Module,
        opt_device: torch.device,
    ):
        self._config, self._layout, self._comm = config, layout, comm
        self._grads, self._params = grads, params
        self._param_order = [name for name, param in model.named_parameters() if param.requires_grad]
        """The model's own parameter order, which torch's gradient norm follows."""
        self.adam = CompactAdamW(config.optim)
        self._counters = {u.name: self.adam.new_step_counter(opt_device) for u in layout.units}
        self.overlap = overlaps_backward(config)
        """Whether each unit is updated as its gradient is reduced (nothing waits for all of them)."""
        self.unit_norms: dict[str, float] = {}
        """This step's gradient norm of each unit updated inside backward, taken before its update."""
        self.last_grad_norm: float | None = None
        """The last step's global gradient norm before clipping (None with loss scaling and no
        clipping: nothing takes it there)."""

    def optimizer_steps(self) -> int:
        """AdamW steps taken (the bias correction's count), for the step's record."""
        return int(next(iter(self._counters.values())).item())

    def restore(self, optimizer_steps: int) -> None:
        for counter in self._counters.values():
            counter.fill_(optimizer_steps)

    def apply(self, unit: UnitLayout, state: ShardState, lr: float) -> None:
        """AdamW on one unit's shard, then hand the new master to the parameters.

        Inside backward (overlap) nothing has seen every gradient, so the unit's own gradient
        norm is taken first, and a unit whose norm is not finite is left as it was (the step
        then stops on every rank, see ``check_unit_norms``; raising here, in an autograd hook,
        would leave the other ranks waiting in their collectives). Its unchanged master is still
        handed on: every rank must take part in the same parameter gathers."""
        grad = self._grads.ready(unit.name)
        finite = True
        if self.overlap:
            norm = self.unit_norms[unit.name] = float(torch.linalg.vector_norm(grad))
            finite = math.isfinite(norm)
        if finite:
            self.adam.update(state.master, grad, state.exp_avg, state.exp_avg_sq, self._counters[unit.name], lr)
        self._params.write_back(unit, state.master)
        self._grads.release_shard(unit.name)

    def check_norm(self, grads: list[torch.Tensor], loss_scaling: bool) -> str | None:
        """Before any unit is updated: the global gradient norm; what is not finite (the step
        diverged), or None once the gradients are clipped (``optim.grad_clip``). Loss scaling
        without clipping needs neither: its overflow check has passed."""
        clip = self._config.optim.grad_clip
        if clip == 0 and loss_scaling:
            return None
        norm = grad_norm(self._norm_pieces(grads), self._comm)
        self.last_grad_norm = float(norm)
        if not math.isfinite(self.last_grad_norm):
            return f"the gradient norm is {self.last_grad_norm}"
        if clip > 0:
            clip_grads_(grads, clip, norm)
        return None

    def check_unit_norms(self) -> str | None:
        """After updates inside backward, each taken only if its unit's gradient norm was
        finite: what no rank updated (the step diverged), or None. One all-reduce of the squared
        norms agrees on it on every rank (nan and inf survive the sum) and gives the global norm."""
        squares = sum(norm * norm for norm in self.unit_norms.values())
        self.last_grad_norm = math.sqrt(self._comm.all_reduce_value(squares, op="sum"))
        if math.isfinite(self.last_grad_norm):
            return None
        left_out = [(name, norm) for name, norm in self.unit_norms.items() if not math.isfinite(norm)]
        return nonfinite_units(self._comm.all_gather_object(left_out))

    def _norm_pieces(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the global gradient norm is taken over: on one rank each parameter's gradient
        (views of the unit shards, which are whole there) in the model's parameter order, as
        ``torch.nn.utils.clip_grad_norm_`` takes it, so that the norm is torch's bit for bit; on
        several ranks a parameter may span shards, so each rank's shards."""
        if self._comm.world_size > 1:
            return grads
        views = {}
        for unit in self._layout.units:
            views.update(param_views(self._grads.ready(unit.name), unit))
        return [views[name] for name in self._param_order]
