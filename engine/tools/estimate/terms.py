"""The memory model's terms: each a small function of the run giving the bytes one part of
the engine holds, per rank, sized by the engine's own functions wherever the engine sizes
that part itself (its pools, windows, shards, buckets and store), so the estimate follows
the engine when it changes."""

from __future__ import annotations

import torch

from engine.config import overlaps_backward, shares_master, spills_gradients
from engine.run.loss import CHUNK_TOKENS
from engine.run.read_ahead import AHEAD
from engine.runtime.heap_bound import keep_bytes
from engine.runtime.sizes import FP32
from engine.state.forms import STATE_KINDS
from engine.state.partition import FROZEN_SUFFIX, ROOT_UNIT
from engine.tiers.grad_spill import grad_bytes, scratch_disk_bytes
from engine.tiers.sizing import (
    MAX_IN_FLIGHT,
    block_numels,
    checkpoint_bytes,
    gradient_dtype,
    held_grad_shard_bytes,
    module_numels,
    optimizer_buffer_bytes,
    param_pool_bytes,
    param_window_bytes,
    prefetch_bytes,
    read_ahead_bytes,
    spill_buffer_bytes,
    spill_dtype,
)
from engine.tiers.store_checks import store_bytes as optimizer_store_bytes
from engine.tools.estimate.shape import Plan, RunShape
from engine.zero.grads import bucket_bytes
from engine.zero.grads import grad_shard_bytes as unit_grad_shard_bytes
from engine.zero.optim import norm_scratch_numel
from offload import array_bytes, shard_bytes

ADAM_KINDS = len(STATE_KINDS)
"""Tensors per parameter the optimizer tier holds: master, exp_avg, exp_avg_sq."""
CHECKPOINT_ITEMSIZE = 2
"""Bytes per element of an imported checkpoint's tensors: bf16, as the Hub's large models are."""


def construction_transient_bytes(run: RunShape) -> int:
    """The unit being flattened (a frozen one too): its fp32 flat and the compute-dtype copy
    cast from it (the same buffer in fp32). A checkpoint's import (``model.hf``) holds beside
    it the checkpoint tensor taken and those read ahead (``engine.run.read_ahead``), each at most
    a unit; without LoRA its ``init_unit`` copies values (``Pretrained.copies_values``), so
    where the masters share the compute dtype it builds that flat alone
    (``engine.build.build_units``)."""
    unit, imports = run.largest_unit, bool(run.config.model.hf)
    if imports and not run.config.lora.r and run.form.dtypes()[0] == run.dtype:
        flat = run.itemsize * unit
    else:
        flat = FP32 * unit + (run.itemsize * unit if run.itemsize != FP32 else 0)
    return flat + ((1 + AHEAD) * CHECKPOINT_ITEMSIZE * unit if imports else 0)


def replicated_param_bytes(run: RunShape) -> int:
    """Stages 1 and 2: every unit's full compute-dtype flat, frozen ones too, on every rank."""
    return sum(array_bytes(u, run.dtype) for u in run.layout.all_units)


def param_shard_bytes(run: RunShape) -> int:
    """Stage 3 with parameters in memory (``device`` or ``cpu``): the rank's compute-dtype shards
    of every unit, frozen ones too (a frozen base lives on the parameter tier)."""
    return sum(shard_bytes(u, run.dtype) for u in run.layout.all_units)


def running_units_bytes(run: RunShape) -> int:
    """Stage 3: full units on the device however short the prefetch window. The root stays
    gathered from its forward to the end of backward; a block is gathered while it runs, and
    in backward the next is gathered before the last is released; units under
    ``zero.persistence_threshold`` parameters are never released."""
    zero, root = run.config.zero, module_numels(run.layout).get(ROOT_UNIT, 0)
    blocks = block_numels(run.layout)
    persistent = sum(
        u.padded_numel
        for u in run.layout.all_units
        if u.numel < zero.persistence_threshold and u.name.removesuffix(FROZEN_SUFFIX) != ROOT_UNIT
    )
    return run.itemsize * (root + sum(sorted(blocks, reverse=True)[:2]) + persistent)


def prefetch_window_bytes(run: RunShape) -> int:
    """Stage 3: the units gathered ahead of use, within ``zero.prefetch_mb``. The window looks
    ahead in the iteration only, so it is full at the start of backward and empty at its end."""
    return min(prefetch_bytes(run.config.zero, run.layout, run.dtype), run.itemsize * sum(block_numels(run.layout)))


def param_staging_bytes(run: RunShape) -> int:
    """Stage 3, ``offload.param = "nvme"``: the host pool shards are read into, the rank's share
    of the prefetch window plus two of the largest shards (one fetch not foreseen, one write)."""
    window = param_window_bytes(run.config.zero, run.layout, run.dtype)
    return param_pool_bytes(run.layout.all_units, run.dtype, window)


def optimizer_state_bytes(run: RunShape) -> int:
    """``device`` and ``cpu`` optimizer tiers: master (in ``optim.master_dtype``), exp_avg and
    exp_avg_sq (in ``optim.state_dtype``) of the rank's shards; on the ``nvme`` tier, what a
    step reads and writes."""
    return sum(run.form.unit_bytes(u) for u in run.layout.units)


def optimizer_staging_bytes(run: RunShape) -> int:
    """``nvme`` optimizer tier: its buffer pool, which grows up to ``offload.buffer_mb`` (or
    to all of the rank's state, if that is smaller) and keeps what it allocated."""
    return min(optimizer_buffer_bytes(run.config.offload, run.layout.units, run.form), optimizer_state_bytes(run))


def construction_staging_bytes(run: RunShape) -> int:
    """``nvme`` optimizer tier while the engine is built: each unit's initial master waits in
    the pool while it is written behind the next unit's build (its zero moments are written
    from never-written memory, not staged). Pending writes hold at most the pool's write
    window (one always may be pending) and one more master is being filled, so a slow disk
    fills the window however many units the model has."""
    budget = optimizer_buffer_bytes(run.config.offload, run.layout.units, run.form)
    masters = [shard_bytes(u, run.form.dtypes()[0]) for u in run.layout.units]
    largest = max(masters)
    return min(budget, max(read_ahead_bytes(budget), largest) + largest, sum(masters))


def grad_dtype(run: RunShape) -> torch.dtype:
    """The dtype the run's gradient buckets and shards are in (``gradient_dtype``)."""
    return gradient_dtype(run.config, run.layout.world_size)


def grad_shard_bytes(run: RunShape) -> int:
    """The rank's gradient shards at their peak, each made when its unit's gradient is first
    reduced and freed once the optimizer has used it, or once it is spilled to disk. With
    clipping, loss scaling or accumulation every one waits for the step in memory, unless it
    waits on disk (``offload.grad_spill``, which holds a window: ``held_grad_shard_bytes``);
    when one micro-batch's update overlaps backward (``engine.zero.update``) each leaves memory
    as it is reduced, so only those in flight are held."""
    dtype = grad_dtype(run)
    shards = [unit_grad_shard_bytes(u, dtype) for u in run.layout.units]
    if overlaps_backward(run.config) and run.config.zero.grad_accum_steps == 1:
        return MAX_IN_FLIGHT * max(shards)
    return held_grad_shard_bytes(run.config, shards)


def norm_scratch_bytes(run: RunShape) -> int:
    """The fp32 buffer kept by the thread that takes the gradient norm, to widen bf16 pieces in
    (``engine.zero.optim.piece_norms``): one rank whose gradients stay bf16 and whose norm is
    taken parameter by parameter once backward is over (not unit by unit inside it, as
    ``optim.overlap`` does); 0 otherwise."""
    if grad_dtype(run) == torch.float32 or overlaps_backward(run.config):
        return 0
    return FP32 * norm_scratch_numel(slot.numel for unit in run.layout.units for slot in unit.params)


def spill_staging_bytes(run: RunShape) -> int:
    """Spilled gradients (``engine.tiers.grad_spill``): the spill's buffer pool, which keeps what it
    allocated: the shards its pipeline's window holds (writes behind backward, reads ahead of the
    update; one always may be, however large) and the one being filled or used, and never more
    than every shard, in ``offload.grad_spill_dtype``; 0 when the gradients are not spilled."""
    if not spills_gradients(run.config):
        return 0
    units, dtype = run.layout.units, spill_dtype(run.config.offload)
    shards = [grad_bytes(u, dtype) for u in units]
    window = spill_buffer_bytes(run.config.offload, units, dtype) // 2  # the pipeline's, as ``GradSpill`` opens it
    return min(max(window, max(shards)) + max(shards), sum(shards))


def scratch_bytes(run: RunShape, plan: Plan) -> int:
    """Disk of the gradients ``plan`` spills, all ranks, in the store's scratch folder during the
    run: 4 or 2 bytes a parameter (``offload.grad_spill_dtype``)."""
    return scratch_disk_bytes(plan.laid_over(run.config), run.layout.units)


def step_io_bytes(run: RunShape, plan: Plan) -> int:
    """Bytes one rank reads plus writes per step under ``plan``: the ``nvme`` optimizer tier's
    state read and written back, the gradient shards spilled and read back, and the ``nvme``
    parameter tier's shards (``param_io_bytes``)."""
    state = optimizer_state_bytes(run) if plan.tiers.optimizer_in_store else 0
    return 2 * (state + scratch_bytes(run, plan) // run.layout.world_size) + param_io_bytes(run, plan)


def param_io_bytes(run: RunShape, plan: Plan) -> int:
    """Stage 3, ``offload.param = "nvme"``: each unit's shard read for its forward's and its
    backward's gather in every micro-batch (at most: a unit still gathered is not read again),
    and the trained units' copy written each step, unless their bf16 masters are the copy
    (``shares_master``: the optimizer tier writes those anyway, and the gathers read them as
    they are, whatever the compute dtype)."""
    if not plan.tiers.params_in_store:
        return 0
    shared = shares_master(plan.laid_over(run.config))
    trained = sum(shard_bytes(u, torch.bfloat16 if shared else run.dtype) for u in run.layout.units)
    frozen = sum(shard_bytes(u, run.dtype) for u in run.layout.frozen)
    reads = 2 * run.config.zero.grad_accum_steps * (trained + frozen)
    return reads + (0 if shared else trained)


def grad_bucket_bytes(run: RunShape) -> int:
    """Gradient buckets on the device: stage 1 keeps every unit's through the accumulation
    window; stages 2 and 3 one being filled while ``MAX_IN_FLIGHT - 1`` are being reduced."""
    dtype = grad_dtype(run)
    buckets = [bucket_bytes(u, dtype) for u in run.layout.units]
    if run.config.zero.stage == 1:
        return sum(buckets)
    return MAX_IN_FLIGHT * max(buckets)


def param_grad_bytes(run: RunShape) -> int:
    """Autograd's compute-dtype gradient of the largest parameter, before the engine's hook
    copies it into its bucket and drops it."""
    return run.itemsize * run.largest_param


def activation_bytes(run: RunShape) -> int:
    """Peak activation memory of one micro-batch of the built-in GPT (of another transformer,
    by the same count with its own widths: an approximation).

    Per token, a block saves for backward 8 x d_model + 2 x ffn compute-dtype values, 16 x
    d_model in the GPT (LayerNorm inputs and outputs, qkv, the attention output, the MLP's 4d
    input and GELU output, the residual)
    plus fp32 LayerNorm statistics and the attention's log-sum-exp per head; SDPA's fused CPU
    and CUDA kernels never hold the seq x seq scores. The root saves the final LayerNorm's
    input and output; the loss keeps no logits (``engine.run.loss``): at the start of backward
    it recomputes one chunk of them at a time (in the compute dtype, widened to fp32), and sums
    the head's gradient in fp32 where the compute dtype is narrower. Later, inside a block's
    backward, about 10 x d_model of gradients a token. With activation checkpointing a block
    saves only its input and recomputes its 16 x d_model in its backward.
    """
    shape, data = run.model, run.config.data
    tokens, e, d = data.micro_batch * data.seq_len, run.itemsize, shape.d_model
    block_saved = (8 * d + 2 * shape.ffn) * e + 4 * FP32 + shape.n_head * FP32
    root_saved = 2 * d * e
    chunk = min(tokens, CHUNK_TOKENS) * shape.vocab_size * (FP32 + e)
    loss_backward = chunk + (FP32 * shape.vocab_size * d if e < FP32 else 0)
    block_grads = 10 * d * e
    if run.config.zero.activation_checkpointing:
        saved = shape.n_layer * d * e + root_saved
        block_grads += block_saved  # the block recomputed for its backward
    else:
        saved = shape.n_layer * block_saved + root_saved
    return tokens * saved + max(loss_backward, tokens * block_grads)


def heap_retention_bytes(run: RunShape) -> int:
    """What the heap keeps of the buffers a step frees and makes again, besides the live ones:
    ``engine.runtime.heap_bound`` hands the rest back (as ``python -m engine train`` runs)."""
    return keep_bytes(run.largest_unit * run.itemsize)


def store_bytes(run: RunShape, plan: Plan) -> int:
    """Disk under ``offload.nvme_path`` for all ranks: the nvme tier's generations of optimizer
    state (two with ``store.mode = "generations"``, one ``"in-place"``), one copy of the trained
    compute-dtype parameters under ``params`` for the nvme parameter tier (derived data, not
    versioned; none where the bf16 masters are the parameters, ``shares_master``), the checkpoints ``[checkpoint]`` keeps (any tier writes those), the frozen
    units' values, once, when the store keeps a step or the parameters are on disk
    (``engine.tiers.frozen``), and the spilled gradients' scratch stores."""
    config, layout = run.config, run.layout
    live = optimizer_store_bytes(layout, config.store.mode, run.form) if plan.tiers.optimizer_in_store else 0
    on_disk = plan.tiers.params_in_store
    copied = on_disk and not shares_master(plan.laid_over(config))
    params = sum(array_bytes(u, run.dtype) for u in layout.units) if copied else 0
    ckpt = config.checkpoint
    kept = ckpt.keep if ckpt.keep else (config.train.steps // ckpt.interval if ckpt.interval else 0)
    frozen = sum(array_bytes(u, run.dtype) for u in layout.frozen) if live or kept or on_disk else 0
    return live + kept * checkpoint_bytes(layout, run.form) + params + frozen + scratch_bytes(run, plan)
