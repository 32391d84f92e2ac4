"""``LazyCompiled`` runs a function uncompiled only where compiling it failed: at the first
call, which compiles, or at a later recompile; an error of the compiled kernel itself (out of
memory, say) is raised, never hidden by running the arithmetic again."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from engine.runtime.compiled import LazyCompiled


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def compiling_to(kernel):
    """A ``torch.compile`` that hands back ``kernel``."""
    return lambda fn, **kwargs: kernel


def test_a_failure_of_the_first_call_runs_it_uncompiled(monkeypatch, caplog) -> None:
    def cannot_compile(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", compiling_to(cannot_compile))
    lazy = LazyCompiled(double, "doubling")
    with caplog.at_level(logging.WARNING, logger="engine.runtime.compiled"):
        assert torch.equal(lazy(torch.ones(3)), torch.full((3,), 2.0))
    assert lazy.kernel is double and "no C++ compiler" in caplog.text


def test_an_error_of_the_compiled_kernel_is_raised(monkeypatch, caplog) -> None:
    calls = []

    def kernel(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        if len(calls) > 1:
            raise RuntimeError("out of memory")
        return double(x)

    monkeypatch.setattr(torch, "compile", compiling_to(kernel))
    lazy = LazyCompiled(double, "doubling")
    lazy(torch.ones(3))
    with caplog.at_level(logging.WARNING, logger="engine.runtime.compiled"), pytest.raises(RuntimeError, match="out"):
        lazy(torch.ones(3))
    assert lazy.kernel is kernel and not caplog.records, "the kernel stays compiled, and nothing was run again"


def test_a_recompile_that_fails_runs_uncompiled(monkeypatch) -> None:
    calls = []

    def kernel(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        if x.dtype != torch.float32:
            raise BackendCompilerFailed(kernel, RuntimeError("no kernel for bf16"), None)
        return double(x)

    monkeypatch.setattr(torch, "compile", compiling_to(kernel))
    lazy = LazyCompiled(double, "doubling")
    lazy(torch.ones(3))
    assert torch.equal(lazy(torch.ones(3, dtype=torch.bfloat16)), torch.full((3,), 2.0, dtype=torch.bfloat16))
    assert lazy.kernel is double


def test_a_setting_this_torch_lacks_is_left_out(monkeypatch) -> None:
    """Inductor's settings come and go between torch releases (torch 2.11 has no
    ``realize_cpu_opcount_threshold``): one this torch lacks is dropped, not a refused compile."""
    seen = {}

    def compile(fn, dynamic, options):
        seen.update(options)
        return fn

    monkeypatch.setattr(torch, "compile", compile)
    double = LazyCompiled(lambda x: 2 * x, "doubling", {"realize_opcount_threshold": 64, "no_such_setting": 1})
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
    assert "no_such_setting" not in seen and seen["realize_opcount_threshold"] == 64
