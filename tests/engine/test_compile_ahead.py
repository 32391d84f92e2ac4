"""The compact update's kernels made ahead of a process's first step serve every shard of the
steps: none compiles on the step's path. In a fresh process, since dynamo's caches are per
process and other tests compile the same kernels."""

from __future__ import annotations

import pytest

from tests.engine.test_estimate import probe

MASKED_SHARDS = """
import sys
import torch
from torch._dynamo.utils import counters
from engine.config import OptimConfig
from engine.state.quantize import BLOCK, packed_bytes
from engine.zero.compact_update import compile_ahead, compact_step
from engine.zero.decay import ShardDecay

moment = {"bf16": torch.bfloat16, "int8": torch.uint8}[sys.argv[1]]
config = OptimConfig()
compile_ahead(config, (torch.bfloat16, moment, torch.bfloat16), torch.device("cpu"), True).join()
ahead = counters["stats"]["unique_graphs"]
for blocks in (16, 8):  # the mask's buffer grows for the first, then serves the shorter one
    numel = blocks * BLOCK
    master = torch.zeros(numel, dtype=torch.bfloat16)
    moments = tuple(torch.zeros(packed_bytes(numel) if moment == torch.uint8 else numel, dtype=moment) for _ in range(2))
    decay = ShardDecay(((0, BLOCK, True), (BLOCK, numel, False)))
    compact_step(config, master, torch.ones(numel, dtype=torch.bfloat16), moments, 1, 1e-3, (0, 1, 2), decay=decay)
print(ahead, counters["stats"]["unique_graphs"] - ahead)
"""


def compiled(moments: str, tmp_path) -> tuple[int, int]:
    """The graphs compiled ahead, and then by masked shards of two lengths, in a fresh process."""
    ahead, later = map(int, probe(["-c", MASKED_SHARDS, moments], tmp_path, tmp_path).split())
    return ahead, later


@pytest.mark.slow  # compiles in a fresh process: about 8 s
def test_a_masked_shard_shorter_than_one_before_it_compiles_nothing_more(tmp_path) -> None:
    ahead, later = compiled("bf16", tmp_path)
    assert ahead == 2, "compile_ahead builds the kernel with and without a decay mask"
    assert later == 0, f"{later} kernel(s) compiled on the step's path"


def test_int8_moments_on_the_host_compile_nothing(tmp_path) -> None:
    """The host kernel (``engine.zero.host_update``) serves them: compile_ahead builds it, and
    dynamo traces nothing, ahead or on the step's path."""
    assert compiled("int8", tmp_path) == (0, 0)
