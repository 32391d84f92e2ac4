"""Reorganising a store's nodes: a group built whole or not at all, a node moved or deleted
durably, and the leftovers of interrupted operations swept away.

Groups and arrays are directories, so each of these is a rename made durable by fsyncing
the directories it changed; zarr metadata holds no paths, so it stays valid wherever a
node goes. A crash mid-operation leaves only a top-level leftover under a name no node
can have (`.staging-*`, `.trash-*`), which the store's one writer sweeps before it writes.
So is the `scratch` folder: per-rank stores of data that lives within one step (spilled
gradients), never part of a commit, and left behind only by a run that stopped.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from offload.metadata import ArrayInfo, check_name, create_subgroup, read_json, under

log = logging.getLogger("offload.store")

# Top-level names of groups being built or removed: never a valid node name, swept by the writer.
STAGING = ".staging-"
TRASH = ".trash-"
SCRATCH = "scratch"
"""Top-level folder of per-rank scratch stores (not a node: no zarr.json), swept by the writer."""


class SyncLedger:
    """What a store's next `sync` must make durable: one entry per write call since the last sync
    (not per chunk), and the metadata files and directories created or changed; with the store's
    cached array metadata, under the same lock. Kept by `ShardStore`, changed by its node
    operations too (`NodeOps`), which move, drop and add what it records."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.infos: dict[str, ArrayInfo] = {}
        self.writes: list[tuple[str, int, int, Future]] = []
        self.files: set[str] = set()
        self.dirs: set[str] = set()

    def take(self) -> tuple[list[tuple[str, int, int, Future]], set[str], set[str]]:
        """Everything recorded since the last call, for `sync` to make durable; the ledger starts afresh."""
        with self.lock:
            writes, self.writes = self.writes, []
            files, self.files = self.files, set()
            dirs, self.dirs = self.dirs, set()
        return writes, files, dirs


class NodeOps:
    """The store's verbs on whole nodes (`move`, `build`, `delete`, `sweep`), over its folders and
    its ledger; the store lends it its `sync` (everything pending made durable) and its parallel
    fsync of files and directories."""

    def __init__(
        self,
        paths: tuple[Path, ...],
        ledger: SyncLedger,
        sync: Callable[[], None],
        fsync_all: Callable[[list[str], set[str]], None],
    ) -> None:
        self.path, self.paths = paths[0], paths
        self._ledger, self._sync, self._fsync_all = ledger, sync, fsync_all

    def _node_dir(self, prefix: str, what: str) -> Path:
        check_name(prefix, what)
        node = self.path / prefix
        if not (node / "zarr.json").exists():
            raise FileNotFoundError(
                errno.ENOENT, f"no group or array {prefix!r} in offload store {self.path}", str(node)
            )
        return node

    def move(self, src_prefix: str, dst_prefix: str) -> None:
        """Rename the group or array `src_prefix` to `dst_prefix` atomically; durable on return.

        Everything pending is synced first, so the data is durable before it
        appears under its new name (what keeping a checkpoint needs). zarr
        metadata holds no paths, so it stays valid; missing parent groups of
        the destination are created. In a store of several paths the first,
        which says what the store holds, is renamed last, once the others'
        renames are durable: a crash between leaves them moved ahead, which the
        next move of the node finds done.
        """
        src = self._node_dir(src_prefix, "source prefix")
        check_name(dst_prefix, "destination prefix")
        if under(dst_prefix, src_prefix):
            raise ValueError(f"cannot move {src_prefix!r} into itself ({dst_prefix!r})")
        dst = self.path / dst_prefix
        if dst.exists():
            raise FileExistsError(
                errno.EEXIST,
                f"cannot move {src_prefix!r} to {dst_prefix!r}: the destination exists; delete it first",
                str(dst),
            )
        self._sync()
        for folder in self.paths[1:]:
            if (folder / src_prefix).exists() or not (folder / dst_prefix).exists():
                self.discard_orphan(folder, dst_prefix)
                self._rename_in(folder, src_prefix, dst_prefix)
        self._rename_in(self.path, src_prefix, dst_prefix)
        with self._ledger.lock:
            for name in [n for n in self._ledger.infos if under(n, src_prefix)]:
                self._ledger.infos[dst_prefix + name[len(src_prefix) :]] = self._ledger.infos.pop(name)
        log.debug("moved %s -> %s in %s", src.name, dst_prefix, self.path)

    def _rename_in(self, folder: Path, src_prefix: str, dst_prefix: str) -> None:
        """Rename a node within one of the store's folders, durably (a folder holding none of it: nothing)."""
        src, dst = folder / src_prefix, folder / dst_prefix
        if not src.exists():
            return
        made = self._make_parent_groups(folder, dst_prefix)
        os.rename(src, dst)
        # New directory entries: in both parents, and for each new group its
        # zarr.json and its own entry.
        dirs = {str(src.parent), str(dst.parent)}
        for meta in made:
            dirs.update((str(Path(meta).parent), str(Path(meta).parent.parent)))
        self._fsync_all(made, dirs)

    def _make_parent_groups(self, folder: Path, prefix: str) -> list[str]:
        """Create the missing groups above `prefix` in `folder`; return their new metadata files."""
        made = []
        parts = prefix.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            group = "/".join(parts[:depth])
            meta = folder / group / "zarr.json"
            if not meta.exists():
                create_subgroup(folder, group)
                made.append(str(meta))
            elif read_json(meta).get("node_type") != "group":
                raise ValueError(f"cannot place {prefix!r} under {group!r}: {group!r} is an array, not a group")
        return made

    def discard_orphan(self, folder: Path, prefix: str) -> None:
        """Remove `prefix` from another folder of the store when the first does not hold it: what
        a crash between the folders' deletes left, never part of anything committed."""
        node = folder / prefix
        if folder != self.path and (node.exists() or node.is_symlink()) and not (self.path / prefix).exists():
            self._discard(folder, node)

    def build(self, prefix: str, fill: Callable[[str], None]) -> None:
        """Create the group `prefix` whole or not at all: `fill(staging)` creates its arrays
        under a staging name, which is made durable and then renamed to `prefix`. A crash
        before the rename leaves only a leftover that `sweep` removes, never a half-made
        `prefix`."""
        check_name(prefix, "prefix")
        staging = f"{STAGING}{uuid.uuid4().hex}"
        fill(staging)
        self.move(staging, prefix)

    def delete(self, prefix: str) -> None:
        """Delete the group or array `prefix` and everything under it; durable at the next `sync()`.

        The node is first renamed out of the way (durably), then removed: a crash mid-removal
        leaves no partial node under its name, only a leftover that `sweep` removes. A node
        without metadata (a leftover itself) is deleted too. Writes still in flight under
        `prefix` are waited for first, so none lands in a directory being removed.
        """
        check_name(prefix, "prefix")
        node = self.path / prefix
        if not node.is_dir() or node.is_symlink():
            raise FileNotFoundError(
                errno.ENOENT, f"no group or array {prefix!r} in offload store {self.path}", str(node)
            )
        with self._ledger.lock:
            doomed = [w for w in self._ledger.writes if under(w[0], prefix)]
            self._ledger.writes = [w for w in self._ledger.writes if not under(w[0], prefix)]
        for *_, future in doomed:
            future.exception()  # the data is being deleted: its errors no longer matter
        # The first folder first: once it no longer holds the node, what a crash leaves of it in
        # the others is an orphan, removed when its name is next made.
        nodes = [node, *(folder / prefix for folder in self.paths[1:])]
        for folder, held in zip(self.paths, nodes, strict=True):
            if held.is_dir() and not held.is_symlink():
                self._discard(folder, held)
        with self._ledger.lock:
            for name in [n for n in self._ledger.infos if under(n, prefix)]:
                del self._ledger.infos[name]
            for gone in map(str, nodes):
                self._ledger.files = {f for f in self._ledger.files if not under(f, gone)}
                self._ledger.dirs = {d for d in self._ledger.dirs if not under(d, gone)}
            self._ledger.dirs.update(str(held.parent) for held in nodes if held.parent.exists())
        log.debug("deleted %s from %s", prefix, self.path)

    def _discard(self, folder: Path, node: Path) -> None:
        """Remove a directory tree of the store's `folder`: renamed to a leftover name there first
        (on its own drive), durably, so that no crash leaves it half-removed under its own name."""
        trash = folder / f"{TRASH}{uuid.uuid4().hex}"
        os.rename(node, trash)
        self._fsync_all([], {str(node.parent), str(folder)})
        shutil.rmtree(trash)

    def sweep(self) -> None:
        """Remove what interrupted operations left behind: half-built groups (`build`),
        half-removed ones (`delete`), scratch stores and temporary metadata files. For the store's one writer,
        before it writes: nothing else refers to them."""
        for entry in (entry for folder in self.paths for entry in folder.iterdir()):
            leftover = entry.name.startswith((STAGING, TRASH)) or entry.name == SCRATCH
            if leftover and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
                log.info("removed %s, left by an interrupted run", entry)
            elif entry.is_file() and (
                (entry.name.startswith(".") and entry.name.endswith(".tmp")) or entry.name.endswith(".partial")
            ):
                entry.unlink()  # an atomic metadata write's temporary: ours, or zarr's
