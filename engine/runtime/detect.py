"""Which device a rank computes on. Apart from ``Device`` so that choosing the simulated device,
a subclass of it, does not make the two modules import each other."""

from __future__ import annotations

import os

import torch

from engine.runtime.device import SIM_ENV, Device
from engine.runtime.sim_device import SimDevice


def detect_device(local_rank: int | None = None) -> Device:
    """The accelerator for this rank if there is one (``LOCAL_RANK`` picks it), else the CPU,
    or the simulated asynchronous device where ``OFFLOAD_SIM_DEVICE`` asks for it (tests and
    benchmarks)."""
    sim = os.environ.get(SIM_ENV)
    if sim is not None:
        return SimDevice.from_spec(sim)
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accel is None:
        return Device(torch.device("cpu"))
    index = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(accel.type, index)
    torch.accelerator.set_device_index(index)
    return Device(device)
