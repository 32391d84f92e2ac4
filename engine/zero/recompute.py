"""Activation checkpointing per unit: keep a unit's inputs, recompute its insides in backward.

The unit's ``forward`` is replaced by one that runs under non-reentrant
``torch.utils.checkpoint``. Module hooks fire from ``Module.__call__``, not from
``forward``, so the recomputation runs none of the engine's unit hooks: at stage 3 the
unit was gathered for its backward already and is not released in the middle of it.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_forward(module: nn.Module) -> None:
    """Make ``module`` save only its inputs for backward and recompute the rest."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
