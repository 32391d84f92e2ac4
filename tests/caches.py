"""A fresh cache folder for a test's run that still knows this disk.

Tests give a run a cache of its own (``XDG_CACHE_HOME``) so that no token cache or built
kernel of another test serves it. The disk's I/O profile is the exception worth keeping: without
it every such run probes the disk first (``offload.tuning``: 1.3 GB written and read, 4 s on a
2-core machine) for settings no test here checks. The tests of the probe itself make their own
caches without it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from offload.tuning import profile_path


def fresh_cache(folder: Path) -> str:
    """``folder``, made, holding a copy of the session's I/O profile (``tests.conftest``'s
    private cache) once some run has measured the disk; as a string, for the environment."""
    known = profile_path()
    seeded = folder / known.parent.name / known.name
    if known.is_file() and not seeded.exists():  # a test may name its cache twice (in-process, then a child's)
        seeded.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(known, seeded)
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)
