"""C kernels for the host, built by the system's C compiler at their first use and cached.

A few loops on the host are the step's limit and are faster written by hand than as torch code
(``engine.zero.host_update``). They are C with no dependency beyond libc, so that building one
takes a fraction of a second and needs only the compiler Inductor needs too; the library is
loaded with ``ctypes``, whose calls release the GIL, so the I/O threads run meanwhile. The build
is for this machine's CPU (``-march=native``) and is cached under a name that hashes the source,
the flags, the compiler and the CPU's features: a cache shared by machines of other CPUs
rebuilds rather than loading code they cannot run. Where nothing can be built, ``load`` warns
once and returns None, and the caller runs its torch code instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

OPTIMIZE = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
FLAGS = (*OPTIMIZE, "-fPIC", "-shared", "-pthread")
"""No fused multiply-add (``-ffp-contract=off``): each product and sum rounds as torch's own
kernels round them. ``-fno-math-errno`` and ``-fno-trapping-math`` let the compiler vectorize
``sqrtf`` and ``floorf`` and change no result."""
BUILD_S = 120
"""The longest a build may take before it is taken to have failed."""

_lock = threading.Lock()


def cache_dir() -> Path:
    """Where built libraries are kept: ``$OFFLOAD_KERNEL_CACHE``, else the user's cache folder."""
    chosen = os.environ.get("OFFLOAD_KERNEL_CACHE")
    if chosen:
        return Path(chosen)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "offload-engine" / "kernels"


def load(source: Path) -> ctypes.CDLL | None:
    """The library built from C file ``source``, built now unless a build of it is cached; None
    (after one warning) where it cannot be built. Threads asking at once share one build."""
    with _lock:
        return _load(source)


@functools.cache
def _load(source: Path) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=BUILD_S).stdout
        key = hashlib.sha256("\0".join([source.read_text(), *FLAGS, version, _cpu_features()]).encode()).hexdigest()
        folder = cache_dir()
        library = folder / f"{source.stem}-{key[:16]}.so"
        if not library.exists():
            folder.mkdir(parents=True, exist_ok=True)
            _build(compiler, source, library)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or err
        logger.warning("%s could not be built (%s): its torch version runs instead", source.name, str(detail).strip())
        return None


def _build(compiler: str, source: Path, library: Path) -> None:
    """Compile ``source`` into ``library``: into a file of its own first, then renamed, so that a
    process building the same library at the same time never loads a half-written one."""
    handle, partial = tempfile.mkstemp(dir=library.parent, prefix=library.stem, suffix=".part")
    os.close(handle)
    try:
        command = [compiler, *FLAGS, str(source), "-o", partial]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=BUILD_S)
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _cpu_features() -> str:
    """The CPU's feature flags as the kernel reports them (Linux), else its name."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()
