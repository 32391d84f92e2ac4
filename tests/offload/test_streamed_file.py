"""``StreamedFile``: the bytes a plain buffered write would leave, cast as they are staged, whole
staging buffers written with O_DIRECT behind the caller and the tail without it; a failed write
surfaces, and an aborted file is gone."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from offload.buffers import DIRECT_ALIGN
from offload.chunks import O_DIRECT, FileOps
from offload.streamed_file import StreamedFile

STAGE = 2 * DIRECT_ALIGN
"""Small stages, so that a few kilobytes cross several of them."""


class RecordingOps(FileOps):
    """Records each pwrite's offset, length and whether O_DIRECT was on; each takes a while, so
    that a stage refilled before its write ended would show in the file; can refuse O_DIRECT at
    open, or fail the write at a given offset."""

    def __init__(self, refuse_direct: bool = False, fail_at: int | None = None) -> None:
        self.refuse_direct, self.fail_at = refuse_direct, fail_at
        self.direct = False
        self.writes: list[tuple[int, int, bool]] = []
        self.synced = 0

    def open(self, path: str, flags: int) -> int:
        if self.refuse_direct and flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        self.direct = bool(flags & O_DIRECT)
        return super().open(path, flags)

    def pwrite(self, fd: int, buf, offset: int) -> int:
        if offset == self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.writes.append((offset, len(buf), self.direct))
        time.sleep(0.005)
        return super().pwrite(fd, buf, offset)

    def clear_direct(self, fd: int) -> None:
        super().clear_direct(fd)
        self.direct = False

    def fsync(self, fd: int) -> None:
        self.synced += 1
        super().fsync(fd)


def expected_bytes(parts: list[tuple[torch.Tensor, torch.dtype]]) -> bytes:
    return b"".join(
        values.reshape(-1).to(dtype).contiguous().view(torch.uint8).numpy().tobytes() for values, dtype in parts
    )


@pytest.mark.parametrize("refuse_direct", [False, True], ids=["direct", "O_DIRECT refused"])
def test_the_file_holds_the_cast_values_in_order_across_stages(refuse_direct: bool, tmp_path) -> None:
    torch.manual_seed(0)
    header = b"x" * 13  # odd: the values after it cannot be viewed in place
    parts = [
        (torch.randn(3000), torch.bfloat16),  # cast as staged, crossing a stage
        (torch.randn(7, 300), torch.float32),
        (torch.arange(999, dtype=torch.int64), torch.int64),
        (torch.empty(0), torch.bfloat16),
        (torch.randn(5000).half(), torch.float32),  # widened as staged
    ]
    ops = RecordingOps(refuse_direct)
    with StreamedFile(tmp_path / "f", ops, stage_bytes=STAGE) as out:
        out.write_bytes(header)
        for values, dtype in parts:
            out.write(values, dtype)
        out.close()
    data = header + expected_bytes(parts)
    assert out.written == len(data)
    assert (tmp_path / "f").read_bytes() == data
    assert ops.synced == 1
    whole = len(data) // STAGE * STAGE
    stages = [w for w in ops.writes if w[0] < whole]
    assert stages == [(offset, STAGE, not refuse_direct and bool(O_DIRECT)) for offset in range(0, whole, STAGE)]
    tail = [w for w in ops.writes if w[0] >= whole]
    assert sum(length for _, length, _ in tail) == len(data) - whole
    assert not any(direct for offset, length, direct in tail if length % DIRECT_ALIGN), "a short block without O_DIRECT"


def test_a_failed_write_surfaces_and_abort_removes_the_file(tmp_path) -> None:
    ops = RecordingOps(fail_at=STAGE)
    path = tmp_path / "f"
    with pytest.raises(OSError, match="No space left"), StreamedFile(path, ops, stage_bytes=STAGE) as out:
        for _ in range(8):
            out.write(torch.zeros(STAGE // 4))  # one stage each: the second one's write fails
        out.close()
    assert not path.exists()


def test_stages_must_be_whole_blocks(tmp_path) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        StreamedFile(tmp_path / "f", stage_bytes=DIRECT_ALIGN + 8)
    assert not os.path.exists(tmp_path / "f")
