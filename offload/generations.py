"""Generations of a store: the one a step reads, the one it writes, and the flip between them.

Step N reads generation ``g`` and writes ``g + 1``; only once every write is durable does
``COMMITTED`` name ``g + 1``. A crash at any instant leaves ``COMMITTED`` naming a complete
generation, so the store is always a valid checkpoint. The superseded generation's
directory is then renamed to be the next write target: a rename costs nothing, and its
arrays' metadata (which holds no path) stays valid, so no step pays for creating arrays.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from offload.manifest import commit, read_committed
from offload.store import ShardStore

logger = logging.getLogger(__name__)

_GENERATION = re.compile(r"^gen-(\d+)$")


def generation_prefix(generation: int) -> str:
    return f"gen-{generation}"


class Generations:
    """The committed generation of a store and the preparation of the next one."""

    def __init__(self, store: ShardStore):
        self.store = store

    def committed(self) -> dict[str, Any] | None:
        """The last committed record (``generation``, ``step``, ...), or None for a new store."""
        return read_committed(self.store.path)

    def on_disk(self) -> list[int]:
        """Every generation directory present, committed or not, in order."""
        found = (_GENERATION.match(p.name) for p in self.store.path.iterdir() if p.is_dir())
        return sorted(int(m[1]) for m in found if m)

    def prepare(self, generation: int, create: Callable[[str], None]) -> None:
        """Make ``gen-<generation>`` ready to be written: recycle a superseded generation's
        directory by renaming it, or, if there is none, ``create(prefix)`` its arrays."""
        target = generation_prefix(generation)
        present = self.on_disk()
        if generation in present:
            return
        record = self.committed()
        stale = [g for g in present if not record or g != record["generation"]]
        if stale:
            self.store.move(generation_prefix(stale[0]), target)
            logger.debug("recycled %s as %s", generation_prefix(stale[0]), target)
        else:
            create(target)

    def commit(self, generation: int, record: dict[str, Any]) -> None:
        """Name ``generation`` as the committed one, atomically (after ``store.sync()``)."""
        commit(self.store.path, {**record, "generation": generation})
