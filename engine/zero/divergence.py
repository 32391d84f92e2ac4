"""A diverged step: its gradients (or its loss) are not finite, so it must never be committed.

AdamW would turn a nan or inf gradient into nan masters and moments; committed, they
poison the store, and every later run resumes them. The engine therefore stops such a step
on every rank before its commit, with ``DivergedError``, whose message says what was not
finite, where the run can resume, and what to change. Where the step is caught depends on
what sees every gradient first (see ``Engine.step``): the global norm before any update
(clipping, and steps not overlapped with backward), the fp16 loss scaler's overflow check
(which skips the step instead), or, when each unit is updated inside backward, the unit's
gradient norm before its update.
"""

from __future__ import annotations

from engine.config import Config

NAMED_UNITS = 3
"""Units a message names before counting the rest."""


class DivergedError(FloatingPointError):
    """A step's gradients or loss were not finite: the step was not committed, and the
    engine takes no further step. Raised on every rank."""


def nonfinite_units(per_rank: list[list[tuple[str, float]]]) -> str:
    """What was not finite, from each rank's units whose gradient norm was not (by rank)."""
    found = [f"{norm} in unit {name!r} on rank {rank}" for rank, units in enumerate(per_rank) for name, norm in units]
    more = f" and {len(found) - NAMED_UNITS} more" if len(found) > NAMED_UNITS else ""
    return f"the gradient norm is {', '.join(found[:NAMED_UNITS])}{more}"


def remedies(config: Config) -> str:
    """The changes that keep the next run finite, of those this configuration leaves open (fp16
    always has loss scaling: the configuration refuses it without)."""
    lower = f"lower optim.lr (now {config.optim.lr:g})"
    return lower if config.optim.grad_clip > 0 else f"{lower} or enable optim.grad_clip (e.g. 1.0)"


def diverged_message(step: int, what: str, where: str, config: Config) -> str:
    """One line: the step, what was not finite, where the run can resume (``where``, from the
    optimizer tier), and the fix."""
    return f"step {step} diverged ({what}) and was not committed: {where}; fix: {remedies(config)}"
