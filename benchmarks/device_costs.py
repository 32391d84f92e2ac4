"""What each tier plan asks of a GPU per step, counted on the simulated asynchronous device.

    python -m benchmarks.device_costs [--quick] [--layers 2 8] [--plans KEY ...]

For each stage x optimizer tier x parameter tier, a tiny GPT in bf16 with clipping on trains a
few steps on `engine.runtime.sim_device`, which counts (after one warm-up step):

- host syncs / step: waits that hold the thread launching the kernels (on CUDA each drains
  the compute queued before the copy it waits for), by the function that waits; a plan whose
  count grows with the number of layers stalls the host once per unit;
- H2D B/param: bytes copied to the device per step per parameter, and whether every
  such copy already has its destination's dtype (a bf16 parameter filled from an fp32
  master inside the copy moves 4 bytes where 2 would do, through a temporary on the device).

The counts are exact, not timed, so any machine gives the same table.
"""

from __future__ import annotations

import collections
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from benchmarks.report import Row, base_parser, print_table, save_json, setup_logging
from engine.config import Config
from engine.engine import Engine
from engine.run.data import TokenBatches
from engine.run.models.gpt import GPT, GPTConfig
from engine.runtime.device import SIM_ENV
from engine.runtime.sim_device import SimCounts, SimDevice

TIERS = ("device", "cpu", "nvme")
PLANS = [(stage, optimizer, "device") for stage in (1, 2) for optimizer in TIERS] + [
    (3, optimizer, param) for optimizer in TIERS for param in TIERS
]
"""(stage, offload.optimizer, offload.param): parameter shards have a tier of their own at stage 3 only."""
QUICK_PLANS = [(1, "cpu", "device"), (2, "nvme", "device"), (3, "nvme", "nvme"), (3, "cpu", "cpu")]
SEQ_LEN = 32


@dataclass
class StepCosts:
    """Per step, averaged over the measured steps."""

    host_syncs: dict[str, float]
    """By the function that waited."""
    h2d_bytes: float
    params: int
    casts_in_copies: int
    """Host-to-device copies whose source dtype is not their destination's."""

    @property
    def syncs(self) -> float:
        return sum(self.host_syncs.values())


def plan_config(plan: tuple[int, str, str], store: Path, *, clip: bool, accumulate: int) -> Config:
    stage, optimizer, param = plan
    return Config.from_dict(
        {
            "zero": {"stage": stage, "grad_accum_steps": accumulate},
            "offload": {"optimizer": optimizer, "param": param, "nvme_path": str(store)},
            "precision": {"compute_dtype": "bf16"},
            "optim": {"grad_clip": 1.0 if clip else 0.0},
            "data": {"seq_len": SEQ_LEN, "micro_batch": 2},
        }
    )


def step_costs(config: Config, n_layer: int, steps: int = 2) -> StepCosts:
    """Train a tiny GPT of ``n_layer`` blocks on the simulated device and count its steps."""
    with mock.patch.dict(os.environ, {SIM_ENV: "seed=0,delay_ms=0.2"}):
        model = GPT(GPTConfig.preset("tiny", seq_len=SEQ_LEN, n_layer=n_layer), seed=0)
        eng = Engine(model, config, total_steps=steps + 1)
    device = eng.device
    assert isinstance(device, SimDevice)
    data = TokenBatches(np.random.default_rng(0).integers(0, 256, 4096), seq_len=SEQ_LEN, micro_batch=2, seed=0)
    try:
        for step in range(steps + 1):
            if step == 1:
                device.synchronize()
                device.take_counts()
            for _ in range(config.zero.grad_accum_steps):
                eng.backward(eng(*data.next()))
                eng.step()
        counts = device.take_counts()
    finally:
        eng.close()
    return costs_per_step(counts, steps, sum(p.numel() for p in model.parameters()))


def costs_per_step(counts: SimCounts, steps: int, params: int) -> StepCosts:
    return StepCosts(
        host_syncs={cause: n / steps for cause, n in counts.host_syncs.items()},
        h2d_bytes=counts.bytes_to_device() / steps,
        params=params,
        casts_in_copies=sum(1 for direction, src, dst in counts.copied if direction == "to device" and src != dst),
    )


def plan_label(plan: tuple[int, str, str]) -> str:
    stage, optimizer, param = plan
    return f"s{stage}-{optimizer}" + (f"-{param}" if stage == 3 else "")


def plan_row(plan: tuple[int, str, str], by_layers: dict[int, StepCosts]) -> Row:
    row: Row = {"plan": plan_label(plan)}
    for layers, costs in by_layers.items():
        row[f"host syncs/step {layers}L"] = costs.syncs
    largest = by_layers[max(by_layers)]
    row["H2D B/param"] = largest.h2d_bytes / largest.params
    row["casts in copies"] = largest.casts_in_copies
    causes: collections.Counter[str] = collections.Counter()
    for costs in by_layers.values():
        causes.update(costs.host_syncs)
    row["waits by"] = ", ".join(f"{cause.split(':')[-1]}" for cause in sorted(causes)) or "-"
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--layers", nargs=2, type=int, default=[2, 8], help="two model depths to compare")
    parser.add_argument("--plans", nargs="+", choices=[plan_label(p) for p in PLANS], help="plans (default all)")
    parser.add_argument("--accumulate", type=int, default=1, help="zero.grad_accum_steps")
    parser.add_argument("--no-clip", action="store_true", help="optim.grad_clip = 0")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    plans = [p for p in PLANS if plan_label(p) in args.plans] if args.plans else QUICK_PLANS if args.quick else PLANS
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-device-costs-") as work:
        for plan in plans:
            by_layers = {}
            for layers in args.layers:
                store = Path(work) / f"{plan_label(plan)}-{layers}"
                config = plan_config(plan, store, clip=not args.no_clip, accumulate=args.accumulate)
                by_layers[layers] = step_costs(config, layers)
            rows.append(plan_row(plan, by_layers))
    print_table("Per step on the simulated device (bf16, exact counts)", rows)
    result = {"layers": args.layers, "accumulate": args.accumulate, "clip": not args.no_clip, "rows": rows}
    save_json(args.out, "device_costs", result)
    return result


if __name__ == "__main__":
    main()
