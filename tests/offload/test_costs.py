"""Tests for the cost account: every byte the store moves is counted, and each stage's CPU time."""

import mmap
import threading

import pytest
import torch

from offload.chunks import FileOps
from offload.costs import STAGES, CostAccount, difference, per_gb
from offload.io import IORunner
from offload.store import ShardStore

CHUNK = 1 << 16  # elements: 256 KiB chunks of fp32


def aligned(numel: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(-1, numel * 4), dtype=torch.float32)


@pytest.mark.parametrize("checksum", [True, False])
def test_the_store_accounts_its_bytes_and_stages(tmp_path, checksum):
    src, dst = aligned(4 * CHUNK), aligned(4 * CHUNK)
    src.uniform_()
    with IORunner(threads=2) as runner:
        store = ShardStore.create(tmp_path / "s", {}, runner=runner, checksum=checksum)
        store.create_array("a", src.numel(), CHUNK, torch.float32)
        store.write_from("a", 0, src)
        store.sync()
        written = store.costs.take()
        store.read_into("a", 0, dst)
        read = store.costs.take()
    assert torch.equal(src, dst)
    assert written["bytes"] == {"read": 0, "written": src.numel() * 4}
    assert read["bytes"] == {"read": src.numel() * 4, "written": 0}
    assert set(STAGES) <= set(written["seconds"])
    assert (written["seconds"]["crc32c"] > 0) == checksum and (read["seconds"]["crc32c"] > 0) == checksum
    assert written["seconds"]["write syscalls"] > 0 and read["seconds"]["read syscalls"] > 0
    assert written["seconds"]["read syscalls"] == 0 and read["seconds"]["write syscalls"] == 0
    rates = per_gb(read)
    assert rates["total"] == pytest.approx(sum(v for k, v in rates.items() if k != "total"))


def test_read_range_accounts_its_copy(tmp_path):
    src = aligned(3 * CHUNK)
    src.uniform_()
    with IORunner(threads=2) as runner:
        store = ShardStore.create(tmp_path / "s", {}, runner=runner)
        store.create_array("a", src.numel(), CHUNK, torch.float32)
        store.write_from("a", 0, src)
        store.costs.take()
        out = torch.empty(CHUNK)
        store.read_range("a", CHUNK // 2, out)
    assert torch.equal(out, src[CHUNK // 2 : CHUNK // 2 + CHUNK])
    assert store.costs.snapshot()["seconds"]["copy"] > 0


def test_the_account_sums_across_threads():
    account = CostAccount()
    before = account.snapshot()

    def work():
        for _ in range(100):
            account.add("crc32c", 0.01)
            account.moved("read", 10)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = difference(account.snapshot(), before)
    assert spent["seconds"]["crc32c"] == pytest.approx(4.0)
    assert spent["bytes"]["read"] == 4000
    assert per_gb({"seconds": {}, "bytes": {"read": 0, "written": 0}}) == {}


class CountingOps(FileOps):
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1

    def preadv(self, fd, buf, offset):
        self._count("preadv")
        return super().preadv(fd, buf, offset)

    def pwrite(self, fd, buf, offset):
        self._count("pwrite")
        return super().pwrite(fd, buf, offset)

    def clear_direct(self, fd):
        self._count("clear_direct")
        return super().clear_direct(fd)


def test_a_checksummed_direct_chunk_is_read_in_one_call(tmp_path):
    """Body and CRC trailer come in one O_DIRECT read; writing still needs the trailer written
    buffered (O_DIRECT cannot write 4 bytes), so O_DIRECT is dropped once per chunk written."""
    src, dst = aligned(4 * CHUNK), aligned(4 * CHUNK)
    src.uniform_()
    ops = CountingOps()
    with IORunner(threads=2) as runner:
        store = ShardStore.create(tmp_path / "s", {}, runner=runner, file_ops=ops)
        store.create_array("a", src.numel(), CHUNK, torch.float32)
        store.write_from("a", 0, src)
        assert ops.calls == {"pwrite": 8, "clear_direct": 4}
        ops.calls.clear()
        store.read_into("a", 0, dst)
        assert ops.calls == {"preadv": 4}
    assert torch.equal(src, dst)


def test_write_async_refuses_crcs_that_do_not_match_its_chunks(tmp_path):
    src = aligned(2 * CHUNK)
    with IORunner(threads=1) as runner:
        store = ShardStore.create(tmp_path / "s", {}, runner=runner)
        store.create_array("a", src.numel(), CHUNK, torch.float32)
        with pytest.raises(ValueError, match="1 CRCs for 2 chunks"):
            store.write_async("a", 0, src, [0])
