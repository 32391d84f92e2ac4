"""Several paths for one store: its chunks striped across folders, one folder a drive.

A store made with more than one path keeps its identity in the first: the writer lock, the
committed record, the group attributes, the list of every path and the rule placing chunks
(``paths`` and ``striping`` in its format marker). Every path holds a zarr group of the same layout (each array's metadata, with its
own chunk folder), and chunk ``k`` of an array lives on path ``(s + k) % n``, ``s`` the
array's ``stripe_start`` attribute (``offload.metadata``), which moves with it: each new
array starts one path further. A unit's shard is a run of consecutive chunks, its kinds of
state start on different paths, so one unit's read or write uses every drive at once, and
each path holds ``1/n`` of the bytes (to one chunk an array).

The marker of every other path names the store it belongs to and its position in the list,
so a list given in another order, without one of its paths or with another number of them,
is refused naming the path and the fix before anything is written. A store of one path is
the plain one-folder store: no list is recorded, nothing changes.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from offload.metadata import FORMAT_KEY, create_group, store_marker, update_group_attrs

PATHS_KEY = "paths"
"""Key of the first path's format marker: every path of the store, in order (absent: one path)."""
STRIPE_KEY = "stripe_of"
"""Key of another path's format marker: the first path of the store it holds a share of."""
POSITION_KEY = "position"
"""Key of another path's format marker: its place in the store's list of paths."""
RULE_KEY = "striping"
"""Key of the first path's format marker: the rule placing chunks (``RULE``), so that a reader
placing them otherwise refuses the store rather than reading the wrong files."""
RULE = "chunk k of an array on path (stripe_start + k) mod paths"


def stripe_index(index: int, count: int) -> int:
    """The position, in a store's list of ``count`` paths, of the path holding chunk ``index``
    of an array starting on path 0 (``stripe_start + index`` for one starting elsewhere)."""
    return index % count


def absolute(paths: Sequence[str | os.PathLike[str]]) -> tuple[Path, ...]:
    """The paths as the store records and compares them: absolute, not resolved (a link in a
    mount point is the user's to choose)."""
    return tuple(Path(os.path.abspath(p)) for p in paths)


def check_distinct(paths: Sequence[Path]) -> None:
    """Refuse a list naming one folder twice, or one inside another: their chunks and
    metadata would overwrite each other."""
    for i, path in enumerate(paths):
        for other in paths[i + 1 :]:
            if path == other or path in other.parents or other in path.parents:
                raise ValueError(
                    f"offload.nvme_path lists {path} and {other}, which overlap: give each drive's folder once, "
                    f"none inside another"
                )


def stripe_marker(marker: dict[str, Any], root: Path, position: int) -> dict[str, Any]:
    """The format marker of the path at ``position`` of the store at ``root`` (``marker``: the store's)."""
    own = {k: v for k, v in marker.items() if k not in (PATHS_KEY, RULE_KEY)}
    return {**own, STRIPE_KEY: str(root), POSITION_KEY: position}


def recorded(root: Path, marker: dict[str, Any]) -> tuple[Path, ...]:
    """Every path of the store at ``root`` as its marker records them (just ``root`` for one path)."""
    paths = marker.get(PATHS_KEY)
    if paths is None:
        return (root,)
    if marker.get(RULE_KEY) != RULE:
        raise ValueError(
            f"offload store {root} places its chunks by the rule {marker.get(RULE_KEY)!r}, which this code does not "
            f"read (it reads {RULE!r}); read it with the version of the engine that wrote it"
        )
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise ValueError(
            f"offload store {root}: its list of paths ({paths!r}) is damaged; restore its zarr.json from a backup"
        )
    return tuple(Path(p) for p in paths)


def check_same_paths(root: Path, stored: tuple[Path, ...], given: tuple[Path, ...]) -> None:
    """Refuse a list of paths other than the one the store was made with, naming the first
    difference and the list to pass."""
    if stored == given:
        return
    fix = f"pass the paths it was made with, in that order: offload.nvme_path = {[str(p) for p in stored]}"
    for position, (old, new) in enumerate(zip(stored, given, strict=False)):
        if old != new:
            raise ValueError(
                f"offload store {root} keeps path {position + 1} of its chunks at {old}, not {new}: its chunks are "
                f"striped across {len(stored)} path(s) in a fixed order; {fix}"
            )
    which, path = ("lacks", stored[len(given)]) if len(stored) > len(given) else ("adds", given[len(stored)])
    raise ValueError(
        f"offload store {root} was made with {len(stored)} path(s) and this list of {len(given)} {which} {path}: "
        f"its chunks stay where they were striped; {fix}"
    )


def check_stripe(root: Path, path: Path, position: int, marker: dict[str, Any] | None) -> None:
    """Refuse a path of the store at ``root`` that is missing or holds something else than
    its share (``marker``: the format marker found there, None if none)."""
    if not path.is_dir():
        raise FileNotFoundError(
            errno.ENOENT,
            f"path {position + 1} of offload store {root}, {path}, is missing: it holds that share of the store's "
            f"chunks; mount its drive again (or restore the folder) and run again",
            str(path),
        )
    if marker is None or marker.get(STRIPE_KEY) != str(root) or marker.get(POSITION_KEY) != position:
        found = (
            f"a share ({POSITION_KEY} {marker.get(POSITION_KEY)!r}) of {marker[STRIPE_KEY]}"
            if marker and STRIPE_KEY in marker
            else "a store of its own"
            if marker
            else "no share of any store"
        )
        raise ValueError(
            f"{path} should hold path {position + 1} of offload store {root}'s chunks but holds {found}: "
            f"mount the right drive there (or restore the folder) and run again"
        )


def clear_folders(root: Path, extra: tuple[Path, ...], overwrite: bool, ignored: set[str]) -> Callable[[], None]:
    """Check that a store can be made at ``root`` striped across ``extra``, and return what
    clears their folders for it: every folder is checked before any changes, so a refused
    store modifies nothing. A folder must be new or empty, or hold what ``overwrite`` replaces:
    a store at ``root``, a share of one in the others (of that very store: another store's
    share, or a store of its own, is never removed); the entries named in ``ignored`` stay."""
    if extra:
        check_distinct((*absolute([root]), *extra))
    for stripe in extra:
        if not stripe.exists() and not stripe.parent.is_dir():
            raise FileNotFoundError(
                errno.ENOENT,
                f"cannot stripe offload store {root} across {stripe}: its parent folder {stripe.parent} does not "
                f"exist (a drive not mounted?); mount the drive or create the folder",
                str(stripe.parent),
            )
    doomed = _contents_to_replace(root, overwrite, ignored)
    for stripe in extra:
        contents = _contents_to_replace(stripe, overwrite, ignored)
        marker = store_marker(stripe) or {}
        if contents and marker.get(STRIPE_KEY) != str(absolute([root])[0]):
            whose = f"a share of offload store {marker[STRIPE_KEY]}" if STRIPE_KEY in marker else "a store of its own"
            raise FileExistsError(
                f"refusing to overwrite {stripe}: it holds {whose}, not a share of {root}; remove it yourself or "
                f"choose another folder"
            )
        doomed += contents

    def clear() -> None:
        for entry in doomed:  # the writer lock, if any, stays held and in place
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    return clear


def _contents_to_replace(folder: Path, overwrite: bool, ignored: set[str]) -> list[Path]:
    if not folder.exists():
        return []
    contents = [p for p in folder.iterdir() if p.name not in ignored] if folder.is_dir() else [folder]
    if contents and not overwrite:
        raise FileExistsError(
            f"cannot create an offload store at {folder}: the path exists and is not empty; "
            f"open the store there, or remove it, or choose another path"
        )
    if contents and store_marker(folder) is None:
        raise FileExistsError(
            f"refusing to overwrite {folder}: it is not an offload store nor an empty directory; "
            f"remove it yourself or choose another path"
        )
    return contents


def create_stripes(root: Path, extra: tuple[Path, ...], marker: dict[str, Any]) -> None:
    """Make the group of each of ``extra``, the other folders of the store at ``root``, and
    record the list in ``marker`` (the store's format marker, written after: the list then
    names only folders that exist)."""
    if not extra:
        return
    identity = absolute([root])[0]
    marker[PATHS_KEY] = [str(p) for p in (identity, *extra)]
    marker[RULE_KEY] = RULE
    for position, stripe in enumerate(extra, 1):
        stripe.mkdir(exist_ok=True)
        create_group(stripe, {FORMAT_KEY: stripe_marker(marker, identity, position)})


def refuse_share(root: Path, marker: dict[str, Any] | None) -> None:
    """Refuse to treat ``root`` as a store when its ``marker`` (the format marker found there)
    says it holds another store's share of chunks: a run, its lock or a reader belongs there."""
    if marker is not None and STRIPE_KEY in marker:
        raise ValueError(
            f"{root} holds a share of the chunks of offload store {marker[STRIPE_KEY]}, not a store: open that one"
        )


def open_stripes(
    root: Path, marker: dict[str, Any], given: Sequence[str | os.PathLike[str]] | None
) -> tuple[Path, ...]:
    """The other folders of the store at ``root`` as its ``marker`` records them, each checked
    to hold its share; refused if ``given`` (not None) is another list, or if ``root`` is
    itself another store's share."""
    refuse_share(root, marker)
    here = absolute([root])[0]
    paths = recorded(here, marker)
    extra = paths[1:]
    if given is not None:
        check_same_paths(root, (here, *extra), (here, *absolute(given)))
    for position, stripe in enumerate(extra, 1):
        check_stripe(paths[0], stripe, position, store_marker(stripe))
    return extra


def make_one_folder(root: Path) -> None:
    """Make the store at ``root``, into which the chunks of every folder of a striped store were
    copied, a store of that one folder: its list of folders is dropped (the arrays'
    ``stripe_start`` then names folder 0 of 1 whatever its value)."""
    marker = store_marker(root)
    if marker is not None and PATHS_KEY in marker:
        update_group_attrs(root, {FORMAT_KEY: {k: v for k, v in marker.items() if k not in (PATHS_KEY, RULE_KEY)}})
