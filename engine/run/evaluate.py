"""Validation loss of ``python -m engine train``: the same held-out batches every time.

The batches are drawn afresh from the start of the held-out tokens at each evaluation, so two
evaluations differ only by the weights between them and the curve is comparable step to step.
The forwards run under ``torch.no_grad()``: at stage 3 each unit is gathered for its forward and
released after it, and no unit is gathered again for a backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.engine import Engine
from engine.run.data import TokenBatches


@dataclass
class Validation:
    """``batches`` forwards over held-out tokens, every ``every`` steps."""

    held_out: np.ndarray | Callable[[int, int], Any]
    """Held-out tokens, drawn as windows, or what makes a rank's batches of held-out examples
    from ``(rank, world_size)`` (fine-tuning records: ``RecordData.batches``)."""
    seq_len: int
    micro_batch: int
    batches: int
    every: int
    loss_of: Callable[..., torch.Tensor] = Engine.__call__
    """The loss of a batch ``(x, y)`` (fine-tuning records: ``(x, y, positions)``) through the engine's forward."""

    def due(self, step: int, last_step: int) -> bool:
        """Every ``every`` steps, and after the last step, so a run always ends with a value."""
        return step % self.every == 0 or step == last_step

    def loss(self, engine: Engine, seed: int) -> float:
        """Mean next-token loss over the held-out batches, averaged over the ranks."""
        rank, world = engine.comm.rank, engine.comm.world_size
        if callable(self.held_out):
            data = self.held_out(rank, world)
        else:
            data = TokenBatches(
                self.held_out,
                seq_len=self.seq_len,
                micro_batch=self.micro_batch,
                rank=rank,
                world_size=world,
                seed=seed,
            )
        total = 0.0
        with torch.no_grad():
            for _ in range(self.batches):
                total += self.loss_of(engine, *data.next()).item()
        return engine.comm.all_reduce_value(total / self.batches) / world


def perplexity(loss: float) -> float:
    """``exp(loss)``, or inf where that overflows (a diverging run's loss)."""
    return math.exp(loss) if loss < 700 else math.inf
