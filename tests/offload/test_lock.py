"""The writer lock: one writer per store, the holder named, released by the kernel on death."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys

import pytest

from offload.lock import LOCK_FILE, StoreLock, StoreLockedError, read_holder

HOLD = """
import sys, time
from offload.lock import StoreLock
lock = StoreLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_writer_is_refused_naming_the_holder(tmp_path) -> None:
    first = StoreLock.acquire(tmp_path / "store")
    with pytest.raises(StoreLockedError, match=rf"being written by pid {os.getpid()} on host {socket.gethostname()}"):
        StoreLock.acquire(tmp_path / "store")
    assert read_holder(tmp_path / "store")["pid"] == os.getpid()
    first.release()
    assert read_holder(tmp_path / "store") is None
    again = StoreLock.acquire(tmp_path / "store")
    assert again.held
    again.release()
    assert not again.held


def test_the_lock_of_a_killed_holder_is_gone(tmp_path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(store)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreLockedError, match=rf"pid {holder.pid}"):
            StoreLock.acquire(store)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        holder.stdout.close()
    lock = StoreLock.acquire(store)
    assert read_holder(store)["pid"] == os.getpid()
    lock.release()


def test_folders_made_for_a_lock_that_wrote_nothing_are_removed(tmp_path) -> None:
    lock = StoreLock.acquire(tmp_path / "runs" / "a" / "store")
    assert (tmp_path / "runs" / "a" / "store" / LOCK_FILE).exists()
    lock.release()
    assert list(tmp_path.iterdir()) == [], "a run that wrote nothing leaves no trace"
    kept = StoreLock.acquire(tmp_path / "store")
    (tmp_path / "store" / "zarr.json").write_text("{}")
    kept.release()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [LOCK_FILE, "zarr.json"]


def test_a_collected_lock_is_released(tmp_path) -> None:
    lock = StoreLock.acquire(tmp_path / "store")
    del lock  # an engine whose construction failed: nothing refers to its lock any more
    StoreLock.acquire(tmp_path / "store").release()


def test_reading_needs_the_store_to_exist(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no offload store at"):
        StoreLock.acquire(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        StoreLock.acquire(tmp_path / "file")


def test_a_folder_that_cannot_be_made_is_one_line_naming_the_key(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as err:
        StoreLock.acquire(tmp_path / "file" / "store")
    assert err.value.errno == errno.ENOTDIR
    assert str(err.value) == (
        f"[Errno {errno.ENOTDIR}] cannot create the store folder {tmp_path / 'file' / 'store'} for offload.nvme_path: "
        f"Not a directory ({tmp_path / 'file' / 'store'}); choose a folder on a writable local disk"
    )


def test_parents_made_before_a_failure_are_removed(tmp_path) -> None:
    store = tmp_path / "runs" / ("n" * 300) / "store"  # "runs" can be made, a 300-byte name cannot
    with pytest.raises(OSError, match=r"cannot create the store folder .* for offload.nvme_path: File name too long"):
        StoreLock.acquire(store)
    assert list(tmp_path.iterdir()) == [], "no trace of the refused store"


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.ismount("/proc"), reason="as root, only a pseudo-filesystem refuses"
)
def test_a_store_under_proc_names_the_folder_that_failed() -> None:
    with pytest.raises(FileNotFoundError) as err:
        StoreLock.acquire("/proc/x/store")
    assert err.value.errno == errno.ENOENT and "\n" not in str(err.value)
    assert str(err.value).endswith(
        "cannot create the store folder /proc/x/store for offload.nvme_path: No such file or directory (/proc/x); "
        "choose a folder on a writable local disk"
    )
