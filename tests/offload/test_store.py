"""Tests for the shard store: fast-route round trips, zarr interop, checksums, errors, durability."""

import errno
import json
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec

from offload.chunks import ChecksumError, FileOps
from offload.io import IORunner, OffloadIOError
from offload.metadata import ZARR_DTYPES, create_array_meta
from offload.nodes import SCRATCH
from offload.store import ShardStore

TIMEOUT = 10
CHUNK = 4096  # elements: 8 or 16 KiB per chunk, a multiple of the O_DIRECT alignment
NCHUNKS = 8
NUMEL = CHUNK * NCHUNKS
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


class RecordingOps(FileOps):
    """Records opens and fsyncs by path; optionally fails one primitive with an errno."""

    def __init__(self, fail: dict[str, int] | None = None, refuse_direct: bool = False) -> None:
        self.fail = fail or {}
        self.refuse_direct = refuse_direct
        self.lock = threading.Lock()
        self.paths: dict[int, str] = {}
        self.opened: list[tuple[str, int]] = []
        self.fsynced: list[str] = []

    def _maybe_fail(self, op: str) -> None:
        if op in self.fail:
            raise OSError(self.fail[op], os.strerror(self.fail[op]))

    def open(self, path, flags):
        with self.lock:
            self.opened.append((path, flags))
        if self.refuse_direct and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        fd = super().open(path, flags)
        with self.lock:
            self.paths[fd] = path
        return fd

    def pwrite(self, fd, buf, offset):
        self._maybe_fail("pwrite")
        return super().pwrite(fd, buf, offset)

    def preadv(self, fd, buf, offset):
        self._maybe_fail("preadv")
        return super().preadv(fd, buf, offset)

    def fsync(self, fd):
        with self.lock:
            self.fsynced.append(self.paths[fd])
        super().fsync(fd)


@pytest.fixture
def runner():
    with IORunner(threads=4, queue_depth=8) as r:
        yield r


def make_store(tmp_path: Path, runner: IORunner, **kwargs) -> ShardStore:
    return ShardStore.create(tmp_path / "store", {"layout": {"units": 2}}, runner=runner, **kwargs)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-aligned tensor, as the buffer pool provides for O_DIRECT."""
    return torch.frombuffer(mmap.mmap(-1, numel * dtype.itemsize), dtype=dtype)


def unaligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor that is never page-aligned (a plain torch.empty can be, by chance)."""
    return aligned_empty(numel + 64 // dtype.itemsize, dtype)[64 // dtype.itemsize :]


def random_bits(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads included): only a bit-exact path round-trips them."""
    g = torch.Generator().manual_seed(seed)
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, (numel,), dtype=bits, generator=g).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def chunk_path(store: ShardStore, name: str, index: int) -> Path:
    return store.path / name / "c" / str(index)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_round_trip_bit_exact_parallel(tmp_path, runner, dtype, aligned):
    ops = RecordingOps()
    store = make_store(tmp_path, runner, file_ops=ops)
    name = "gen-0/blocks.0/master"
    store.create_array(name, NUMEL, CHUNK, dtype)
    alloc = aligned_empty if aligned else unaligned_empty
    src = alloc(NUMEL, dtype)
    src.copy_(random_bits(NUMEL, dtype))
    half = NUMEL // 2
    IORunner.gather([store.write_async(name, 0, src[:half]), store.write_async(name, half, src[half:])]).result(TIMEOUT)
    out = alloc(NUMEL, dtype)
    out.zero_()
    IORunner.gather([store.read_async(name, half, out[half:]), store.read_async(name, 0, out[:half])]).result(TIMEOUT)
    assert same_bits(out, src)
    direct_opens = [p for p, flags in ops.opened if flags & os.O_DIRECT]
    # O_DIRECT exactly when the buffer is page aligned (tmp_path is on a filesystem that allows it).
    assert len(direct_opens) == (2 * NCHUNKS if aligned else 0)
    assert chunk_path(store, name, NCHUNKS - 1).stat().st_size == CHUNK * dtype.itemsize + 4


def test_many_threads_write_and_read_distinct_chunks(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.create_array("a", NUMEL, CHUNK, torch.float32)
    src = random_bits(NUMEL, torch.float32, seed=1)
    out = torch.zeros(NUMEL)
    spans = [(i * CHUNK, slice(i * CHUNK, (i + 1) * CHUNK)) for i in range(NCHUNKS)]
    with ThreadPoolExecutor(NCHUNKS) as callers:
        list(callers.map(lambda s: store.write_from("a", s[0], src[s[1]]), spans))
        list(callers.map(lambda s: store.read_into("a", s[0], out[s[1]]), spans))
    assert same_bits(out, src)


def test_direct_io_refused_falls_back_to_buffered(tmp_path, runner, caplog):
    ops = RecordingOps(refuse_direct=True)
    store = make_store(tmp_path, runner, file_ops=ops)
    store.create_array("a", NUMEL, CHUNK, torch.float32)
    src = aligned_empty(NUMEL, torch.float32)
    src.copy_(random_bits(NUMEL, torch.float32))
    with caplog.at_level(logging.WARNING, logger="offload.store"):
        store.write_from("a", 0, src)
    out = aligned_empty(NUMEL, torch.float32)
    store.read_into("a", 0, out)
    assert same_bits(out, src)
    assert "O_DIRECT refused" in caplog.text
    # Once refused, the store stops asking: at most one attempt per concurrent task.
    direct_attempts = sum(1 for _, flags in ops.opened if flags & os.O_DIRECT)
    assert 1 <= direct_attempts <= runner.threads


def test_direct_io_off_never_opens_with_o_direct(tmp_path, runner):
    ops = RecordingOps()
    store = make_store(tmp_path, runner, file_ops=ops, direct_io=False)
    store.create_array("a", NUMEL, CHUNK, torch.float32)
    src = aligned_empty(NUMEL, torch.float32)
    src.copy_(random_bits(NUMEL, torch.float32))
    store.write_from("a", 0, src)
    out = aligned_empty(NUMEL, torch.float32)
    store.read_into("a", 0, out)
    assert same_bits(out, src)
    assert len(ops.opened) == 2 * NCHUNKS
    assert not any(flags & os.O_DIRECT for _, flags in ops.opened)


def test_array_metadata_survives_reopen(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.create_array("gen-0/blocks.1/param", NUMEL, CHUNK, torch.bfloat16)
    store.create_array("gen-0/root/master", CHUNK, CHUNK, torch.float32)
    reopened = ShardStore.open(store.path, runner=runner)
    info = reopened.array_info("gen-0/blocks.1/param")
    assert (info.numel, info.chunk_elems, info.dtype, info.checksum) == (NUMEL, CHUNK, torch.bfloat16, True)
    assert reopened.array_names() == ["gen-0/blocks.1/param", "gen-0/root/master"]
    assert reopened.has_array("gen-0/root/master")
    assert not reopened.has_array("gen-0/root")
    assert not reopened.has_array("gen-0/nothing")


def test_attrs_round_trip_and_update(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.update_attrs({"world_size": 2})
    reopened = ShardStore.open(store.path, runner=runner)
    assert reopened.attrs == {"layout": {"units": 2}, "world_size": 2}
    assert zarr.open_group(store.path, mode="r").attrs["world_size"] == 2
    with pytest.raises(ValueError, match="reserved"):
        store.update_attrs({"offload_store": 0})


# -------------------------------------------------------------------- interop


def test_plain_zarr_reads_what_the_fast_route_wrote(tmp_path, runner):
    store = make_store(tmp_path, runner)
    data = {dtype: random_bits(NUMEL, dtype, seed=i) for i, dtype in enumerate(BITS)}
    for dtype, values in data.items():
        name = f"gen-0/u/{str(dtype).removeprefix('torch.')}"
        store.create_array(name, NUMEL, CHUNK, dtype)
        store.write_from(name, 0, values)
    store.sync()
    group = zarr.open_group(store.path, mode="r")
    for dtype, values in data.items():
        read = group[f"gen-0/u/{str(dtype).removeprefix('torch.')}"][:]
        expected = values.view(torch.uint16) if dtype == torch.bfloat16 else values
        assert read.tobytes() == expected.numpy().tobytes()
    assert group["gen-0/u/bfloat16"].attrs["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("checksum", [True, False], ids=["crc32c", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_array_metadata_is_what_zarr_writes_for_the_array(dtype, checksum, tmp_path) -> None:
    """Each array's `zarr.json` (and its new groups') is zarr's own document for it, made once
    per dtype and filled in: the same JSON `zarr.create_array` writes for that array."""
    ours, zarrs = tmp_path / "ours", tmp_path / "zarr"
    for at in (ours, zarrs):
        zarr.open_group(at, mode="w")
    for name, numel, stripe in [("gen-0/blocks.0/master", 4096, None), ("gen-0/blocks.1/m", 512, 3)]:
        create_array_meta(ours, name, numel, 256, dtype, checksum, stripe)
        zarr.create_array(
            zarrs,
            name=name,
            shape=(numel,),
            chunks=(256,),
            dtype=ZARR_DTYPES[dtype],
            serializer=BytesCodec(endian="little"),
            compressors=[Crc32cCodec()] if checksum else None,
            filters=None,
            fill_value=0,
            attributes={"torch_dtype": str(dtype).removeprefix("torch.")}
            | ({} if stripe is None else {"stripe_start": 3}),
        )
    written = sorted(p.relative_to(zarrs) for p in zarrs.rglob("zarr.json"))
    assert written == sorted(p.relative_to(ours) for p in ours.rglob("zarr.json"))
    for path in written:
        assert json.loads((ours / path).read_text()) == json.loads((zarrs / path).read_text()), path


class CountingWrites(FileOps):
    """The real file operations, counting the bytes ``pwrite`` is given."""

    written = 0

    def pwrite(self, fd: int, buf, offset: int) -> int:
        CountingWrites.written += len(memoryview(buf).cast("B"))
        return super().pwrite(fd, buf, offset)


@pytest.mark.parametrize("checksum", [True, False], ids=["crc32c", "plain"])
def test_zeroed_chunks_read_as_zeros_write_no_data_and_pass_their_checksums(checksum, tmp_path, runner) -> None:
    store = make_store(tmp_path, runner, checksum=checksum)
    store.create_array("gen-0/u/m", NUMEL, CHUNK, torch.float32)
    store.write_from("gen-0/u/m", 0, random_bits(NUMEL, torch.float32))  # a recycled chunk's old bytes
    store._ops, CountingWrites.written = CountingWrites(), 0
    store.write_zeros_async("gen-0/u/m", CHUNK, 2 * CHUNK).result()
    assert CountingWrites.written == (2 * 4 if checksum else 0), "nothing but the trailers is written"
    store.sync()
    out = torch.full((NUMEL,), 7.0)
    ShardStore.open(store.path, runner=runner).read_into("gen-0/u/m", 0, out)
    expected = random_bits(NUMEL, torch.float32)
    expected[CHUNK : 3 * CHUNK] = 0
    assert same_bits(out, expected)
    assert zarr.open_array(store.path / "gen-0/u/m", mode="r")[:].tobytes() == expected.numpy().tobytes()
    for index in (1, 2):
        stat = os.stat(store.chunk_path("gen-0/u/m", index))
        assert stat.st_size == CHUNK * 4 + (4 if checksum else 0)
        assert stat.st_blocks * 512 >= CHUNK * 4, "the blocks are reserved"
    with pytest.raises(ValueError, match="whole chunks"):
        store.write_zeros_async("gen-0/u/m", 1, CHUNK)


def test_zeroed_chunks_are_holes_where_blocks_cannot_be_reserved(tmp_path, runner, monkeypatch) -> None:
    def refused(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", refused)
    store = make_store(tmp_path, runner)
    store.create_array("gen-0/u/m", NUMEL, CHUNK, torch.float32)
    store.write_from("gen-0/u/m", 0, random_bits(NUMEL, torch.float32))
    store.write_zeros_async("gen-0/u/m", 0, NUMEL).result()
    store.sync()
    out = torch.full((NUMEL,), 7.0)
    store.read_into("gen-0/u/m", 0, out)
    assert not out.any()


def test_fast_route_reads_what_plain_zarr_wrote(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.create_array("gen-0/u/param", NUMEL, CHUNK, torch.bfloat16)
    values = random_bits(NUMEL, torch.bfloat16)
    values[CHUNK : 2 * CHUNK] = 0  # a chunk equal to the fill value must still be written
    # zarr 3.1 ignores open_array(config=...): the global config is what sets it.
    with zarr.config.set({"array.write_empty_chunks": True}):
        array = zarr.open_array(store.path / "gen-0/u/param", mode="r+")
        array[:] = values.view(torch.uint16).numpy()
    out = torch.full((NUMEL,), 7.0, dtype=torch.bfloat16)
    store.read_into("gen-0/u/param", 0, out)
    assert same_bits(out, values)


def test_array_with_other_codecs_is_refused(tmp_path, runner):
    store = make_store(tmp_path, runner)
    zarr.create_array(store.path, name="zstd", shape=(NUMEL,), chunks=(CHUNK,), dtype="float32")
    assert store.has_array("zstd")
    with pytest.raises(ValueError, match=r"'zstd'.*codecs.*read it with zarr"):
        store.read_into("zstd", 0, torch.empty(CHUNK))


def test_store_without_checksum_round_trips_and_zarr_reads_it(tmp_path, runner):
    store = make_store(tmp_path, runner, checksum=False)
    store.create_array("a", NUMEL, CHUNK, torch.float16)
    values = random_bits(NUMEL, torch.float16)
    store.write_from("a", 0, values)
    assert chunk_path(store, "a", 0).stat().st_size == CHUNK * 2
    out = torch.empty(NUMEL, dtype=torch.float16)
    store.read_into("a", 0, out)
    assert same_bits(out, values)
    assert zarr.open_array(store.path / "a", mode="r")[:].tobytes() == values.numpy().tobytes()
    assert ShardStore.open(store.path, runner=runner).checksum is False


# ------------------------------------------------------------------ corruption


@pytest.mark.parametrize("offset", [100, CHUNK * 4 + 1], ids=["body", "crc"])
def test_flipped_byte_fails_fast_route_and_zarr(tmp_path, runner, offset):
    store = make_store(tmp_path, runner)
    store.create_array("gen-0/u/master", NUMEL, CHUNK, torch.float32)
    store.write_from("gen-0/u/master", 0, random_bits(NUMEL, torch.float32))
    path = chunk_path(store, "gen-0/u/master", 3)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(raw)
    with pytest.raises(ChecksumError) as info:
        store.read_into("gen-0/u/master", 0, torch.empty(NUMEL))
    message = str(info.value)
    assert "'gen-0/u/master' chunk 3" in message and str(path) in message
    with pytest.raises(ValueError, match="checksum"):
        zarr.open_array(store.path / "gen-0/u/master", mode="r")[:]


def test_truncated_chunk_is_reported(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.create_array("a", NUMEL, CHUNK, torch.float32)
    store.write_from("a", 0, torch.ones(NUMEL))
    path = chunk_path(store, "a", 5)
    os.truncate(path, 1000)
    with pytest.raises(ChecksumError, match=rf"chunk 5: .*{path}.*truncated \(1000 of {CHUNK * 4 + 4}"):
        store.read_into("a", 5 * CHUNK, torch.empty(CHUNK))


def test_missing_chunk_is_an_error_not_zeros(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.create_array("gen-0/u/master", NUMEL, CHUNK, torch.float32)
    store.write_from("gen-0/u/master", 0, torch.ones(CHUNK))
    with pytest.raises(OffloadIOError) as info:
        store.read_into("gen-0/u/master", 0, torch.empty(2 * CHUNK))
    err = info.value
    assert err.errno == errno.ENOENT
    assert f"gen-0/u/master chunk 1 elements [{CHUNK}, {2 * CHUNK})" in str(err)
    assert str(chunk_path(store, "gen-0/u/master", 1)) in str(err)


# ------------------------------------------------------------ injected faults


@pytest.mark.parametrize(
    ("op", "code", "kind"),
    [("pwrite", errno.ENOSPC, "write"), ("pwrite", errno.EIO, "write"), ("preadv", errno.EIO, "read")],
)
def test_injected_os_error_names_array_kind_and_range(tmp_path, runner, op, code, kind):
    ops = RecordingOps()
    store = make_store(tmp_path, runner, file_ops=ops)
    store.create_array("gen-1/blocks.0/master", NUMEL, CHUNK, torch.float32)
    store.write_from("gen-1/blocks.0/master", 0, torch.ones(NUMEL))
    ops.fail[op] = code
    buf = torch.ones(2 * CHUNK)
    call = store.write_async if kind == "write" else store.read_async
    future = call("gen-1/blocks.0/master", 2 * CHUNK, buf)
    with pytest.raises(OffloadIOError) as info:
        future.result(TIMEOUT)  # a hang would fail here, not block the run
    err = info.value
    assert err.errno == code
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == code
    assert f"{kind} gen-1/blocks.0/master chunk " in str(err)
    assert any(f"elements [{i * CHUNK}, {(i + 1) * CHUNK})" in str(err) for i in (2, 3))
    # The runner is still healthy afterwards.
    del ops.fail[op]
    store.read_into("gen-1/blocks.0/master", 0, torch.empty(NUMEL))


def test_sync_reports_a_failed_write(tmp_path, runner):
    ops = RecordingOps(fail={"pwrite": errno.ENOSPC})
    store = make_store(tmp_path, runner, file_ops=ops)
    store.create_array("a", NUMEL, CHUNK, torch.float32)
    future = store.write_async("a", 0, torch.ones(CHUNK))
    with pytest.raises(OffloadIOError) as info:
        store.sync()
    assert info.value.errno == errno.ENOSPC
    assert "'a'" in str(info.value) and "write that data again" in str(info.value)
    assert future.done()
    del ops.fail["pwrite"]
    store.write_from("a", 0, torch.ones(CHUNK))
    store.sync()


# -------------------------------------------------------------- bad requests


def test_misaligned_or_mismatched_requests_raise_value_error(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.create_array("gen-0/u/master", NUMEL, CHUNK, torch.float32)
    name = "gen-0/u/master"
    cases = [
        (1, torch.empty(CHUNK), r"elements \[1, 4097\).*chunk size 4096"),
        (0, torch.empty(CHUNK + 1), r"elements \[0, 4097\).*whole chunks"),
        (NUMEL - CHUNK, torch.empty(2 * CHUNK), r"inside the array"),
        (0, torch.empty(0), r"non-empty"),
        (0, torch.empty(CHUNK, dtype=torch.float16), r"dtype torch.float16 differs"),
        (0, torch.empty(2 * CHUNK)[::2], r"contiguous 1-D"),
        (0, torch.empty(2, CHUNK // 2), r"contiguous 1-D"),
    ]
    for start, buf, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            store.read_into(name, start, buf)
        with pytest.raises(ValueError, match=pattern):
            store.write_async(name, start, buf)


def test_create_array_validates(tmp_path, runner):
    store = make_store(tmp_path, runner)
    with pytest.raises(ValueError, match=r"'a'.*numel 5000 .* chunk_elems 4096; pad it to 8192"):
        store.create_array("a", 5000, CHUNK, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        store.create_array("a", CHUNK, CHUNK, torch.complex64)
    with pytest.raises(ValueError, match="invalid array name"):
        store.create_array("gen-0//x", CHUNK, CHUNK, torch.float32)
    store.create_array("a", CHUNK, CHUNK, torch.float32)
    with pytest.raises(FileExistsError, match=r"delete it first"):
        store.create_array("a", CHUNK, CHUNK, torch.float32)
    with pytest.raises(KeyError, match="no array 'b'"):
        store.array_info("b")


def test_open_missing_or_foreign_path(tmp_path, runner):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"no offload store at .*nowhere.*pass the folder") as info:
        ShardStore.open(missing, runner=runner)
    assert info.value.errno == errno.ENOENT
    zarr.open_group(tmp_path / "plain", mode="w")
    with pytest.raises(ValueError, match=r"plain is not an offload store"):
        ShardStore.open(tmp_path / "plain", runner=runner)


def test_create_refuses_existing_paths_unless_overwrite(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.create_array("a", CHUNK, CHUNK, torch.float32)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        make_store(tmp_path, runner)
    fresh = make_store(tmp_path, runner, overwrite=True)
    assert fresh.array_names() == []
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an offload store"):
        ShardStore.create(tmp_path / "precious", {}, runner=runner, overwrite=True)
    assert (tmp_path / "precious" / "notes.txt").exists()


# ------------------------------------------------------------------ durability


def test_sync_fsyncs_every_written_chunk_and_its_directories(tmp_path, runner):
    ops = RecordingOps()
    store = make_store(tmp_path, runner, file_ops=ops)
    store.create_array("gen-0/a/master", NUMEL, CHUNK, torch.float32)
    store.create_array("gen-0/b/master", NUMEL, CHUNK, torch.float32)
    store.sync()
    ops.fsynced.clear()
    store.write_from("gen-0/a/master", CHUNK, torch.ones(3 * CHUNK))
    store.write_from("gen-0/b/master", 0, torch.ones(2 * CHUNK))
    store.write_from("gen-0/b/master", 0, torch.ones(CHUNK))  # rewritten: one fsync suffices
    store.sync()
    expected_files = {str(chunk_path(store, "gen-0/a/master", i)) for i in (1, 2, 3)}
    expected_files |= {str(chunk_path(store, "gen-0/b/master", i)) for i in (0, 1)}
    expected_dirs = {str(store.path / "gen-0/a/master/c"), str(store.path / "gen-0/b/master/c")}
    assert sorted(ops.fsynced) == sorted(expected_files | expected_dirs)
    ops.fsynced.clear()
    store.sync()
    assert ops.fsynced == []


def test_a_scratch_store_never_fsyncs_its_chunks_and_is_swept_from_its_parent(tmp_path, runner):
    parent = make_store(tmp_path, runner)
    ops = RecordingOps()
    scratch = ShardStore.create(parent.path / SCRATCH / "rank-0", {}, runner=runner, file_ops=ops, scratch=True)
    scratch.create_array("a/grad", NUMEL, CHUNK, torch.float32)
    scratch.sync()
    ops.fsynced.clear()
    data = random_bits(NUMEL, torch.float32)
    scratch.write_from("a/grad", 0, data)
    scratch.sync()
    assert ops.fsynced == [], "chunks of a scratch store are rewritten before they are read again"
    back = torch.empty(NUMEL)
    scratch.read_into("a/grad", 0, back)
    assert same_bits(back, data)
    assert parent.array_names() == [], "a scratch store is no node of the store it sits in"
    parent.nodes.sweep()
    assert not (parent.path / SCRATCH).exists()


def test_new_arrays_metadata_is_fsynced(tmp_path, runner):
    ops = RecordingOps()
    store = make_store(tmp_path, runner, file_ops=ops)
    store.create_array("gen-0/a/master", CHUNK, CHUNK, torch.float32)
    store.sync()
    synced = set(ops.fsynced)
    for meta in ("zarr.json", "gen-0/zarr.json", "gen-0/a/zarr.json", "gen-0/a/master/zarr.json"):
        assert str(store.path / meta) in synced
    for directory in ("", "gen-0", "gen-0/a", "gen-0/a/master", "gen-0/a/master/c"):
        assert str(store.path / directory).rstrip("/") in synced


# ---------------------------------------------------------- move and delete


def test_move_renames_a_generation_durably_and_zarr_still_reads_it(tmp_path, runner):
    ops = RecordingOps()
    store = make_store(tmp_path, runner, file_ops=ops)
    values = random_bits(NUMEL, torch.float32)
    store.create_array("gen-1/blocks.0/master", NUMEL, CHUNK, torch.float32)
    store.array_info("gen-1/blocks.0/master")
    store.write_async("gen-1/blocks.0/master", 0, values)  # still in flight: move syncs first
    store.nodes.move("gen-1", "checkpoints/step-10")
    assert store.array_names() == ["checkpoints/step-10/blocks.0/master"]
    assert not store.has_array("gen-1/blocks.0/master")
    out = torch.empty(NUMEL)
    store.read_into("checkpoints/step-10/blocks.0/master", 0, out)
    assert same_bits(out, values)
    # The data was synced under its old name, before the rename.
    assert str(chunk_path(store, "gen-1/blocks.0/master", 0)) in ops.fsynced
    assert str(chunk_path(store, "checkpoints/step-10/blocks.0/master", 0)) not in ops.fsynced
    assert {str(store.path), str(store.path / "checkpoints")} <= set(ops.fsynced)
    read = zarr.open_group(store.path, mode="r")["checkpoints/step-10/blocks.0/master"][:]
    assert read.tobytes() == values.numpy().tobytes()
    store.create_array("gen-1/blocks.0/master", NUMEL, CHUNK, torch.float32)
    with pytest.raises(FileExistsError, match="destination exists"):
        store.nodes.move("gen-1", "checkpoints/step-10")
    with pytest.raises(FileNotFoundError, match="no group or array 'gen-9'"):
        store.nodes.move("gen-9", "gen-10")


def test_delete_removes_arrays_and_pending_state(tmp_path, runner):
    store = make_store(tmp_path, runner)
    store.create_array("gen-0/a/master", NUMEL, CHUNK, torch.float32)
    store.create_array("gen-1/a/master", NUMEL, CHUNK, torch.float32)
    store.write_async("gen-0/a/master", 0, torch.ones(NUMEL))
    store.nodes.delete("gen-0")
    assert store.array_names() == ["gen-1/a/master"]
    assert not (store.path / "gen-0").exists()
    assert not store.has_array("gen-0/a/master")
    store.sync()  # nothing pending refers to the deleted files
    with pytest.raises(FileNotFoundError, match="no group or array 'gen-0'"):
        store.nodes.delete("gen-0")


def test_read_range_reads_any_range_through_the_chunks_covering_it(tmp_path) -> None:
    chunk = 1024
    data = torch.arange(4 * chunk, dtype=torch.float32)
    with IORunner(threads=2) as runner:
        store = ShardStore.create(tmp_path / "store", {}, runner=runner)
        store.create_array("a", data.numel(), chunk, torch.float32)
        store.write_from("a", 0, data)
        ranges = [
            (0, 4 * chunk),  # whole chunks: the fast route
            (5, 9),  # inside one chunk
            (chunk - 1, chunk + 1),  # across a boundary
            (3, 3 * chunk + 2),  # a partial chunk, whole ones, a partial one
            (chunk, 2 * chunk + 5),
            (7, 4 * chunk),
        ]
        for start, end in ranges:
            out = torch.full((end - start,), -1.0)
            store.read_range("a", start, out)
            assert torch.equal(out, data[start:end]), (start, end)
        with pytest.raises(ValueError, match=r"elements \[4095, 4097\).*inside the array"):
            store.read_range("a", 4 * chunk - 1, torch.empty(2))
