import json
import os
import stat

import pytest

from offload.manifest import (
    FORMAT_VERSION,
    ManifestError,
    commit,
    read_committed,
    write_atomic,
)


def record(generation: int) -> dict:
    return {"generation": generation, "step": 10 * generation, "loss_scale": 65536.0, "rng": {"cpu": [1, 2, 3]}}


def test_round_trip(tmp_path):
    assert read_committed(tmp_path) is None
    commit(tmp_path, record(1))
    assert read_committed(tmp_path) == record(1)
    commit(tmp_path, record(2), name="other")
    assert read_committed(tmp_path, name="other") == record(2)
    assert read_committed(tmp_path) == record(1)


def test_file_is_sorted_json_with_a_format_version(tmp_path):
    commit(tmp_path, {"zeta": 1, "alpha": 2})
    text = (tmp_path / "COMMITTED").read_text()
    on_disk = json.loads(text)
    assert on_disk == {"alpha": 2, "zeta": 1, "format": FORMAT_VERSION}
    assert list(on_disk) == sorted(on_disk)


def crash(src, dst):
    raise OSError("simulated crash between the temp write and the rename")


def test_crash_before_rename_keeps_the_old_manifest(tmp_path, monkeypatch):
    commit(tmp_path, record(1))
    before = (tmp_path / "COMMITTED").read_bytes()
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        commit(tmp_path, record(2))
    monkeypatch.undo()

    assert (tmp_path / "COMMITTED").read_bytes() == before
    assert read_committed(tmp_path) == record(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["COMMITTED"]


def test_a_leftover_temp_file_is_never_read(tmp_path, monkeypatch):
    commit(tmp_path, record(1))
    # A power loss can leave a temp behind that no cleanup ran for: keep it to see it ignored.
    monkeypatch.setattr(os, "unlink", lambda path: None)
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        commit(tmp_path, record(2))
    monkeypatch.undo()

    leftovers = [p for p in tmp_path.iterdir() if p.name != "COMMITTED"]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".COMMITTED.")
    assert json.loads(leftovers[0].read_text())["generation"] == 2
    assert read_committed(tmp_path) == record(1)
    commit(tmp_path, record(3))
    assert read_committed(tmp_path) == record(3)


def test_file_and_directory_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    write_atomic(tmp_path / "data", b"payload")
    assert synced == ["file", "dir"]  # contents durable before the rename, rename durable after
    assert (tmp_path / "data").read_bytes() == b"payload"


def test_a_write_that_need_not_be_durable_syncs_nothing_and_leaves_no_temporary(tmp_path, monkeypatch):
    """The store's metadata and the token cache: atomic, made durable by a later sync or never."""
    write_atomic(tmp_path / "data", b"old")
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    write_atomic(tmp_path / "data", b"new", durable=False)
    assert synced == []
    assert (tmp_path / "data").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


@pytest.mark.parametrize("durable", [True, False])
def test_the_file_takes_the_umask_mode_as_any_file_does(tmp_path, durable):
    """Readable by the other users who read the store, where the umask lets them."""
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "data", b"payload", durable=durable)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o644


@pytest.mark.parametrize(
    "content, reason",
    [
        (b'{"generation": 3, "format": 1', "garbled or truncated"),
        (b"\xff\xfe not text", "garbled or truncated"),
        (b"[1, 2]", "not an object"),
        (b'{"generation": 3}', "no 'format' field"),
        (b'{"generation": 3, "format": 99}', "format 99"),
    ],
)
def test_bad_manifest_raises_naming_the_path(tmp_path, content, reason):
    path = tmp_path / "COMMITTED"
    path.write_bytes(content)
    with pytest.raises(ManifestError, match=reason) as excinfo:
        read_committed(tmp_path)
    assert str(path) in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


def test_commit_rejects_records_it_cannot_write_faithfully(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        commit(tmp_path, {"format": 2})
    with pytest.raises(ValueError, match="not plain JSON"):
        commit(tmp_path, {"loss_scale": float("inf")})
    with pytest.raises(ValueError, match="not plain JSON"):
        commit(tmp_path, {"rng": b"\x00\x01"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        commit(tmp_path / "missing", record(1))
    assert list(tmp_path.iterdir()) == []
