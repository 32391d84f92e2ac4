"""The refusal, before a stage-3 run's first forward, of a device memory limit that even one
unit at a time cannot meet: better a clear error naming the size that fits than an
out-of-memory error half-way into the first step."""

from __future__ import annotations

from engine.runtime.budget import DeviceBudget, DeviceMemoryError
from engine.runtime.sizes import MIB
from engine.state.partition import ROOT_UNIT, nested_in


def check_units_fit(
    budget: DeviceBudget,
    sizes: dict[str, int],
    persistent: dict[str, bool],
    grad_bucket_bytes: dict[str, int],
    in_flight: int,
) -> None:
    """Refuse a limit under what stays resident, the root's working set, the largest other
    unit's parameters (``sizes``, gathered; none for a ``persistent`` unit, resident already)
    and gradient bucket with those of the units it runs inside, and the buckets still being
    reduced (``in_flight``)."""
    if not budget.limit:
        return
    root = ROOT_UNIT if ROOT_UNIT in sizes else None

    def working_set(name: str) -> int:
        return (0 if persistent[name] else sizes[name]) + grad_bucket_bytes[name]

    if not (others := [n for n in sizes if n != root]):
        return

    def running(name: str) -> list[str]:  # the unit and those it runs inside (experts in their layer)
        return [o for o in others if o == name or nested_in(name, o)]

    largest = max(others, key=lambda n: sum(working_set(o) for o in running(n)))
    held, inside = sum(working_set(o) for o in running(largest)), [o for o in running(largest) if o != largest]
    resident = budget.used + (working_set(root) if root else 0)
    need = resident + held + (in_flight - 1) * max(grad_bucket_bytes.values())
    if need > budget.limit:
        raise DeviceMemoryError(
            f"unit {largest!r}{f' (inside {inside[0]!r})' if inside else ''} needs {held / MIB:.2f} MiB of device "
            f"memory while it runs (gathered parameters and gradient buckets) on top of {resident / MIB:.2f} MiB "
            f"held throughout (shards, persistent units, the root unit) and buckets being reduced: "
            f"{need / MIB:.2f} MiB in all, over zero.device_memory_limit_mb = {budget.limit / MIB:.4g}; raise the "
            f"limit to at least {need / MIB:.1f}, or split the unit (zero.unit_classes: name a class inside it "
            f"too, such as a mixture-of-experts layer's experts, to make that a unit of its own)"
        )
