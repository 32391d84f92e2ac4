"""Loss scaling.

fp16 gradients underflow without a loss scale, and overflow with too large a one: the
dynamic scaler backs off and skips the step when any rank saw an inf/nan (so the fp32
masters are never touched by a bad gradient), and grows again after a run of clean steps.
"""

from __future__ import annotations

import torch

from engine.config import PrecisionConfig
from engine.runtime.comm import Comm


class LossScaler:
    """Scales the loss before backward, unscales gradients and detects overflow after it."""

    def __init__(self, config: PrecisionConfig):
        self.mode = config.loss_scaling
        self.scale = config.initial_scale if self.mode != "none" else 1.0
        self._growth_interval = config.growth_interval
        self._growth_factor = config.growth_factor
        self._backoff_factor = config.backoff_factor
        self._clean_steps = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, grads: list[torch.Tensor], comm: Comm, found_inf: torch.Tensor | None = None) -> bool:
        """Divide ``grads`` by the scale in place; True if any rank's gradients hold inf/nan.

        One fused pass does both the check and the unscale; the flag is then agreed on by
        all ranks, because a step must be skipped everywhere or nowhere. ``found_inf`` is the
        flag of gradients already unscaled (``unscale_``: spilled ones, as each was made).
        """
        if not self.enabled:
            return False
        found = torch.zeros(1) if found_inf is None else found_inf
        if grads:
            found = found.to(grads[0].device)
            self.unscale_(grads, found)
        return comm.all_reduce_value(found.item(), op="max") > 0

    def unscale_(self, grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """Divide ``grads`` by the scale in place, setting ``found_inf`` (one element, on their
        device) if any holds inf/nan. Elementwise, so unscaling shard by shard gives the bits
        of one pass over all of them."""
        inv_scale = torch.full((1,), 1.0 / self.scale, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)

    def update(self, overflow: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps (dynamic mode)."""
        if self.mode != "dynamic":
            return
        if overflow:
            self.scale *= self._backoff_factor
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps >= self._growth_interval:
            self.scale *= self._growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = float(state["scale"]), int(state["clean_steps"])
