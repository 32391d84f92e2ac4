"""The arithmetic of an optimizer step, apart from the engine's phases: AdamW on each unit's
shard, the global gradient norm and clipping, and the per-unit norms that tell whether a step
updated inside backward diverged. The engine decides when each runs and what a divergence
does; this decides the numbers.

With spilled gradients (``engine.tiers.grad_spill``) the step takes what it needs from each
shard as backward finishes it, before it goes to disk: its unscaling and overflow flag (loss
scaling) and its pieces' norms, combined at the step into torch's global norm bit for bit; the
clipping then scales each shard as it comes back, with the same coefficient.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from engine.config import Config, overlaps_backward
from engine.runtime.comm import Comm
from engine.state.forms import ShardState
from engine.state.partition import ModelLayout, UnitLayout, param_views
from engine.tiers.grad_spill import GradSpill
from engine.zero.compact_update import CompactAdamW
from engine.zero.decay import no_decay_names, shard_decays
from engine.zero.divergence import nonfinite_units
from engine.zero.grads import GradientShards, PendingShard
from engine.zero.optim import clip_coefficient, clip_grads_, global_norm, grad_norm, norm_of_norms, piece_norms
from engine.zero.params import Params
from engine.zero.precision import LossScaler
from engine.zero.update import Update


class StepMath:
    """AdamW over the units' shards, with the norms that guard it."""

    def __init__(
        self,
        config: Config,
        layout: ModelLayout,
        comm: Comm,
        grads: GradientShards,
        params: Params,
        model: nn.Module,
        opt_device: torch.device,
        spill: GradSpill | None = None,
    ):
        self._config, self._layout, self._comm = config, layout, comm
        self._grads, self._params = grads, params
        self.spill = spill
        """Where each unit's final gradient shard waits for the step, when not in memory."""
        self._scaler: LossScaler | None = None
        """The loss scaler of the step being spilled, which unscales each shard as it is made."""
        self._param_order = [name for name, param in model.named_parameters() if param.requires_grad]
        """The model's own parameter order, which torch's gradient norm follows."""
        self.adam = CompactAdamW(config.optim)
        self._counters = {u.name: self.adam.new_step_counter(opt_device) for u in layout.units}
        self._decay = shard_decays(layout, comm.rank, no_decay_names(model, config.optim.no_decay))
        """Which elements of each unit's shard take weight decay (``optim.no_decay``)."""
        self.overlap = overlaps_backward(config)
        """Whether each unit is updated as its gradient is reduced (nothing waits for all of them)."""
        self.unit_norms: dict[str, float] = {}
        """This step's gradient norm of each unit updated inside backward, taken before its update."""
        self.last_grad_norm: float | None = None
        """The last step's global gradient norm before clipping (None with loss scaling and no
        clipping: nothing takes it there)."""
        self._takes_norm = not (config.optim.grad_clip == 0 and config.precision.loss_scaling != "none")
        """Whether a step waiting for every gradient takes their norm (see ``check_norm``)."""
        self._update: Update | None = None
        """The step's update, while its gradients are being spilled and until they are read back."""
        self._piece_norms: dict[str, torch.Tensor] = {}
        """The norms of the spilled gradients' pieces (``_norm_pieces``), by parameter or unit."""
        self.found_inf: torch.Tensor | None = None
        """Whether a spilled gradient held inf/nan (loss scaling), for ``LossScaler.unscale_and_check``."""
        self._clip_norm: torch.Tensor | None = None
        """The global norm the spilled gradients are clipped with as they come back."""
        self.lr = 0.0
        """The learning rate of the step being updated (``begin``)."""

    def begin(self, update: Update, scaler: LossScaler, lr: float) -> Callable[[str], None] | None:
        """The step's last backward starts, its update to be made at learning rate ``lr``: what
        to call with each unit's name as its gradient shard becomes final
        (``GradientShards.on_ready``): its update inside backward, its spill (unscaled by
        ``scaler`` first), or nothing (the shards wait in memory)."""
        self.unit_norms, self._piece_norms, self._clip_norm, self.lr = {}, {}, None, lr
        if self.overlap:
            return update.ready
        if self.spill is None:
            return None
        self._update, self._scaler = update, scaler
        self.found_inf = torch.zeros(1) if scaler.enabled else None
        self.spill.begin()
        return self._spill_unit

    def _spill_unit(self, unit_name: str) -> None:
        """Unscale the unit's final shard and take its pieces' norms (what the step needs of it),
        then spill it to disk and free it."""
        assert self._update is not None and self.spill is not None  # ``begin`` hands this out only then
        unit, grad = self._layout.unit(unit_name), self._grads.ready(unit_name)
        if self.found_inf is not None and self._scaler is not None:
            self._scaler.unscale_([grad], self.found_inf)
        if self._takes_norm:
            pieces = self._unit_pieces(unit, grad)
            self._piece_norms.update(zip(pieces, piece_norms(list(pieces.values())), strict=True))
        self._update.wait_s += self.spill.write(unit, grad)
        self._grads.release_shard(unit_name)

    def optimizer_steps(self) -> int:
        """AdamW steps taken (the bias correction's count), for the step's record."""
        return int(next(iter(self._counters.values())).item())

    def restore(self, optimizer_steps: int) -> None:
        for counter in self._counters.values():
            counter.fill_(optimizer_steps)

    def take_grad(self, unit: UnitLayout) -> PendingShard:
        """The unit's gradient shard in memory, with the copy that may still be filling it
        (on the training thread: the copies' bookkeeping is its own)."""
        return self._grads.take(unit.name)

    def compute(self, unit: UnitLayout, state: ShardState, grad: torch.Tensor, spilled: bool) -> None:
        """AdamW on one unit's shard, at the step's learning rate (``begin``); on the host
        optimizer worker or the training thread, touching nothing but the unit's own tensors.
        A ``spilled`` gradient was read back from disk and is clipped here.

        Inside backward (overlap) nothing has seen every gradient, so the unit's own gradient
        norm is taken first, and a unit whose norm is not finite is left as it was (the step
        then stops on every rank, see ``check_unit_norms``; raising here, in an autograd hook,
        would leave the other ranks waiting in their collectives)."""
        scale = None
        if spilled and self._clip_norm is not None:  # widened and clipped in the update's own pass
            scale = clip_coefficient(self._config.optim.grad_clip, self._clip_norm)
        finite = True
        if self.overlap:
            norm = self.unit_norms[unit.name] = float(torch.linalg.vector_norm(grad))
            finite = math.isfinite(norm)
        if finite:
            counter, decay = self._counters[unit.name], self._decay[unit.name]
            self.adam.update(state.master, grad, state.exp_avg, state.exp_avg_sq, counter, self.lr, scale, decay)

    def hand_on(self, unit: UnitLayout, state: ShardState, spilled: bool) -> None:
        """On the training thread, after ``compute``: hand the new master to the parameters (its
        copy to the device and any gather, in the same order on every rank; a unit left
        unchanged is still handed on, since every rank must take part in the same gathers),
        and free a gradient shard held in memory."""
        self._params.write_back(unit, state.master)
        if not spilled:
            self._grads.release_shard(unit.name)

    def check_norm(self, grads: list[torch.Tensor]) -> str | None:
        """Before any unit is updated: the global gradient norm; what is not finite (the step
        diverged), or None once the gradients are clipped (``optim.grad_clip``), or will be as
        they come back from disk, whose reads start then. Loss scaling without clipping needs
        neither: its overflow check has passed."""
        clip = self._config.optim.grad_clip
        update, self._update = self._update, None
        if self._takes_norm:
            norm = self._global_norm(grads)
            self.last_grad_norm = float(norm)
            if not math.isfinite(self.last_grad_norm):
                return f"the gradient norm is {self.last_grad_norm}"
            if clip > 0 and self.spill is not None:
                self._clip_norm = norm
            elif clip > 0:
                clip_grads_(grads, clip, norm)
        if update is not None and self.spill is not None:
            update.read_grads(self.spill.read(update.order))
        return None

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """torch's norm of the pieces ``_norm_pieces`` cuts: of the gradients in memory, or
        combined from the norms the spill took."""
        if self.spill is None:
            return grad_norm(self._norm_pieces(grads), self._comm)
        order = self._param_order if self._comm.world_size == 1 else [u.name for u in self._layout.units]
        return global_norm(norm_of_norms([self._piece_norms[name] for name in order]), self._comm)

    def close(self) -> None:
        """Remove the spilled gradients, if any (before the engine's I/O runner closes)."""
        if self.spill is not None:
            self.spill.close()

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
            views.update(self._unit_pieces(unit, self._grads.ready(unit.name)))
        return [views[name] for name in self._param_order]

    def _unit_pieces(self, unit: UnitLayout, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's part of ``_norm_pieces``, by name: its parameters' views (one rank), or
        its shard (several)."""
        return param_views(grad, unit) if self._comm.world_size == 1 else {unit.name: grad}
