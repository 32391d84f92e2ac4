"""How units are cut into shards and chunks: aligned for direct I/O, and padded as little as
the alignment allows, since every step reads and writes the padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.zero.partition import ALIGN_ELEMS, build_layout

MAX_CHUNK = 1 << 18


def layout_of(numel: int, world_size: int):
    params = {"unit": [("w", nn.Parameter(torch.empty(numel), requires_grad=False))]}
    return build_layout(params, world_size, MAX_CHUNK).units[0]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("numel", [1, 5000, MAX_CHUNK, MAX_CHUNK + 1, 2 * MAX_CHUNK + 7, 9 * MAX_CHUNK - 3])
def test_shards_are_whole_aligned_chunks_with_under_an_alignment_of_padding_each(numel: int, world_size: int) -> None:
    unit = layout_of(numel, world_size)
    chunks = unit.shard_numel // unit.chunk_numel
    assert unit.shard_numel == chunks * unit.chunk_numel and unit.chunk_numel % ALIGN_ELEMS == 0
    assert unit.chunk_numel <= MAX_CHUNK
    assert unit.padded_numel == world_size * unit.shard_numel >= numel
    per_rank = -(-numel // world_size)
    assert chunks == -(-per_rank // MAX_CHUNK), "the fewest chunks the maximum allows"
    assert unit.shard_numel - per_rank < chunks * ALIGN_ELEMS


def test_a_shard_just_over_the_maximum_is_two_half_chunks_not_twice_its_size() -> None:
    unit = layout_of(MAX_CHUNK + ALIGN_ELEMS, world_size=1)
    assert unit.chunk_numel == MAX_CHUNK // 2 + ALIGN_ELEMS
    assert unit.shard_numel == MAX_CHUNK + 2 * ALIGN_ELEMS
