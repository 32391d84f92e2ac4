"""After clipping, the host worker's update of one unit overlaps the hand-on of the unit before it.

With clipping on, every unit waits for the global norm and is updated at ``step()``
(``Update.apply_remaining``). With a host worker the next unit's AdamW must be queued on the
worker before the unit before it is handed on (its copy to the device and its gathers, on the
training thread), or the worker idles through every hand-on. Each hand-on here (but the
step's last) waits a while for the next unit's AdamW to start: one at a time, it never does.
"""

from __future__ import annotations

import threading

import pytest

from engine.engine import Engine
from engine.runtime.device import SIM_ENV
from engine.zero.step import UnitWork
from tests.engine.test_host_worker import plan_config
from tests.training import batches, tiny_gpt

STEPS = 2
PATIENCE_S = 5.0
"""How long a hand-on waits for the next unit's AdamW to start: far more than the worker takes
to pick up a job already queued."""


class Interleaving:
    """Counts the units whose AdamW started and those handed on; each hand-on but the step's
    last records whether the next unit's AdamW started before it (waiting up to ``PATIENCE_S``,
    then not at all)."""

    def __init__(self, units: int):
        self._units, self._started, self._handed_on = units, 0, 0
        self._changed = threading.Condition()
        self.overlapped: list[bool] = []

    def compute_starts(self) -> None:
        with self._changed:
            self._started += 1
            self._changed.notify_all()

    def hand_on_starts(self) -> None:
        with self._changed:
            if (self._handed_on + 1) % self._units:
                patience = PATIENCE_S if all(self.overlapped) else 0.0
                next_started = lambda: self._started >= self._handed_on + 2  # noqa: E731
                self.overlapped.append(self._changed.wait_for(next_started, timeout=patience))
            self._handed_on += 1


@pytest.mark.parametrize(("stage", "optimizer", "param"), [(3, "cpu", "cpu"), (2, "nvme", "device")])
def test_the_next_units_update_starts_before_a_unit_is_handed_on(stage, optimizer, param, tmp_path, monkeypatch):
    monkeypatch.setenv(SIM_ENV, "seed=5,delay_ms=1")
    cfg = plan_config(stage, optimizer, param, str(tmp_path / "store"), optim={"grad_clip": 0.05})
    eng = Engine(tiny_gpt(), cfg, total_steps=STEPS)
    interleaving = Interleaving(len(eng.layout.units))
    compute, hand_on = UnitWork.compute, UnitWork.hand_on

    def recorded_compute(self, *args) -> None:
        interleaving.compute_starts()
        compute(self, *args)

    def recorded_hand_on(self, *args) -> None:
        interleaving.hand_on_starts()
        hand_on(self, *args)

    monkeypatch.setattr(UnitWork, "compute", recorded_compute)
    monkeypatch.setattr(UnitWork, "hand_on", recorded_hand_on)
    data = batches(4)
    for _ in range(STEPS):
        eng.backward(eng(*data.next()))
        eng.step()
    eng.close()
    assert len(interleaving.overlapped) == STEPS * (len(eng.layout.units) - 1)
    assert all(interleaving.overlapped), interleaving.overlapped
