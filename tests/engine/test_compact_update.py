"""The compact forms' fused update (``engine.zero.compact_update``): compiled, it computes what
the same function computes uncompiled; where it cannot be compiled it warns once and runs
uncompiled."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from engine.config import OptimConfig
from engine.state.quantize import packed_bytes
from engine.zero import compact_update
from engine.zero.compact_update import compact_step

N = 1 << 15
FORMS = [("bf16", "fp32"), ("int8", "fp32"), ("fp32", "bf16"), ("int8", "bf16"), ("bf16", "bf16")]
MOMENT = {"fp32": (torch.float32, N), "bf16": (torch.bfloat16, N), "int8": (torch.uint8, packed_bytes(N))}


def state(moments: str, master: str) -> list[torch.Tensor]:
    """A shard's master, gradient and moments after a few steps' worth of values."""
    generator = torch.Generator().manual_seed(0)
    dtype, numel = MOMENT[moments]
    weights = (torch.randn(N, generator=generator) * 0.02).to(torch.float32 if master == "fp32" else torch.bfloat16)
    grad = torch.randn(N, generator=generator) * 1e-3
    if dtype == torch.uint8:
        held = [torch.randint(1, 256, (numel,), dtype=torch.uint8, generator=generator) for _ in range(2)]
        for packed in held:  # finite scales, as a stored block has
            packed.view(-1, 260)[:, 256:].view(torch.float32).copy_(torch.rand(N // 256, 1, generator=generator))
    else:
        held = [(torch.rand(N, generator=generator) * 1e-6).to(dtype) for _ in range(2)]
    return [weights, grad, *held]


def run(tensors: list[torch.Tensor]) -> None:
    compact_step(OptimConfig(), tensors[0], tensors[1], (tensors[2], tensors[3]), 3, 1e-3, (5, 6, 7))


@pytest.mark.parametrize(("moments", "master"), FORMS)
def test_the_compiled_update_computes_what_the_function_does(moments: str, master: str, monkeypatch, caplog) -> None:
    compiled, eager = state(moments, master), state(moments, master)
    before = compiled[0].clone()
    with caplog.at_level(logging.WARNING, logger="engine.runtime.compiled"):
        run(compiled)
    assert not caplog.records, "the kernel fell back to running uncompiled"
    monkeypatch.setattr(compact_update.ADAMW, "kernel", compact_update.compact_adamw_)
    run(eager)
    for got, expected in zip(compiled, eager, strict=True):
        if got.dtype == torch.float32:  # the compiler may order or fuse the arithmetic its own way
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-8)
        else:  # and so a rare value on a rounding boundary goes the other way
            assert (got != expected).float().mean().item() < 1e-3
    assert not torch.equal(compiled[0], before), "the master moved"


def test_an_update_that_cannot_be_compiled_warns_once_and_runs_uncompiled(monkeypatch, caplog) -> None:
    def cannot_compile(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("no C++ compiler")

        return fail

    monkeypatch.setattr(torch, "compile", cannot_compile)
    monkeypatch.setattr(compact_update.ADAMW, "kernel", None)
    tensors, expected = state("int8", "bf16"), state("int8", "bf16")
    with caplog.at_level(logging.WARNING, logger="engine.runtime.compiled"):
        run(tensors)
        run(tensors)
    assert len(caplog.records) == 1 and "no C++ compiler" in caplog.records[0].getMessage()
    monkeypatch.setattr(compact_update.ADAMW, "kernel", compact_update.compact_adamw_)
    run(expected)
    run(expected)
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True))


def test_the_compiled_update_lets_other_threads_run() -> None:
    """The I/O threads must go on while a unit is updated: the kernel's caller releases the GIL
    (``engine.runtime.compiled.HOST_CALLER``). A thread that only needs the GIL to tick must
    tick during the middle half of a large update."""
    numel = 1 << 24
    master, grad = torch.randn(numel).to(torch.bfloat16), torch.randn(numel)
    moments = (torch.zeros(packed_bytes(numel), dtype=torch.uint8), torch.zeros(packed_bytes(numel), dtype=torch.uint8))
    config = OptimConfig()
    compact_step(config, master, grad, moments, 1, 1e-3, (1, 2, 3))  # compiled here, before the clock
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    start = time.perf_counter()
    compact_step(config, master, grad, moments, 2, 1e-3, (1, 2, 3))
    end = time.perf_counter()
    done.set()
    ticker.join()
    quarter = (end - start) / 4
    inside = [t for t in ticks if start + quarter < t < end - quarter]
    assert len(inside) >= 3, f"{len(inside)} ticks in the middle of a {1e3 * (end - start):.0f} ms update"
