"""The engine's optimizer step with its state on disk, for ``benchmarks.optimizer``'s nvme tier
section: a store of synthetic units built as the engine builds one, stepped in rounds beside the
raw disk and the compute alone."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.bandwidth import drop_page_cache, page_aligned, raw_disk_gbps
from engine.config import OffloadConfig, OptimConfig
from engine.state.forms import FP32_STATE, StateForm
from engine.state.partition import ModelLayout
from engine.tiers.optimizer_store import StoreOptimizerState
from engine.tiers.sizing import optimizer_buffer_bytes
from engine.tiers.store_io import StoreIO
from engine.zero.compact_update import CompactAdamW
from offload import IORunner, PipelineStats


@dataclass(frozen=True)
class NvmeSetup:
    """Where and how big the nvme tier's run is, and the `[offload]` settings it streams with."""

    directory: Path
    params: int
    buffer_mb: int | str
    chunk_mb: int
    io_threads: int


class NvmeOptimizer:
    """The engine's optimizer step on the nvme tier, over a store of synthetic units.

    Builds the store as the engine does (every unit's initial master, zero
    moments, generation 0 committed), and keeps one gradient per unit in
    memory, where the engine keeps its gradient shards too: ``values``, each
    unit's ``(master, gradient)``.
    """

    def __init__(
        self,
        path: Path,
        layout: ModelLayout,
        nvme: NvmeSetup,
        values: list[tuple[torch.Tensor, torch.Tensor]],
        form: StateForm = FP32_STATE,
    ):
        offload = OffloadConfig()
        self.layout = layout
        self.config = OptimConfig(state_dtype=form.name, master_dtype=form.master)
        self.opt = CompactAdamW(self.config)
        self.io = StoreIO(IORunner(threads=nvme.io_threads), offload.checksum, offload.direct_io, lambda: None)
        buffer_bytes = optimizer_buffer_bytes(nvme, layout.units, form)
        self.state = StoreOptimizerState(path, layout, 0, self.io, buffer_bytes=buffer_bytes, form=form)
        self.grads: dict[str, torch.Tensor] = {}
        for unit, (master, grad) in zip(layout.units, values, strict=True):
            self.state.add(unit, master)
            self.grads[unit.name] = grad
        self.state.commit({"step": 0})
        self.counters = {unit.name: self.opt.new_step_counter(torch.device("cpu")) for unit in layout.units}
        self.steps = 0

    def step(self) -> tuple[float, float]:
        """Read, update and write back every unit, then commit: the step's seconds, and those in `commit`.

        `state.last_stats` then holds the step's pipeline stats.
        """
        start = time.perf_counter()
        for unit, shard in self.state.read(self.layout.units):
            grad, counter = self.grads[unit.name], self.counters[unit.name]
            self.opt.update(shard.master, grad, shard.exp_avg, shard.exp_avg_sq, counter, self.config.lr)
            self.state.write_back(unit, shard)
        finish_start = time.perf_counter()
        self.steps += 1
        self.state.commit({"step": self.steps})
        end = time.perf_counter()
        return end - start, end - finish_start

    def close(self) -> None:
        self.state.close()
        self.io.close()


@dataclass(frozen=True)
class NvmeRound:
    """One round of the nvme tier section: the raw disk, the compute alone and the step, back to back."""

    raw: dict[str, float | bool]
    compute_s: float
    step_s: float
    finish_s: float
    stats: PipelineStats
    cold: bool


def measure_nvme(
    nvme: NvmeSetup,
    layout: ModelLayout,
    raw_bytes: int,
    reps: int,
    compute: Callable[[], None],
    values: list[tuple[torch.Tensor, torch.Tensor]],
    form: StateForm = FP32_STATE,
) -> list[NvmeRound]:
    """`reps` timed rounds after an untimed one (warm-up), in a temporary directory under `nvme.directory`.

    Each round measures the raw disk, the compute-only step (``compute``: the same update on
    the shards held in memory) and, after dropping the page cache, one nvme step over units
    starting from ``values``, so a slow spell of the shared machine hits all three alike.
    """
    raw_buffer = page_aligned(raw_bytes)
    raw_buffer.fill_(0x5A)  # first touch outside the timed region
    rounds: list[NvmeRound] = []
    nvme.directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-optimizer-", dir=nvme.directory) as work:
        optimizer = NvmeOptimizer(Path(work) / "store", layout, nvme, values, form)
        try:
            for round_ in tqdm(range(reps + 1), desc="nvme tier", unit="round"):
                raw = raw_disk_gbps(work, raw_bytes, nvme.io_threads, reps=1, buffer=raw_buffer)
                start = time.perf_counter()
                compute()
                compute_s = time.perf_counter() - start
                cold = drop_page_cache()
                step_s, finish_s = optimizer.step()
                if round_:
                    cold = cold and bool(raw["cold"])
                    rounds.append(NvmeRound(raw, compute_s, step_s, finish_s, optimizer.state.last_stats, cold))
        finally:
            optimizer.close()
    return rounds
