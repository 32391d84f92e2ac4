"""A store that says something the engine never writes is refused, whole and untouched.

Each case below changes one thing in a real store (a field of ``COMMITTED``, a name that
would lead out of the store, a link, array metadata, a committed chunk, ``COMMITTED`` itself);
resuming from it, inspecting it and
consolidating it must each stop with one line naming the file and the way out, and leave
every file inside and outside the store byte-identical (the writer lock's own file aside:
it records whoever last asked for the store).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import Config
from engine.engine import Engine
from engine.run.cli import main as cli
from offload.chunks import ChecksumError
from offload.lock import LOCK_FILE
from offload.manifest import ManifestError
from tests.engine.test_resume import nvme, run
from tests.training import tiny_gpt

VICTIM = "victim"


def edit_committed(**fields) -> Callable[[Path, Path], None]:
    def edit(store: Path, outside: Path) -> None:
        record = json.loads((store / "COMMITTED").read_text())
        for key, value in fields.items():
            if value is None:
                record.pop(key)
            else:
                record[key] = value
        (store / "COMMITTED").write_text(json.dumps(record))

    return edit


def superseded_outside(store: Path, outside: Path) -> None:
    (outside / VICTIM).mkdir()
    (outside / VICTIM / "COMMITTED").write_text("the victim's own file")
    depth = len(store.relative_to(outside).parts)
    traversal = "/".join([".."] * depth) + f"/{VICTIM}"
    edit_committed(superseded={"tag": "t", "retain": 0, "record": {"generation": traversal}})(store, outside)


def linked_chunk(store: Path, outside: Path) -> None:
    (outside / VICTIM).write_bytes(b"the victim's own bytes")
    target = next((store / "gen-4").rglob("c/0"))  # the next write target
    target.unlink()
    target.symlink_to(outside / VICTIM)


def linked_folder(store: Path, outside: Path) -> None:
    shutil.move(store / "gen-4", outside / VICTIM)
    (store / "gen-4").symlink_to(outside / VICTIM, target_is_directory=True)


def edit_array_meta(change: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    def edit(store: Path, outside: Path) -> None:
        meta = next((store / "gen-3").rglob("master/zarr.json"))
        value = change(json.loads(meta.read_text()))
        meta.write_text(value if isinstance(value, str) else json.dumps(value))

    return edit


def huge(meta: dict) -> dict:
    meta["shape"] = [2**40]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [2**40]
    return meta


def committed_chunk(change: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    def edit(store: Path, outside: Path) -> None:
        chunk = store / "gen-3" / "blocks.0" / "master" / "c" / "0"
        chunk.write_bytes(change(chunk.read_bytes()))

    return edit


def flip_byte(data: bytes) -> bytes:
    return data[:8] + bytes([data[8] ^ 0xFF]) + data[9:]


def lost_committed(store: Path, outside: Path) -> None:
    (store / "COMMITTED").unlink()


def edit_checkpoint(store: Path, outside: Path) -> None:
    path = store / "checkpoints" / "a" / "COMMITTED"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "generation": "x"}))


CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "missing generation": (edit_committed(generation=999), "names generation 999, which the store does not hold"),
    "negative generation": (edit_committed(generation=-1), "field 'generation' holds -1"),
    "string generation": (edit_committed(generation="3"), "field 'generation' holds '3'"),
    "superseded outside": (superseded_outside, "field 'superseded'"),
    "tag with ..": (edit_committed(keep={"tag": "../../x", "retain": 0}), "field 'keep': invalid checkpoint tag"),
    "absolute tag": (edit_committed(keep={"tag": "/tmp/x", "retain": 0}), "field 'keep': invalid checkpoint tag"),
    "string step": (edit_committed(step="3"), "field 'step' holds '3'"),
    "no step": (edit_committed(step=None), "field 'step' is missing"),
    "bad rng": (edit_committed(rng=["x"]), "field 'rng' entry 0 is not a random-generator state"),
    "bad loss scale": (edit_committed(loss_scale="big"), "field 'loss_scale'"),
    "bad unit order": (edit_committed(unit_order={"grads": [1]}), "field 'unit_order'"),
    "linked chunk": (linked_chunk, "holds a symbolic link"),
    "linked folder": (linked_folder, "holds a symbolic link"),
    "huge chunk": (edit_array_meta(huge), "promises"),
    "garbled array metadata": (edit_array_meta(lambda meta: "{not json"), "is not valid JSON"),
    "bad checkpoint record": (edit_checkpoint, "field 'generation' holds 'x'"),
    "truncated chunk": (committed_chunk(lambda data: data[:100]), "gen-3/blocks.0/master/c/0"),
    "flipped chunk byte": (committed_chunk(flip_byte), "gen-3/blocks.0/master/c/0 fails its CRC-32C check"),
    "lost COMMITTED": (lost_committed, "has no COMMITTED record but was trained into"),
}
# Read-only commands read what they need, not every field a resume checks.
READ_ONLY_SKIPS = {
    "string step",
    "no step",
    "bad rng",
    "bad loss scale",
    "bad unit order",
    "linked chunk",
    "linked folder",
    "bad checkpoint record",
    "lost COMMITTED",  # they read the last checkpoint, as they read a memory tier's store
}


def clipped(root: Path) -> Config:
    """The store at ``root/store``, with clipping: gradients are spilled to its scratch folder,
    which a refused run must not make."""
    return nvme(root, optim={"grad_clip": 1.0})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A store at step 3 with checkpoint 'a' (step 1): generations 3 (committed) and 4 (next)."""
    root = tmp_path_factory.mktemp("pristine")
    eng = Engine(tiny_gpt(), clipped(root), total_steps=6)
    run(eng, 1)
    eng.save("a")
    run(eng, 2)
    eng.close()
    return root / "store"


def snapshot(root: Path) -> dict[str, object]:
    """Every file and link under ``root``: its bytes, or where it points."""
    found: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_file() and name != LOCK_FILE:
                found[key] = path.read_bytes()
    return found


def refusal(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture) -> str:
    """The one-line error a command logged, or the damage its ``--verify`` report lists."""
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    report = capsys.readouterr().out
    if not errors and "FAILED" in report:
        return report
    assert len(errors) == 1 and "\n" not in errors[0], errors
    return errors[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_store_is_refused_and_left_untouched(tmp_path, pristine, caplog, capsys, case: str) -> None:
    outside = tmp_path
    store = tmp_path / "run" / "store"
    shutil.copytree(pristine, store)
    craft, message = CASES[case]
    craft(store, outside)
    before = snapshot(outside)

    with pytest.raises((ValueError, OSError)) as refused:
        Engine.resume(tiny_gpt(), clipped(tmp_path / "run"), total_steps=6)
    # An I/O error adds the task it failed in on a line of its own, which the command line joins.
    assert message in str(refused.value) and "\n" not in str(refused.value).split("\nin I/O task:")[0]
    damaged = isinstance(refused.value, (ManifestError, ChecksumError)) and case != "bad checkpoint record"
    if damaged or case == "lost COMMITTED":
        assert "`python -m engine train --from-checkpoint a`" in str(refused.value), "the way out is named"
    del refused  # its traceback holds the refused engine, and with it the store's lock
    assert snapshot(outside) == before

    if case not in READ_ONLY_SKIPS:
        for command in (
            ["inspect", str(store), "--verify"],
            ["consolidate", str(store), str(tmp_path / "out.safetensors")],
        ):
            caplog.clear()
            assert cli(command) == 1, command
            assert message in refusal(caplog, capsys)
        assert snapshot(outside) == before
