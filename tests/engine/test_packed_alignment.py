"""Packed int8 moments are read and written with O_DIRECT: their chunks are whole O_DIRECT blocks
only where a chunk holds a multiple of ``DIRECT_BLOCKS_ELEMS`` values, so a layout for that
state rounds its large chunks to it (``StateForm.chunk_align``); any other multiple of
``ALIGN_ELEMS`` would send every byte of the moments through the page cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.state.forms import FP32_STATE, PackedUnit, StateForm
from engine.state.partition import ALIGN_ELEMS, COARSE_PADDING, build_layout
from engine.state.quantize import DIRECT_BLOCKS_ELEMS, packed_bytes
from engine.tiers.optimizer_store import StoreOptimizerState
from engine.tiers.store_io import StoreIO
from offload import DIRECT_ALIGN, IORunner
from offload.chunks import O_DIRECT, FileOps

INT8 = StateForm("int8", "bf16")
MAX_CHUNK = 1 << 22  # 16 MiB of fp32, as offload.chunk_mb = 16 allows
GPT_BLOCK = 12 * 1024 * 1024 + 13 * 1024  # a transformer block of d_model 1024: no power of two


def unit_of(numel: int, form: StateForm, world_size: int = 1):
    params = {"block": [("w", nn.Parameter(torch.empty(numel, device="meta")))]}
    return build_layout(params, world_size, MAX_CHUNK, align=form.chunk_align).units[0]


def test_the_packed_alignment_is_the_least_whole_number_of_direct_blocks() -> None:
    assert PackedUnit(unit_of(DIRECT_BLOCKS_ELEMS, INT8)).chunk_numel % DIRECT_ALIGN == 0
    smaller = DIRECT_BLOCKS_ELEMS // 2
    assert (smaller // 256 * 260) % DIRECT_ALIGN != 0


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("per_rank", [GPT_BLOCK, 3 * GPT_BLOCK + 5, COARSE_PADDING * DIRECT_BLOCKS_ELEMS + 1])
def test_large_int8_chunks_are_whole_direct_blocks_padded_under_an_eighth(per_rank: int, world_size: int) -> None:
    numel = per_rank * world_size - (world_size - 1)
    unit = unit_of(numel, INT8, world_size)
    packed = PackedUnit(unit)
    assert unit.chunk_numel % DIRECT_BLOCKS_ELEMS == 0 and packed.chunk_numel % DIRECT_ALIGN == 0
    assert packed.shard_numel % DIRECT_ALIGN == 0, "each rank's moments start on a block"
    chunks = unit.shard_numel // unit.chunk_numel
    per_rank = -(-numel // world_size)
    assert chunks == -(-per_rank // MAX_CHUNK), "no more chunks than the maximum asks"
    assert unit.shard_numel - per_rank < chunks * DIRECT_BLOCKS_ELEMS
    assert unit.shard_numel - per_rank < per_rank / COARSE_PADDING


def test_small_chunks_and_other_forms_keep_the_fine_alignment() -> None:
    small = unit_of(COARSE_PADDING * DIRECT_BLOCKS_ELEMS - 5000, INT8)
    assert small.chunk_numel % DIRECT_BLOCKS_ELEMS != 0 and small.chunk_numel % ALIGN_ELEMS == 0
    for form in (FP32_STATE, StateForm("bf16", "bf16")):
        unit = unit_of(GPT_BLOCK, form)
        assert unit.shard_numel - GPT_BLOCK < unit.shard_numel // unit.chunk_numel * ALIGN_ELEMS


class DirectOrNot(FileOps):
    """Records the path of each chunk file read or written, and whether it was opened with O_DIRECT
    (opens to fsync a file move no bytes, and are left out)."""

    def __init__(self) -> None:
        self.opened: dict[int, tuple[str, bool]] = {}
        self.moved: list[tuple[str, str, bool]] = []

    def open(self, path: str, flags: int) -> int:
        fd = super().open(path, flags)
        self.opened[fd] = (path, bool(flags & O_DIRECT))
        return fd

    def pwrite(self, fd, buf, offset):
        if offset == 0:  # not the CRC trailer, written after the body without O_DIRECT
            self.moved.append(("write", *self.opened[fd]))
        return super().pwrite(fd, buf, offset)

    def preadv(self, fd, buf, offset):
        self.moved.append(("read", *self.opened[fd]))
        return super().preadv(fd, buf, offset)


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_the_nvme_tier_reads_and_writes_int8_moments_with_o_direct(tmp_path) -> None:
    numel = COARSE_PADDING * DIRECT_BLOCKS_ELEMS + 1000
    layout = build_layout(
        {"block": [("w", nn.Parameter(torch.empty(numel, device="meta")))]}, 1, MAX_CHUNK, align=INT8.chunk_align
    )
    unit = layout.units[0]
    io = StoreIO(IORunner(threads=2), checksum=True, direct_io=True, barrier=lambda: None)
    tier = StoreOptimizerState(tmp_path / "s", layout, 0, io, buffer_bytes=4 * INT8.unit_bytes(unit), form=INT8)
    try:
        tier.add(unit, torch.zeros(unit.shard_numel))
        tier.commit({"step": 0})
        ops = tier.store._ops = DirectOrNot()
        for arrived, state in tier.read(layout.units):
            state.exp_avg.fill_(1)
            tier.write_back(arrived, state)
        tier.commit({"step": 1})
    finally:
        tier.close()
        io.close()
    moments = [(how, path, direct) for how, path, direct in ops.moved if "exp_avg" in path]
    assert {how for how, *_ in moments} == {"read", "write"}, "the step read and wrote its moments"
    buffered = [(how, path) for how, path, direct in moments if not direct]
    assert not buffered, f"moments through the page cache: {buffered}"


def test_a_store_cut_into_the_finer_chunks_resumes_with_its_state(tmp_path) -> None:
    """A store written before int8 state took the coarse alignment is read as this layout cuts
    it, then written in its own chunks, its state unchanged."""
    numel = COARSE_PADDING * DIRECT_BLOCKS_ELEMS + 1000
    params = {"block": [("w", nn.Parameter(torch.empty(numel, device="meta")))]}
    fine, coarse = build_layout(params, 1, MAX_CHUNK), build_layout(params, 1, MAX_CHUNK, align=INT8.chunk_align)
    assert fine.units[0].chunk_numel != coarse.units[0].chunk_numel
    master = torch.zeros(fine.units[0].shard_numel)
    master[:numel] = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    moment = torch.randint(1, 255, (packed_bytes(numel - numel % 256),), dtype=torch.uint8)
    io = StoreIO(IORunner(threads=2), checksum=True, direct_io=True, barrier=lambda: None)
    try:
        expected = []
        for layout, resume in ((fine, False), (coarse, True), (coarse, True)):
            unit = layout.units[0]
            tier = StoreOptimizerState(
                tmp_path / "s", layout, 0, io, buffer_bytes=4 * INT8.unit_bytes(unit), resume=resume, form=INT8
            )
            if not resume:
                tier.add(unit, master)
                tier.commit({"step": 0})
            for _, state in tier.read(layout.units):
                held = (state.master[:numel].clone(), state.exp_avg[: moment.numel()].clone())
                if not resume:
                    state.exp_avg[: moment.numel()] = moment
                    held = (held[0], moment)
                expected.append(held)
                tier.write_back(unit, state)
            tier.commit({"step": 1})
            tier.close()
    finally:
        io.close()
    first, *resumed = expected
    for held in resumed:
        assert torch.equal(held[0], first[0]) and torch.equal(held[1], first[1])
