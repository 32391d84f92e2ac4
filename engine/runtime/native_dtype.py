"""The compute dtype the hardware runs at speed: what ``precision.compute_dtype = "auto"`` becomes.

bf16 halves the bytes every gather, copy and spill moves, but only hardware with bf16 matrix
units computes it fast. On an x86 CPU torch sends a bf16 matmul through oneDNN only with
AVX-512 or AMX; elsewhere it falls back to a scalar loop. On a 2-core AVX2 AMD EPYC that loop
ran a 4096x256 @ 256x1024 matmul in 1.8 s against 0.027 s in fp32, and the built-in GPT "small"
took 11 s a step in bf16 against 1 s in fp32. fp16 is never chosen: it needs loss scaling.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from engine.config import Config, DType
from engine.runtime.comm import Comm
from engine.runtime.device import SIM_ENV

logger = logging.getLogger(__name__)

LOW_PRECISION = ("bf16", "fp16")


def native_compute_dtype() -> tuple[DType, str]:
    """``bf16`` or ``fp32``, whichever this process's compute device runs faster, and why.
    The simulated device computes on the CPU."""
    if os.environ.get(SIM_ENV) is None and torch.accelerator.is_available():
        accel = torch.accelerator.current_accelerator()
        assert accel is not None  # is_available() says there is one
        if accel.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            return "fp32", "this GPU has no bf16 units"
        return "bf16", f"the {accel.type} device computes bf16 natively"
    # The predicate torch itself takes to send a bf16 matmul to oneDNN rather than its fallback.
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bf16", "this CPU computes bf16 matmuls natively (oneDNN)"
    return "fp32", "this CPU has no bf16 matmul instructions (AVX-512 or AMX), where bf16 runs ~70x slower than fp32"


def settle_compute_dtype(config: Config, comm: Comm | None = None) -> Config:
    """``config`` with ``precision.compute_dtype = "auto"`` made a dtype, rank 0's choice on
    every rank (their collectives must move one dtype). Logs the choice, and warns where a
    dtype set in the config is one this device computes slowly."""
    chosen: DType = config.precision.compute_dtype
    rank = comm.rank if comm is not None else 0
    if chosen == "auto":
        chosen, why = native_compute_dtype()
        if comm is not None:
            chosen = comm.all_gather_object(chosen)[0]
        if rank == 0:
            logger.info('compute dtype: %s (precision.compute_dtype = "auto": %s)', chosen, why)
        return dataclasses.replace(config, precision=dataclasses.replace(config.precision, compute_dtype=chosen))
    if rank == 0 and chosen in LOW_PRECISION:
        native, why = native_compute_dtype()
        if native == "fp32":
            logger.warning('precision.compute_dtype = "%s" is slow here: %s; set it to "fp32" or "auto"', chosen, why)
    return config
