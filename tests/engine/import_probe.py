"""Import, in a fresh process, a pretrained checkpoint into a stage-3 store with everything on
nvme, and print what the import added to the process's resident set, and what of it the
optimizer and parameter tiers' pools staged, as one JSON line.

``python -m tests.engine.import_probe FOLDER STORE BUFFER_MB [--keep-nothing-freed]``. The
high-water mark (VmHWM) is reset once the model is built on the meta device, so the peak is the
import's alone.

The heap runs as ``python -m engine train`` runs it: it keeps up to ``heap_bound.KEEP_MIN`` of
what is freed (32 MiB at this size), handed back whenever the resident set outgrows it or every
``REFRESH_S``; how much of it is resident at the peak is a matter of timing (here 8-20 MiB across
runs). ``--keep-nothing-freed`` hands every freed page back as soon as the resident set grows,
so the peak is what the import holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import torch

from engine.config import Config
from engine.engine import Engine
from engine.run.pretrained import pretrained_model
from engine.runtime import heap_bound
from engine.runtime.heap import tune_heap
from engine.runtime.rss import peak_rss_bytes
from engine.tiers.sizing import optimizer_buffer_bytes, param_pool_bytes, param_window_bytes
from engine.tools.estimate import construction_staging_bytes, estimate, plan_of, run_shape


def keep_nothing_freed() -> None:
    """The heap keeps none of what is freed: the engine's build does not widen the keep for its
    model (``keep_for``), and ``keep_bytes``, which the estimate charges, is left as it is."""
    heap_bound.keep_for = lambda largest_unit_bytes: None
    heap_bound.bound_process_heap().keep = 0


def main(folder: str, store: str, buffer_mb: int, keep_freed: bool = True) -> dict[str, int]:
    tune_heap()  # as python -m engine train does
    if not keep_freed:
        keep_nothing_freed()
    model, init = pretrained_model(folder, seq_len=32)
    settings = {
        "zero": {"stage": 3, "prefetch_mb": 8},
        "offload": {"optimizer": "nvme", "param": "nvme", "nvme_path": store, "buffer_mb": buffer_mb},
        "precision": {"compute_dtype": "fp32"},
    }
    config = Config.from_dict(settings | {"offload": settings["offload"] | {"chunk_mb": 4, "io_threads": 4}})
    run = run_shape(config, 1, model=model)
    predicted = estimate(run, plan_of(config), baseline_bytes=0)
    before = psutil.Process().memory_info().rss
    Path("/proc/self/clear_refs").write_text("5")
    eng = Engine(model, config, init_unit=init)
    layout, offload = eng.layout, eng.config.offload
    param_pool = param_pool_bytes(
        layout.all_units, torch.float32, param_window_bytes(eng.config.zero, layout, torch.float32)
    )
    staged = eng.optimizer_state.pool.allocated_bytes + eng.params.host_bytes()  # the writes behind the build
    eng.close()
    return {
        "added_peak": peak_rss_bytes() - before,
        "staged": staged,
        "staging_bound": construction_staging_bytes(run) + param_pool,
        "largest_unit": layout.largest_unit_numel * 4,
        "buffers": optimizer_buffer_bytes(offload, layout.units) + param_pool,
        "params": layout.numel + layout.frozen_numel,
        "estimated": predicted.phase_rss_bytes["construction"],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--keep-nothing-freed" not in sys.argv)))
