"""This process's own peak resident memory, as the run's log, its metrics and the memory tests
report it.

The kernel's high-water mark of this process (``VmHWM``), not ``ru_maxrss``: that one survives
``execve``, so a process started by a larger one (a test runner, a benchmark that built a whole
model) would report its parent's peak as its own.
"""

from __future__ import annotations

import resource
from pathlib import Path

STATUS = Path("/proc/self/status")


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident memory, in bytes (``ru_maxrss`` where
    the kernel reports no ``VmHWM``)."""
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
