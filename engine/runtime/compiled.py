"""Elementwise functions compiled by ``torch.compile`` on first use, run uncompiled where they
cannot be.

Chains of elementwise torch operations (widen, update, round back) cost a pass over memory
each in eager torch; compiled (Inductor's C++ backend on a CPU, Triton on a GPU) a chain is
one loop that reads each value once. The compiled code is one kernel per dtype combination
for any length (``dynamic=True``). Where it cannot be built (no C++ compiler), the same
function runs uncompiled after one warning naming the cause: the same arithmetic, several
times slower, its last bits not guaranteed equal to the compiled kernel's. Only compiling
falls back so: an error of the compiled kernel itself is raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

HOST_CALLER = {"cpp_wrapper": True}
"""Inductor's settings for a kernel on the host: its caller in C++ rather than Python. The
Python caller holds the GIL while the C++ kernel runs, so the I/O threads feeding the disk
stall for the whole update (measured: another Python thread ran 2 times during a 53 ms update,
51 times with the C++ caller, which releases the GIL); the kernel's speed is the same."""


class LazyCompiled:
    """``fn`` compiled at its first call, or ``fn`` itself once compiling it has failed.

    ``torch.compile`` compiles lazily, at the compiled function's first call, so an error there
    is taken for the compiler's (its failures have no common type of their own) and the call
    runs uncompiled; so is a later ``BackendCompilerFailed``, a recompile for arguments of
    another kind. Any other error of a later call is the kernel's own (out of memory, say) and
    is raised as it is: running the arithmetic again uncompiled would only hide it."""

    def __init__(self, fn: Callable[..., Any], what: str, options: dict[str, Any] | None = None):
        self.fn = fn
        self.what = what
        """What ``fn`` computes, for the warning."""
        self.options = options
        """Inductor's settings for this function (``torch.compile(options=...)``)."""
        self.kernel: Callable[..., Any] | None = None
        """What calls run: None until the first has run, then the compiled function or ``fn``."""
        self._first = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        kernel = self.kernel
        if kernel is None:
            with self._first:  # a call meanwhile waits for the compiler instead of running it too
                if self.kernel is None:
                    return self._first_call(args)
            kernel = self.kernel
        try:
            return kernel(*args)
        except Exception as err:
            if kernel is self.fn or not _compiling_failed(err):
                raise
            return self._uncompiled(err, args)

    def _first_call(self, args: tuple[Any, ...]) -> Any:
        """Compile ``fn`` for ``args`` and run it; ``kernel`` is set once that has run."""
        first = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
        host = first is not None and first.device.type == "cpu"
        options = known_options({**(self.options or {}), **(HOST_CALLER if host else {})})
        try:
            compiled = torch.compile(self.fn, dynamic=True, options=options)
            result = compiled(*args)
        except Exception as err:  # compiling: the compiler's failures have no common type of their own
            return self._uncompiled(err, args)
        self.kernel = compiled
        return result

    def _uncompiled(self, err: Exception, args: tuple[Any, ...]) -> Any:
        """Run this call, and every later one, uncompiled, after one warning naming why."""
        logger.warning("%s runs uncompiled, several times slower: %s", self.what, err)
        self.kernel = self.fn
        return self.fn(*args)


def known_options(options: dict[str, Any]) -> dict[str, Any]:
    """The settings this torch's Inductor has (``torch.compile`` refuses any other: they come
    and go between releases, and each is a tuning, not a meaning), the others logged and left out."""
    from torch._inductor import config

    known = config.get_config_copy()
    unknown = sorted(set(options) - set(known))
    if unknown:
        logger.debug("Inductor %s has no setting %s: compiling without it", torch.__version__, ", ".join(unknown))
    return {name: value for name, value in options.items() if name in known}


def _compiling_failed(err: Exception) -> bool:
    """Whether ``err`` is a failure of the compiler's backend (torch's dynamo is loaded by then)."""
    from torch._dynamo.exc import BackendCompilerFailed

    return isinstance(err, BackendCompilerFailed)
