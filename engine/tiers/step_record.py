"""The committed step record: what a step remembers besides its tensors, checked on resume.

``Engine`` commits it with every step (and with every checkpoint) as JSON in the store.
Whatever JSON a resume finds there is checked field by field before any of it is used, so
that a record changed outside the engine is refused with one line naming the file and the
field, not a ``KeyError`` or ``TypeError`` deep inside the resume.
"""

from __future__ import annotations

import math
from typing import Any

from engine.tiers import rng
from offload import ManifestError

COUNTS = ("step", "skipped_steps", "optimizer_steps", "world_size", "total_steps")
"""Fields that are non-negative integers; only ``step`` is required."""


def check_step_record(record: dict[str, Any], where: str) -> None:
    """Refuse (``ManifestError``) a record ``Engine`` could not resume from; ``where`` names its file."""

    def bad(field: str, why: str) -> ManifestError:
        return ManifestError(
            f"{where}: field {field!r} {why}; the file was changed outside the engine: restore it from a backup, "
            f"or resume from a checkpoint"
        )

    for field in COUNTS:
        value = record.get(field, 0)
        if field == "step" and field not in record:
            raise bad(field, "is missing")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(field, f"holds {value!r}, where a non-negative integer belongs")
    scale = record.get("loss_scale", {"scale": 1.0, "clean_steps": 0})
    if not (
        isinstance(scale, dict)
        and isinstance(scale.get("scale"), (int, float))
        and math.isfinite(scale["scale"])
        and scale["scale"] > 0
        and isinstance(scale.get("clean_steps"), int)
    ):
        raise bad("loss_scale", f"holds {scale!r}, not a positive finite scale and a count of clean steps")
    if not isinstance(record.get("client_state", {}), dict):
        raise bad("client_state", f"holds a JSON {type(record['client_state']).__name__}, not an object")
    orders = record.get("unit_order", {})
    if not (isinstance(orders, dict) and all(_names(names) for names in orders.values())):
        raise bad("unit_order", f"holds {orders!r}, not lists of unit names by what they order")
    states = record.get("rng", [])
    if not isinstance(states, list):
        raise bad("rng", "is not a list of per-rank random states")
    for rank, state in enumerate(states):
        try:
            rng.check(state)
        except ValueError as err:
            raise bad("rng", f"entry {rank} is {err}") from None


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)
