"""Memory per tier for a run of the built-in GPT, a ``model.hf`` folder's model (its
``config.json`` alone) or any ``nn.Module``, and the plan that fits this machine.

Choosing a ZeRO stage and offload tiers by trial costs a run killed by the kernel after
minutes of model building; this estimate costs a second. For every stage and tier plan it
predicts, per rank, the bytes on the device and in host memory, the size of the store on
disk, and the peak resident set (RSS) of the rank's process; ``recommend`` then picks the
least offload that fits this machine with headroom.

The prediction follows the engine's life cycle, one phase at a time, and takes the largest:

- construction: ``python -m engine train`` builds the model on the ``meta`` device, and
  ``Engine`` materialises, initialises and flattens it unit by unit, the fp32 values freed as
  each unit's compute-dtype flat, its optimizer shard and (stage 3) its parameter shard are made;
- training: what stays resident (parameters, optimizer state, staging pools), plus what a
  step holds at the start of backward (activations, units gathered ahead), at its end
  (every gradient shard, buckets in flight) or at the optimizer step.

Each term is a small named function of the layout and the config (``terms``), sized by the
engine's own functions wherever the engine sizes that part itself (``engine.tiers.sizing``,
``engine.zero.grads``, ``offload.shards``), so a change in how the engine holds memory is made
once and the estimate follows it. The layout is the engine's own
(``engine.state.partition``), computed from the model built on the ``meta`` device, so padding and
unit sizes are exact. One term is measured rather than derived: the baseline of a Python
process that has loaded torch and the engine (measured once, in a subprocess). The memory the
heap keeps after the engine frees it is the bound ``engine.runtime.heap_bound`` holds it to.

The parts: ``shape`` (the run and the plans), ``terms`` (bytes per part of the engine),
``memory`` (phases, the peak, ``estimate``), ``machine`` (this machine and the choice of
plan), ``report`` (the table and the JSON).
"""

from engine.runtime.sizes import FP32, GIB
from engine.tools.estimate.machine import (
    HEADROOM,
    Machine,
    by_preference,
    existing_ancestor,
    measured_baseline_bytes,
    recommend,
    stage_preference,
    why_none_fits,
)
from engine.tools.estimate.memory import Footprint, PlanEstimate, estimate, estimate_plans, refusal
from engine.tools.estimate.report import format_table, report_json
from engine.tools.estimate.shape import (
    TIER_ORDER,
    ModelShape,
    Plan,
    RunShape,
    all_plans,
    gpt_of,
    gpt_shape,
    module_shape,
    plan_of,
    run_shape,
    vocab_size,
)
from engine.tools.estimate.terms import (
    ADAM_KINDS,
    activation_bytes,
    construction_staging_bytes,
    construction_transient_bytes,
    grad_bucket_bytes,
    grad_shard_bytes,
    heap_retention_bytes,
    optimizer_staging_bytes,
    optimizer_state_bytes,
    param_grad_bytes,
    param_shard_bytes,
    param_staging_bytes,
    prefetch_window_bytes,
    replicated_param_bytes,
    running_units_bytes,
    scratch_bytes,
    spill_staging_bytes,
    step_io_bytes,
    store_bytes,
)

__all__ = [
    "ADAM_KINDS",
    "FP32",
    "GIB",
    "HEADROOM",
    "TIER_ORDER",
    "Footprint",
    "Machine",
    "ModelShape",
    "Plan",
    "PlanEstimate",
    "RunShape",
    "activation_bytes",
    "all_plans",
    "by_preference",
    "construction_staging_bytes",
    "construction_transient_bytes",
    "estimate",
    "estimate_plans",
    "existing_ancestor",
    "format_table",
    "gpt_of",
    "gpt_shape",
    "grad_bucket_bytes",
    "grad_shard_bytes",
    "heap_retention_bytes",
    "measured_baseline_bytes",
    "module_shape",
    "optimizer_staging_bytes",
    "optimizer_state_bytes",
    "param_grad_bytes",
    "param_shard_bytes",
    "param_staging_bytes",
    "plan_of",
    "prefetch_window_bytes",
    "recommend",
    "refusal",
    "replicated_param_bytes",
    "report_json",
    "run_shape",
    "running_units_bytes",
    "scratch_bytes",
    "spill_staging_bytes",
    "stage_preference",
    "step_io_bytes",
    "store_bytes",
    "vocab_size",
    "why_none_fits",
]
