"""This machine, and the plan that fits it: the baseline memory of a torch process, the RAM,
disk and device memory a plan must fit in, and the choice of the least offload that does."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from engine.config import Config
from engine.runtime.sizes import GIB, MIB
from engine.tools.estimate.memory import PlanEstimate
from engine.tools.estimate.shape import TIER_ORDER, Plan

HEADROOM = 0.2
"""Fraction of RAM, device memory and free disk a recommended plan leaves unused: the
estimate's own error (tested within 15%), the page cache the nvme tier streams through, and
whatever else the machine runs."""

_BASELINE_PROBE = """
import sys, psutil, torch
import engine.run.train
from engine.run.models.gpt import GPT, GPTConfig
if sys.argv[1:]:  # a model.hf run also loads transformers, the model's code and its tokenizer
    from transformers import AutoTokenizer
    from engine.run.pretrained import meta_model
    meta_model(sys.argv[1])
    try:
        AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
    except (OSError, ValueError, TypeError):
        pass
def step(device, dtype):
    model = GPT(GPTConfig.preset("tiny")).to(device=device, dtype=dtype)
    x = torch.randint(0, 256, (1, 16), device=device)
    model(x, x).backward()
step("cpu", torch.float32)
if torch.accelerator.is_available():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        step(torch.accelerator.current_accelerator(), dtype)
    torch.accelerator.synchronize()
print(psutil.Process().memory_info().rss)
"""


@functools.cache
def measured_baseline_bytes(model_hf: str = "") -> int:
    """Resident bytes of a fresh process that has imported torch and the engine and run one tiny
    forward and backward (kernels, thread pools, allocator arenas): what a rank holds before
    any model; with ``model_hf`` (a Hugging Face folder), also transformers, the model's code
    and its tokenizer. Where an accelerator exists the engine computes there, so the probe also
    steps on it in each compute dtype: its context, its libraries and the kernels they load
    live in host memory (0.80 GiB more on an H200, torch 2.11 and CUDA 13). Measured in a
    subprocess, since this process may hold anything; once per process."""
    done = subprocess.run(
        [sys.executable, "-c", _BASELINE_PROBE, *([model_hf] if model_hf else [])],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring the baseline memory of a torch process failed:\n{done.stderr[-2000:]}")
    return int(done.stdout.split()[-1])


@dataclass(frozen=True)
class Machine:
    """What a plan must fit in on this node."""

    ram_bytes: int
    """Host memory available now (``psutil.virtual_memory().available``)."""
    disk_free_bytes: int
    """Free disk where the store would go (``striped_free`` of its folders)."""
    device_bytes: int | None
    """Memory of each rank's device, or the engine's ``zero.device_memory_limit_mb``; None: no
    limit of its own (a CPU build without one, where the device is host memory)."""
    device_is_host: bool

    @classmethod
    def detect(cls, config: Config) -> Machine:
        """This node, for ``config``'s store path and device limit."""
        limit = int(config.zero.device_memory_limit_mb * MIB) or None
        on_accelerator = torch.accelerator.is_available()
        if on_accelerator and limit is None:
            accelerator = torch.accelerator.current_accelerator()
            index = torch.accelerator.current_device_index()
            limit = torch.get_device_module(accelerator).get_device_properties(index).total_memory
        return cls(
            ram_bytes=psutil.virtual_memory().available,
            disk_free_bytes=striped_free([existing_ancestor(Path(p)) for p in config.offload.nvme_paths]),
            device_bytes=limit,
            device_is_host=not on_accelerator,
        )

    def shortfalls(self, est: PlanEstimate, headroom: float = HEADROOM) -> list[str]:
        """What ``est`` lacks to leave ``headroom`` of every resource unused, each with a fix."""
        usable = 1.0 - headroom
        short = [f"the engine refuses it: {est.refused}"] if est.refused else []
        if est.node_rss_bytes > usable * self.ram_bytes:
            short.append(
                f"host memory: {est.world_size} rank(s) x {gib(est.peak_rss_bytes)} GiB peak RSS over "
                f"{gib(usable * self.ram_bytes)} GiB usable (lower data.micro_batch, set "
                f"zero.activation_checkpointing = true, or free memory)"
            )
        if est.disk_bytes > usable * self.disk_free_bytes:
            short.append(
                f"disk: the store needs {gib(est.disk_bytes)} GiB, {gib(usable * self.disk_free_bytes)} GiB usable "
                f'(set store.mode = "in-place" for one generation, keep fewer checkpoint.keep, or move '
                f"offload.nvme_path to a larger disk)"
            )
        # The engine's budget leaves activations out; a real device's memory holds them too.
        device = est.device_bytes + (0 if self.device_is_host else est.activation_bytes)
        if self.device_bytes is not None and device > usable * self.device_bytes:
            short.append(
                f"device: {gib(device)} GiB per rank, {gib(usable * self.device_bytes)} GiB usable (raise "
                f"zero.device_memory_limit_mb, use more ranks, or lower data.micro_batch)"
            )
        return short

    def fits(self, est: PlanEstimate, headroom: float = HEADROOM) -> bool:
        """Whether ``est`` leaves ``headroom`` of every resource unused, on all ranks."""
        return not self.shortfalls(est, headroom)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def striped_free(folders: Sequence[Path]) -> int:
    """The largest store striped evenly across ``folders`` their disks hold: each disk takes its
    folders' shares, so the one with least room per share bounds it (folders on one disk share
    its room: striping across them adds none)."""
    shares = collections.Counter(os.stat(f).st_dev for f in folders)
    room = {os.stat(f).st_dev: shutil.disk_usage(f).free for f in folders}
    return min(room[disk] * len(folders) // count for disk, count in shares.items())


def existing_ancestor(path: Path) -> Path:
    """``path`` or the nearest of its parents that exists (where a new store's bytes would go)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def stage_preference(config: Config, world_size: int) -> tuple[int, ...]:
    """Stages to try for one pair of tiers, cheapest first. Stage 2 reduces each micro-batch's
    gradients as stage 1 reduces the step's, in less memory; stage 1 saves reductions only when
    several micro-batches accumulate over several ranks; stage 3 adds a gather per unit per
    forward and backward."""
    if config.zero.grad_accum_steps > 1 and world_size > 1:
        return (1, 2, 3)
    return (2, 3)


def recommend(
    estimates: Sequence[PlanEstimate], machine: Machine, config: Config, headroom: float = HEADROOM
) -> PlanEstimate | None:
    """The least offload that fits: the first plan in ``TIER_ORDER``, by ``stage_preference``,
    whose estimate ``machine`` holds with ``headroom``; None if none does."""
    for est in by_preference(estimates, config):
        if machine.fits(est, headroom):
            return est
    return None


def by_preference(estimates: Sequence[PlanEstimate], config: Config) -> list[PlanEstimate]:
    """The estimates of the plans ``recommend`` considers, least offload first."""
    by_plan = {e.plan: e for e in estimates}
    world = estimates[0].world_size if estimates else 1
    order = [
        Plan(stage, optimizer, param) for optimizer, param in TIER_ORDER for stage in stage_preference(config, world)
    ]
    return [by_plan[plan] for plan in order if plan in by_plan]


def why_none_fits(estimates: Sequence[PlanEstimate], machine: Machine, config: Config) -> str:
    """Why ``recommend`` found nothing: what the most offloaded plan still lacks."""
    last = by_preference(estimates, config)[-1]
    return f"no plan fits with {HEADROOM:.0%} headroom; even {last.plan} lacks " + "; ".join(machine.shortfalls(last))


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"
