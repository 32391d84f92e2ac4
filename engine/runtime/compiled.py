"""Elementwise functions compiled by ``torch.compile`` on first use, run uncompiled where they
cannot be.

Chains of elementwise torch operations (widen, update, round back) cost a pass over memory
each in eager torch; compiled (Inductor's C++ backend on a CPU, Triton on a GPU) a chain is
one loop that reads each value once. The compiled code is one kernel per dtype combination
for any length (``dynamic=True``). Where it cannot be built (no C++ compiler), the same
function runs uncompiled after one warning naming the cause: the same arithmetic, several
times slower, its last bits not guaranteed equal to the compiled kernel's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


class LazyCompiled:
    """``fn`` compiled at its first call, or ``fn`` itself once compiling it has failed."""

    def __init__(self, fn: Callable[..., Any], what: str, options: dict[str, Any] | None = None):
        self.fn = fn
        self.what = what
        """What ``fn`` computes, for the warning."""
        self.options = options
        """Inductor's settings for this function (``torch.compile(options=...)``)."""
        self.kernel: Callable[..., Any] | None = None
        """What calls run: None until the first, then the compiled function or ``fn``."""

    def __call__(self, *args: Any) -> Any:
        if self.kernel is None:
            self.kernel = torch.compile(self.fn, dynamic=True, options=self.options)
        try:
            return self.kernel(*args)
        except Exception as err:  # the compiler's failures have no common type of their own
            if self.kernel is self.fn:
                raise
            logger.warning("%s runs uncompiled, several times slower: %s", self.what, err)
            self.kernel = self.fn
            return self.fn(*args)
