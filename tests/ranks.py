"""Run a function on several ranks, each a separate process, as torchrun would: gloo ranks on
the CPU build, NCCL ranks on one CUDA device each (``LOCAL_RANK`` picks it; the engine chooses
the backend by its device). With ``nodes`` the ranks are told they run on that many hosts, as
``torchrun --nnodes`` tells them (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue, nodes: int) -> None:
    per_node = world_size // nodes
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
        WORLD_SIZE=str(world_size),
    )
    import torch

    torch.set_num_threads(1)
    try:
        # Pickled by value: torch would otherwise share tensors through this process's memory.
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0, nodes: int = 1) -> list[Any]:
    """``fn(*args)`` on ``world_size`` processes joined in one process group, spread evenly over
    ``nodes`` simulated hosts; results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, queue, nodes)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
