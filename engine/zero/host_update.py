"""The compact update of int8 moments on the host, as one hand-written loop (``host_adamw.c``).

It computes ``compact_update.compact_adamw_``'s formula for shards whose moments are int8
blocks and whose master and gradient are bf16 or fp32: the form that moves the fewest bytes,
whose update at 4.4 ns per parameter came to some 44 s of a 103 s step at 10.1B parameters on
two cores. Inductor's code for the same function
computes each block's new moments three times (for the update, their maximum and their codes)
and ran at 6.5-7.0 ns per parameter on one core of a 2-core AVX-512 Xeon, 4.4 on two; this loop
holds a block's values in L1 and runs at 2.2-2.3 and 1.2-1.4 (``python -m benchmarks.optimizer``).
Other forms, and every accelerator, keep the compiled torch kernel; so does a host where no C
compiler can build this one (``engine.runtime.native``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from engine.runtime.native import load
from engine.state.quantize import BLOCK, packed_bytes

SOURCE = Path(__file__).with_name("host_adamw.c")
FLOATS = (torch.bfloat16, torch.float32)


def takes(device: torch.device, master: torch.dtype, moment: torch.dtype, grad: torch.dtype) -> bool:
    """Whether this kernel updates state of these dtypes on ``device``: on the host, int8
    moments (held as bytes), a bf16 or fp32 master and gradient."""
    return device.type == "cpu" and moment == torch.uint8 and master in FLOATS and grad in FLOATS


def serves(master: torch.Tensor, grad: torch.Tensor, moments: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether this kernel takes this shard: dtypes it ``takes``, whole blocks, all contiguous
    on the host and of matching lengths (the kernel trusts them: it indexes raw memory)."""
    numel = master.numel()
    return (
        takes(master.device, master.dtype, moments[0].dtype, grad.dtype)
        and moments[1].dtype == torch.uint8
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (master, grad, *moments))
        and numel % BLOCK == 0
        and grad.numel() == numel
        and all(m.numel() == packed_bytes(numel) for m in moments)
    )


def kernel() -> Callable[..., None] | None:
    """The built kernel, or None where it cannot be built (after one warning)."""
    library = load(SOURCE)
    if library is None:
        return None
    function = library.compact_adamw_int8
    if function.argtypes is None:
        pointer, flag = ctypes.c_void_p, ctypes.c_int
        function.argtypes = [pointer, flag, pointer, flag, *[pointer] * 9, ctypes.c_int64, flag]
        function.restype = None
    return function


def update(
    master: torch.Tensor,
    grad: torch.Tensor,
    moments: tuple[torch.Tensor, torch.Tensor],
    tables: tuple[torch.Tensor, ...],
    hyper: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    decays: torch.Tensor | None,
) -> bool:
    """``compact_adamw_(master, grad, *moments, tables, hyper, grad_scale, skip, decays)`` on the
    host, on torch's intra-op threads; False where the kernel does not take this shard or cannot
    be built, and nothing was done. The scale and the skip flag are read by the kernel from
    their memory: reading them here would count as a host read of a device value."""
    function = kernel() if serves(master, grad, moments) else None
    if function is None:
        return False
    bf16 = (master.dtype == torch.bfloat16, grad.dtype == torch.bfloat16)
    # Held here until the call returns: a converted copy's memory must outlive its address.
    inputs = [t.contiguous() for t in tables] + [t.float().contiguous() for t in (hyper, grad_scale, skip)]
    mask = None if decays is None else decays.contiguous()
    function(
        master.data_ptr(), bf16[0], grad.data_ptr(), bf16[1], moments[0].data_ptr(), moments[1].data_ptr(),
        *(t.data_ptr() for t in inputs), None if mask is None else mask.data_ptr(), master.numel(),
        torch.get_num_threads(),
    )  # fmt: skip
    return True
