"""The order in which units are used in one iteration, learned by watching it.

A training iteration visits the same units in the same order every time (forward
0..K-1, backward K-1..0, recomputations, a module run twice), so the first one is
recorded and later ones are predicted from it: whatever comes next in the record can be
fetched ahead. An iteration that departs from the record (a data-dependent branch, an
evaluation pass) only costs the prediction: from the first difference on nothing is
predicted, that iteration is recorded instead, and it becomes the record for the next.

The records go with each committed step (``saved_orders``), so that a resumed run predicts its
first iteration too (``adopt_orders``): without them it fetched every unit on demand (at 10.1B
parameters on nvme the resumed first step waited 25.6 s for parameters; 0.36 s with them).
"""

from __future__ import annotations

import logging

from engine.state.partition import FROZEN_SUFFIX, ModelLayout, nested_in

logger = logging.getLogger(__name__)


class TracedOrder:
    """A recorded sequence of names and a position in it."""

    def __init__(self, what: str):
        self._what = what
        self._record: list[str] = []
        self._current: list[str] = []
        self._position = 0
        self._following = False  # whether this iteration has matched the record so far

    def start(self) -> None:
        """A new iteration begins; the one before becomes the record unless it followed it."""
        if self._current and not self._following:
            self._record = self._current
        self._current = []
        self._position = 0
        self._following = bool(self._record)

    def visit(self, name: str) -> None:
        """``name`` is used now."""
        self._current.append(name)
        if not self._following:
            return
        if self._position < len(self._record) and self._record[self._position] == name:
            self._position += 1
            return
        expected = self._record[self._position] if self._position < len(self._record) else "the end"
        logger.info("%s changed: %r used where the last iteration used %r; re-recording", self._what, name, expected)
        self._following = False

    def upcoming(self) -> list[str]:
        """What the record says comes after the last visit (nothing once the iteration departed)."""
        return self._record[self._position :] if self._following else []

    def adopt(self, record: list[str]) -> None:
        """Take ``record``, an order an earlier run recorded, as the record, unless one is held."""
        if not self._record:
            self._record = list(record)

    @property
    def recorded(self) -> list[str]:
        """The last full iteration's order (empty before one has finished)."""
        return list(self._record)


def saved_orders(**orders: TracedOrder) -> dict[str, list[str]]:
    """The records of ``orders`` by name, as a committed step keeps them."""
    return {name: order.recorded for name, order in orders.items()}


def adopt_orders(saved: dict[str, list[str]], units: set[str], **orders: TracedOrder) -> None:
    """Give each of ``orders`` its record from ``saved`` (``saved_orders``), unless that names a
    unit not in ``units``: a prediction is only worth making of the model that recorded it."""
    for name, order in orders.items():
        record = saved.get(name, [])
        if record and set(record) <= units:
            order.adopt(record)


def adopt_predicted(
    orders: dict[str, TracedOrder], units: list[str], needs: dict[str, list[str]], layout: ModelLayout, recompute: bool
) -> None:
    """Give ``orders`` without a record (a fresh run's: a resumed run adopted its own) the
    prediction of ``predicted_orders``; none where activations are recomputed, which runs the
    units in another order."""
    held = [u.name for u in layout.all_units]
    if not recompute:
        adopt_orders(predicted_orders(units, needs, held), set(held), **orders)


def predicted_orders(units: list[str], needs: dict[str, list[str]], held: list[str]) -> dict[str, list[str]]:
    """The orders a plain iteration follows, so that a fresh run's first step prefetches too.
    ``units``: the unit modules in definition order, the root last; ``needs``: the units each
    gathers when it runs; ``held``: the units the parameters hold. Forward gathers the root's,
    then each block's; backward starts at the root's output gradient and gathers the blocks'
    in reverse, and their gradient shards complete in that order, the root's last. Nested
    units run in another order: none is predicted for them. A model that runs otherwise (a
    unit run twice) only re-records at its first difference."""
    if any(nested_in(inner, outer) for outer in units for inner in units):
        return {}
    runs = [[u for u in needs.get(name, []) if u in held] for name in [units[-1], *units[:-1]]]
    root, blocks = runs[0], runs[1:]
    params = [*root, *(u for run in blocks for u in run), *root, *(u for run in reversed(blocks) for u in run)]
    trainable = [u for u in held if not u.endswith(FROZEN_SUFFIX)]
    grads = [u for run in [*reversed(blocks), root] for u in run if u in trainable]
    return {"params": params, "grads": grads}
