"""Where an ``Engine`` is in its step cycle, and the check every public call makes first.

A step is a fixed sequence of calls: a forward (``eng(...)``) and ``backward(loss)`` for each
micro-batch (``zero.grad_accum_steps``), then ``step()``. The engine's state between the
calls differs (gradients held, an optimizer update half applied, a commit still in flight),
and a call made at the wrong point would act on the wrong state: ``step()`` before the last
``backward`` would step nothing, a ``save`` before ``step()`` would keep a half-updated
state. So the engine records its phase, as PyTorch FSDP2 records its ``TrainingState``, and
each call names the phases it runs in (``expect``); any other phase raises ``PhaseError``,
naming the call, the phase and the call that comes first.

    IDLE / COMMIT_PENDING --eng(...)--> FORWARD --backward, not last--> ACCUMULATING --eng(...)--> FORWARD
    FORWARD --backward, last micro-batch--> UPDATING --step()--> COMMIT_PENDING (deferred) or IDLE

A forward may also be an evaluation, whose loss never goes backward: it is a FORWARD like
any other, and the next forward simply follows it. DIVERGED, FAILED and CLOSED end the
cycle: only ``close`` (and reading the parameters) follows them.
"""

from __future__ import annotations

import enum


class StepPhase(enum.Enum):
    """The engine's phase, as its last public call left it: what it holds and what comes next."""

    def __init__(self, holds: str, next_call: str) -> None:
        self.holds = holds
        """What the engine holds in this phase."""
        self.next_call = next_call
        """What moves it on: the call any refused one must wait for."""

    IDLE = ("between steps, no commit pending", "call eng(...) first")
    COMMIT_PENDING = (
        "between steps, the last step's commit deferred to the next step's last backward (store.defer_commit), "
        "its update perhaps to the next forward (optim.defer_update)",
        "call eng(...) first",
    )
    FORWARD = ("a forward ran and its loss awaits backward", "call backward(loss) first")
    ACCUMULATING = (
        "the gradients of the step's earlier micro-batches held, the next micro-batch's forward due",
        "call eng(...) first",
    )
    UPDATING = (
        "the step's last micro-batch went backward: its optimizer update is open until step()",
        "call step() first (or abandon_step(what))",
    )
    DIVERGED = (
        "a step diverged and was not committed",
        "close() it, then resume from the last committed step or a checkpoint",
    )
    FAILED = (
        "a call raised part-way through a step, which is lost",
        "close() it, then resume from the last committed step or a checkpoint",
    )
    CLOSED = (
        "closed: its hooks, I/O and process group are released",
        "build a new Engine (Engine.resume continues a store)",
    )


BETWEEN_UPDATES = frozenset({StepPhase.IDLE, StepPhase.COMMIT_PENDING, StepPhase.FORWARD, StepPhase.ACCUMULATING})
"""The phases with no optimizer update open: the parameters and the optimizer state are
those of the last step, whole, so the model can run, be read and be saved."""


class PhaseError(RuntimeError):
    """A public ``Engine`` call made in a phase it cannot run in; the engine is unchanged."""

    def __init__(self, call: str, phase: StepPhase) -> None:
        super().__init__(f"Engine.{call} cannot run in phase {phase.name} ({phase.holds}): {phase.next_call}")
        self.call = call
        self.phase = phase


def expect(phase: StepPhase, call: str, *allowed: StepPhase) -> None:
    """Refuse ``call`` with ``PhaseError`` unless ``phase`` is one of ``allowed``."""
    if phase not in allowed:
        raise PhaseError(call, phase)
