"""Measure, in a fresh process, how much host memory the engine adds while it trains.

``python -m tests.engine.rss_probe N_LAYER TIER BUDGET_MB STORE`` prints one JSON line.
The peak is the kernel's high-water mark (VmHWM), reset just before the engine starts. The
heap is tuned as the console command tunes it (``engine.runtime.heap``): otherwise glibc keeps
freed temporaries of the host worker's thread in that thread's heap, and the peak measures
glibc's retention as much as the engine's staging (20-30 MiB of it here). The I/O settings are
given, so that no disk probe (a 256 MiB buffer) runs inside the measurement however the
session's cache stands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import torch

from engine.config import Config, spills_gradients
from engine.engine import Engine
from engine.run.models.gpt import GPT, GPTConfig
from engine.runtime.heap import tune_heap
from engine.runtime.rss import peak_rss_bytes


def main(n_layer: int, tier: str, budget_mb: int, store: str) -> dict:
    torch.set_num_threads(1)
    tune_heap()
    model = GPT(GPTConfig(n_layer=n_layer, d_model=384, n_head=6, seq_len=32))
    config = Config.from_dict(
        {
            "zero": {"stage": 2},
            "offload": {"optimizer": tier, "nvme_path": store, "buffer_mb": budget_mb, "chunk_mb": 4, "io_threads": 4},
            "precision": {"compute_dtype": "bf16"},
        }
    )
    x = torch.randint(0, 256, (1, 32))
    before = psutil.Process().memory_info().rss
    Path("/proc/self/clear_refs").write_text("5")
    eng = Engine(model, config, total_steps=2)
    for _ in range(2):
        eng.backward(eng(x, x))
        eng.step()
    held = eng.memory_report()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "added_peak": peak_rss_bytes() - before,
        "held_device": held["device"],
        "held_cpu": held["cpu"],
        # With clipping every fp32 gradient shard exists at once before the update (which frees
        # each as it goes, so the report after the step no longer shows them), unless they are
        # spilled to the store as each is made (the nvme tier's default): then none is held.
        "held_grads": 0 if spills_gradients(eng.config) else 4 * sum(u.shard_numel for u in eng.layout.units),
        "spills_gradients": spills_gradients(eng.config),
        "pool_peak": getattr(eng.optimizer_state, "pool", None) and eng.optimizer_state.pool.peak_bytes,
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])))
