"""Pinning recorded instead of done, so that a CPU build tests what would be pinned.

``record_pins`` stands in for the CUDA registration ``offload.host_memory`` makes (it succeeds
and records each call) and for the current CUDA device (``DEVICE``), for one test."""

from __future__ import annotations

import pytest
import torch

import offload.host_memory

DEVICE = 3
"""The CUDA device a recorded registration is made on (not 0, so that a pin made on the wrong one shows)."""


def record_pins(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Each registration as ``("register", address, nbytes)`` and each end of one as
    ``("unregister", address, device)``, in order."""
    calls: list[tuple[str, int, int]] = []

    def register(address: int, nbytes: int, device: int) -> None:
        assert device == DEVICE, "registered on the device current where the pool was made"
        calls.append(("register", address, nbytes))

    monkeypatch.setattr(offload.host_memory, "register", register)
    monkeypatch.setattr(
        offload.host_memory, "unregister", lambda address, device: calls.append(("unregister", address, device))
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: DEVICE)
    return calls
