"""The dtypes a configuration names (``precision.compute_dtype``, ``optim.master_dtype``,
``offload.grad_spill_dtype``), by name."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    if name == "auto":
        raise ValueError('precision.compute_dtype = "auto" must be settled first (engine.runtime.native_dtype)')
    return DTYPES[name]
