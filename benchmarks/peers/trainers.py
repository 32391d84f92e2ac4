"""Each contestant's training step, set up inside one rank: plain DDP, FSDP2, DeepSpeed, ours.

A trainer is a context manager that takes the workload's model builder, joins the
process group, builds the model (whole, or already partitioned where the system can and
the workload asks for it), wraps it its own way and yields `step(x, y) -> loss`: one
forward, backward and AdamW update in bf16 compute. The loop that feeds and times
the steps is the same for all (`benchmarks.peers.rank`), so only the system differs.

Each system is imported only by its own trainer, so a rank loads no other system: its
modules would count in the rank's memory (and DeepSpeed is an optional extra).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.peers.workload import Contestant, System, Workload

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Build = Callable[[], nn.Module]
"""Builds the workload's freshly initialised model (on the current default device)."""


class EngineLike(Protocol):
    """The training API that DeepSpeed's engine and ours share."""

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def backward(self, loss: torch.Tensor) -> object: ...
    def step(self) -> object: ...


Trainer = Callable[[Build, Workload, Contestant, Path], contextlib.AbstractContextManager[Step]]

DS_MIN_PARAM_BUFFERS = 64
DS_MIN_PARAM_BUFFER_NUMEL = 4_000_000
"""DeepSpeed 0.19.8's NVMe parameter offload holds each parameter it brings in from disk
in a swap buffer of its own, and fails when they run out or one is too small: FACTS.md
found these two values to work for the default model. Grown to one buffer per
parameter and to the largest parameter's partition, they fit any model that fits in memory
twice over; a partitioned workload's model does not, so there each parameter is released
after its module's use (`stage3_max_reuse_distance` 0) and the minimum count of buffers,
each the largest parameter's partition, suffices."""

DS_PARTITIONED_SUB_GROUP_NUMEL = 100_000_000
"""Elements of the optimizer state DeepSpeed swaps in and updates at once (its
`sub_group_size`): 100M is 1.6 GB of fp32 master, gradient and moments."""


@contextlib.contextmanager
def _gloo_group() -> Iterator[None]:
    """The env:// group the launcher describes, destroyed on the way out even after a failure."""
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _require_tiers(contestant: Contestant, tier: str, why: str) -> None:
    """Refuse a placement the system cannot run, before any process group is joined."""
    if (contestant.optimizer, contestant.param) != (tier, tier):
        raise ValueError(f"{contestant.label}: {why}")


def _torch_step(model: nn.Module, optimizer: torch.optim.Optimizer, autocast: bool) -> Step:
    """One step of a module trained by a torch optimizer (DDP, FSDP2)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _engine_step(engine: EngineLike) -> Step:
    """One step of a model wrapped by a training engine (DeepSpeed's, ours)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


@contextlib.contextmanager
def plain(build: Build, workload: Workload, contestant: Contestant, nvme_path: Path) -> Iterator[Step]:
    """The compute floor: replicated fp32 weights, bf16 autocast, DDP's all-reduce, fused AdamW.

    Nothing is sharded or offloaded; any system's step beyond this one is the price of
    its memory savings.
    """
    _require_tiers(contestant, "device", "plain PyTorch neither shards nor offloads")
    model = build()
    with _gloo_group():
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), fused=True, **workload.adamw_kwargs())
        yield _torch_step(ddp, optimizer, autocast=True)


@contextlib.contextmanager
def fsdp2(build: Build, workload: Workload, contestant: Contestant, nvme_path: Path) -> Iterator[Step]:
    """PyTorch FSDP2: each block and the root `fully_shard`ed, parameters gathered in bf16,
    gradients reduced in fp32 (as our engine does), everything offloaded to the CPU.

    Unpinned: pinning raises without an accelerator. On a CPU-only machine the "device"
    and the host are the same memory, so the offload mostly measures FSDP2's overhead.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    _require_tiers(contestant, "cpu", "FSDP2 offloads parameters and optimizer state together, to cpu only")
    model = build()
    with _gloo_group():
        policy = {
            "mesh": init_device_mesh("cpu", (workload.world_size,)),
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "offload_policy": CPUOffloadPolicy(pin_memory=False),
        }
        for block in model.blocks:
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True, **workload.adamw_kwargs())
        yield _torch_step(model, optimizer, autocast=False)


def _deepspeed_offload(contestant: Contestant, model: nn.Module, workload: Workload, nvme_path: Path) -> dict[str, Any]:
    """The `zero_optimization` section for the contestant's tiers (`model` may be on `meta`:
    only its parameters' sizes are read).

    The NVMe settings are the ones FACTS.md found necessary on 0.19.8: enough parameter
    swap buffers, no parameters kept in host memory (`max_in_cpu` 0), and no prefetch
    bucket (a non-zero one fails with "already assigned swap buffer"). At a partitioned
    workload's size its defaults would hold gigabytes that do not need to exist: the
    optimizer's swapped sub-groups are made smaller than its 1e9 elements (16 GB of fp32
    state at once) and the gradient reduction bucket no larger than the largest parameter
    (its 5e8 elements are 1 GB of bf16). What is left is DeepSpeed's own: the fp32 gradient
    partition of every parameter, 4 B/param, stays in host memory until the step.
    """
    section: dict[str, Any] = {"stage": 3}
    if contestant.optimizer != "device":
        section["offload_optimizer"] = {"device": contestant.optimizer, "pin_memory": False}
    if contestant.param != "device":
        section["offload_param"] = {"device": contestant.param, "pin_memory": False}
    if contestant.optimizer == "nvme":
        section["offload_optimizer"] |= {"nvme_path": str(nvme_path)}
        if workload.partitioned:
            section["sub_group_size"] = DS_PARTITIONED_SUB_GROUP_NUMEL
    if contestant.param == "nvme":
        params = list(model.parameters())
        largest_partition = math.ceil(max(p.numel() for p in params) / workload.world_size)
        section["offload_param"] |= {
            "nvme_path": str(nvme_path),
            "buffer_count": DS_MIN_PARAM_BUFFERS if workload.partitioned else max(DS_MIN_PARAM_BUFFERS, len(params)),
            "buffer_size": max(DS_MIN_PARAM_BUFFER_NUMEL, largest_partition),
            "max_in_cpu": 0,
        }
        section["stage3_prefetch_bucket_size"] = 0
        if workload.partitioned:
            section["stage3_max_reuse_distance"] = 0
            section["reduce_bucket_size"] = section["offload_param"]["buffer_size"]
    return section


def _build_partitioned(build: Build, config: dict[str, Any], contestant: Contestant, workload: Workload) -> nn.Module:
    """The model built under `zero.Init`, each parameter partitioned (to nvme, when the
    parameters go there) as it is created, so the whole model never exists in memory.

    DeepSpeed partitions each module's parameters as its constructor returns, before the
    GPT's own initialisation runs over them all, so that initialisation is applied here
    afterwards, one gathered parameter at a time: the same weights as a model built whole.
    """
    import deepspeed

    from engine.run.models.gpt import init_parameters_

    remote = None if contestant.param == "device" else contestant.param
    with deepspeed.zero.Init(remote_device=remote, config_dict_or_path=config):
        model = build()
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            init_parameters_({name: param}, model.config, workload.seed)
    return model


@contextlib.contextmanager
def deepspeed_zero3(build: Build, workload: Workload, contestant: Contestant, nvme_path: Path) -> Iterator[Step]:
    """DeepSpeed ZeRO-3 in bf16 with fp32 gradient reduction and its own AdamW (the CPU Adam
    op when the optimizer is offloaded).

    The model is built whole before `deepspeed.initialize` partitions it, not under
    `zero.Init`, so it starts from the same weights as every other contestant; a
    `partitioned` workload's model is built under `zero.Init` and given the same weights.
    """
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    with torch.device("meta"):
        sizes = build()  # the parameters' shapes, for the swap buffers, without their memory
    config = {
        "train_micro_batch_size_per_gpu": workload.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": workload.adamw_kwargs()},
        "zero_optimization": _deepspeed_offload(contestant, sizes, workload, nvme_path),
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
        "gradient_clipping": workload.grad_clip,
        "steps_per_print": 2**31 - 1,
    }
    model = _build_partitioned(build, config, contestant, workload) if workload.partitioned else build()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    try:
        yield _engine_step(engine)
    finally:
        engine.destroy()
        dist.destroy_process_group()


@contextlib.contextmanager
def ours(build: Build, workload: Workload, contestant: Contestant, nvme_path: Path) -> Iterator[Step]:
    """Our engine at stage 3 with the contestant's tiers, the workload's AdamW and clipping."""
    from engine.config import Config
    from engine.engine import Engine

    config = Config.from_dict(
        {
            "zero": {"stage": 3},
            "offload": {"optimizer": contestant.optimizer, "param": contestant.param, "nvme_path": str(nvme_path)},
            "precision": {"compute_dtype": "bf16"},
            "optim": {
                **workload.adamw_kwargs(),
                "no_decay": [],  # every parameter decays, as the workload's AdamW decays them in the others
                "grad_clip": workload.grad_clip,
                "warmup_steps": 0,
                "schedule": "constant",
            },
        }
    )
    engine = Engine(build(), config, total_steps=workload.warmup + workload.steps)
    try:
        yield _engine_step(engine)
    finally:
        engine.close()


TRAINERS: dict[System, Trainer] = {"plain": plain, "fsdp2": fsdp2, "deepspeed": deepspeed_zero3, "ours": ours}


def build_deepspeed_ops(contestant: Contestant) -> None:
    """Compile (once, into torch's extension cache) the DeepSpeed ops this contestant loads.

    Run in a process of its own before the ranks start, so that minutes of compiling,
    and the compiler's memory, stay out of the contestant's set-up time and peak RSS.
    DeepSpeed's process group on the CPU loads its shared-memory collectives wherever
    they can run; offloading the optimizer needs its CPU Adam, NVMe its async I/O.
    """
    from deepspeed.accelerator import get_accelerator

    names = ["ShareMemCommBuilder"]
    if contestant.optimizer != "device":
        names.append("CPUAdamBuilder")
    if contestant.uses_nvme:
        names.append("AsyncIOBuilder")
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load()


PREPARE: dict[System, Callable[[Contestant], None]] = {"deepspeed": build_deepspeed_ops}
"""Work a system needs done once, outside its timed and measured run."""

REQUIRES: dict[System, str] = {"deepspeed": "deepspeed"}
"""The module a system needs beyond the default install (the `peers` extra)."""

ENVIRONMENT: dict[System, dict[str, str]] = {"deepspeed": {"DS_ACCELERATOR": "cpu"}}
"""Environment a system's ranks need: DeepSpeed must not look for an accelerator, since
every contestant computes on the CPU."""
