"""The order in which units are used in one iteration, learned by watching it.

A training iteration visits the same units in the same order every time (forward
0..K-1, backward K-1..0, recomputations, a module run twice), so the first one is
recorded and later ones are predicted from it: whatever comes next in the record can be
fetched ahead. An iteration that departs from the record (a data-dependent branch, an
evaluation pass) only costs the prediction: from the first difference on nothing is
predicted, that iteration is recorded instead, and it becomes the record for the next. Two
neighbours that trade places are no such difference: hooks on one tensor (a unit's output
that is the model's output too) fire in an order a prediction made before the first
iteration cannot know, so the iteration goes on following and becomes the record.

The records go with each committed step (``saved_orders``), so that a resumed run predicts its
first iteration too (``adopt_orders``): without them it fetched every unit on demand (at 10.1B
parameters on nvme the resumed first step waited 25.6 s for parameters; 0.36 s with them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from engine.state.partition import FROZEN_SUFFIX, ModelLayout

logger = logging.getLogger(__name__)


class TracedOrder:
    """A recorded sequence of names and a position in it."""

    def __init__(self, what: str):
        self._what = what
        self._record: list[str] = []
        self._current: list[str] = []
        self._position = 0
        self._following = False  # whether this iteration has matched the record so far
        self._passed: str | None = None  # the entry stepped over for its neighbour, due next
        self._swapped = False  # whether this iteration traded neighbours: its order is the better record

    def start(self) -> None:
        """A new iteration begins; the one before becomes the record unless it followed it (a
        whole one that traded neighbours does)."""
        whole = len(self._current) == len(self._record)
        if self._current and (not self._following or (self._swapped and whole)):
            self._record = self._current
        self._current = []
        self._position = 0
        self._following = bool(self._record)
        self._passed, self._swapped = None, False

    def visit(self, name: str) -> None:
        """``name`` is used now."""
        self._current.append(name)
        if not self._following:
            return
        record, at = self._record, self._position
        if at < len(record) and record[at] == name:
            self._position += 1
        elif name == self._passed:
            self._passed = None
        elif at + 1 < len(record) and record[at + 1] == name:
            self._passed, self._swapped = record[at], True
            self._position += 2
        else:
            expected = record[at] if at < len(record) else "the end"
            logger.info(
                "%s changed: %r used where the last iteration used %r; re-recording", self._what, name, expected
            )
            self._following = False

    def iteration(self) -> list[str]:
        """This iteration's order as far as it is known: the record while it follows it, else
        what it visited so far (which the next iteration is predicted to follow)."""
        return list(self._record if self._following else self._current)

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
    prediction of ``predicted_orders``."""
    held = [u.name for u in layout.all_units]
    adopt_orders(predicted_orders(units, needs, held, recompute), set(held), **orders)


def unit_tree(units: list[str]) -> dict[str, list[str]]:
    """Each unit's children, in definition order: the units whose innermost enclosing unit it
    is (``units`` as ``predicted_orders`` takes them; units in no other hang under the root)."""
    root = units[-1]
    children: dict[str, list[str]] = {name: [] for name in units}
    for name in units[:-1]:
        paths = (name[:cut] for cut in reversed([i for i, c in enumerate(name) if c == "."]))
        children[next((p for p in paths if p in children and p != root), root)].append(name)
    return children


def predicted_orders(
    units: list[str], needs: dict[str, list[str]], held: list[str], recompute: bool = False
) -> dict[str, list[str]]:
    """The orders a plain iteration follows, so that a fresh run's first step prefetches too.
    ``units``: the unit modules in definition order, inner units before the unit they are
    nested in, the root last; ``needs``: the units each gathers when it runs; ``held``: the
    units the parameters hold; ``recompute``: whether the outermost units recompute their
    activations (``engine.zero.recompute``).

    The units form a tree (``unit_tree``). Forward gathers a unit's needs, then runs its
    children in definition order; backward starts at the root's output gradient and gathers a
    unit's needs, then its children's in reverse. A recomputed unit's backward gathers its
    needs and its last child's (whose output, a residual added to it, is the unit's: its
    gradient arrives before anything needs the activations), then runs all its children's
    forward again, then the rest of their backward. A unit's gradient shard completes after all
    its children's, so shards complete in the reverse of the tree's definition order, children
    first and the root last. A model that runs otherwise (a unit run twice, children called
    out of their definition order) only re-records at its first difference."""
    root = units[-1]
    children = unit_tree(units)
    trainable = {u for u in held if not u.endswith(FROZEN_SUFFIX)}

    def own(name: str) -> list[str]:
        return [u for u in needs.get(name, []) if u in held]

    def walk(names: Iterable[str], backward: bool) -> list[str]:
        return [u for name in names for u in gathers(name, backward)]

    def gathers(name: str, backward: bool) -> list[str]:
        inner = children[name]
        if not backward:
            return [*own(name), *walk(inner, False)]
        if recompute and inner and name in children[root]:
            last = inner[-1]
            rest = [*reversed(children[last]), *reversed(inner[:-1])]
            return [*own(name), *own(last), *walk(inner, False), *walk(rest, True)]
        return [*own(name), *walk(reversed(inner), True)]

    def completions(name: str) -> list[str]:
        inner = (u for child in reversed(children[name]) for u in completions(child))
        return [*inner, *(u for u in own(name) if u in trainable)]

    return {"params": [*gathers(root, False), *gathers(root, True)], "grads": completions(root)}
