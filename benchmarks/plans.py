"""The tier plans the step and scale benchmarks compare: where the state lives, at which ZeRO stage.

A plan is the part of the config that decides what a step moves: the stage and the
tiers of the optimizer state and of the compute-dtype parameter shards. Everything
else is the engine's default (`engine.config`), so a benchmark measures the run a
user gets from `python -m engine train` with only these keys changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import Config, Tier


@dataclass(frozen=True)
class TierPlan:
    """A ZeRO stage and the tiers of the optimizer state and of the parameter shards."""

    key: str
    """Short name for the command line, e.g. ``s3-nvme-nvme``."""
    stage: int
    optimizer: Tier
    param: Tier = "device"

    @property
    def label(self) -> str:
        """How tables and plots name the plan."""
        param = f" + param {self.param}" if self.param != "device" else ""
        return f"stage {self.stage}, optimizer {self.optimizer}{param}"

    @property
    def uses_store(self) -> bool:
        """Whether a step moves bytes through the nvme store."""
        return "nvme" in (self.optimizer, self.param)

    def compute_only(self) -> TierPlan:
        """The same stage with every tier on the device: the step's compute without offload."""
        return TierPlan(f"s{self.stage}-device", self.stage, "device", "device")

    def config(self, nvme_path: Path, sections: dict[str, dict[str, Any]] | None = None) -> Config:
        """The engine's default config with this plan's keys, a store at ``nvme_path`` and ``sections``
        (e.g. ``{"model": {"preset": "tiny"}}``) on top."""
        raw: dict[str, dict[str, Any]] = {
            "zero": {"stage": self.stage},
            "offload": {"optimizer": self.optimizer, "param": self.param, "nvme_path": str(nvme_path)},
        }
        for name, values in (sections or {}).items():
            raw[name] = raw.get(name, {}) | values
        return Config.from_dict(raw)


PLANS: dict[str, TierPlan] = {
    plan.key: plan
    for plan in (
        TierPlan("s2-cpu", 2, "cpu"),
        TierPlan("s2-nvme", 2, "nvme"),
        TierPlan("s3-nvme-cpu", 3, "nvme", "cpu"),
        TierPlan("s3-nvme-nvme", 3, "nvme", "nvme"),
    )
}
"""The offloaded plans, from the least to the most data moved per step."""
