"""Activation checkpointing per unit: keep a unit's inputs, recompute its insides in backward.

Each outermost unit's ``forward`` is replaced by one that runs under non-reentrant
``torch.utils.checkpoint``. Module hooks fire from ``Module.__call__``, not from
``forward``, so the recomputation runs none of the unit's own hooks: at stage 3 the unit
was gathered for its backward already and is not released in the middle of it. A unit nested
inside it (a projection in its layer) is called through ``Module.__call__`` as the
recomputation runs, and its hooks gather it as in forward.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.state.partition import nested_in


def outermost(units: list[tuple[str, nn.Module]], root: str) -> list[tuple[str, nn.Module]]:
    """The units inside no other unit, ``root`` (the model itself) aside: a nested unit is
    recomputed within its outer unit's recomputation already, and checkpointed itself it would
    run its forward a third time (a projection's matmul, for nothing: what it saves for
    backward is its input anyway)."""
    names = [name for name, _ in units if name != root]
    return [(name, module) for name, module in units if name in names and not any(nested_in(name, o) for o in names)]


def checkpoint_forward(module: nn.Module) -> None:
    """Make ``module`` save only its inputs for backward and recompute the rest."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
