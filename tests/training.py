"""The same few training steps run by the engine and by plain PyTorch, for comparison."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import numpy as np
import torch

from engine.config import Config, OptimConfig
from engine.engine import Engine
from engine.run.data import TokenBatches
from engine.run.models.gpt import GPT, GPTConfig

# A random 1000-token phrase repeated: random enough to exercise every embedding row,
# predictable enough that a few steps visibly lower the loss.
TOKENS = np.tile(np.random.default_rng(123).integers(0, 256, 1000, dtype=np.uint16), 50)
SEQ_LEN = 32
CPU = torch.device("cpu")

Exempt = Callable[[str, torch.nn.Parameter], bool]
"""Whether a parameter (by name) takes no weight decay, in a test's own words."""


def config(**sections: dict) -> Config:
    """A config for tests: fp32, no clipping, optimizer state in memory, unless a section says otherwise."""
    raw = {
        "offload": {"optimizer": "cpu"},
        "precision": {"compute_dtype": "fp32"},
        "optim": {"grad_clip": 0.0, "warmup_steps": 2},
        "train": {"steps": 6},
    }
    for name, values in sections.items():
        raw[name] = raw.get(name, {}) | values
    return Config.from_dict(raw)


def tiny_gpt(seed: int = 0, tie: bool = False) -> GPT:
    """The tiny GPT initialised from ``seed`` (the GPT draws its weights from its own ``seed``,
    not from torch's global generator)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", seq_len=SEQ_LEN, tie_embeddings=tie), seed=seed)


def batches(micro_batch: int, rank: int = 0, world_size: int = 1) -> TokenBatches:
    return TokenBatches(TOKENS, seq_len=SEQ_LEN, micro_batch=micro_batch, rank=rank, world_size=world_size, seed=7)


def train_engine(cfg: Config, steps: int, micro_batch: int = 4, tie: bool = False, seed: int = 0) -> dict:
    """Train with the engine on this process's rank (the model initialised from ``seed``);
    returns losses, parameters after each step and the final ones, and each step's gradient
    norm (None without clipping)."""
    eng = Engine(tiny_gpt(seed, tie=tie), cfg, total_steps=steps)
    data = batches(micro_batch, eng.comm.rank, eng.comm.world_size)
    losses, history, norms = [], [], []
    for _ in range(steps):
        step_loss = 0.0
        for _ in range(cfg.zero.grad_accum_steps):
            loss = eng(*data.next())
            eng.backward(loss)
            eng.step()
            step_loss += loss.item() / cfg.zero.grad_accum_steps
        losses.append(step_loss)
        norms.append(eng.last_grad_norm)
        with eng.gathered():
            history.append(_snapshot(eng.module))
    eng.close()
    return {"losses": losses, "params": history[-1], "history": history, "grad_norms": norms}


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the parameters on the host, so that results cross processes (a rank's are
    pickled back) and runs on different devices compare."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def train_engine_on_ranks(cfg: Config, steps: int, micro_batch: int = 4) -> dict:
    """Entry point for ``tests.ranks.run_ranks`` (module-level so spawn can pickle it)."""
    return train_engine(cfg, steps, micro_batch)


def train_reference(
    cfg: Config,
    steps: int,
    micro_batch: int,
    tie: bool = False,
    concat: int = 1,
    device: torch.device = CPU,
    exempt: Exempt | None = None,
    seed: int = 0,
) -> dict:
    """Plain PyTorch: one process, ``torch.optim.AdamW`` with the engine's hyper-parameters,
    ``reference_schedule``, ``clip_grad_norm_``, autocast for bf16/fp16 and ``GradScaler`` for
    dynamic loss scaling, on ``device`` (the engine computes on the accelerator when there is one).

    With ``concat`` > 1 each batch is that many consecutive micro-batches in one: the data an
    engine accumulating ``concat`` micro-batches per step sees. ``exempt``: the parameters a
    custom ``optim.no_decay`` exempts from weight decay (``decay_groups``)."""
    model = tiny_gpt(seed, tie=tie).to(device)
    o = cfg.optim
    opt = reference_adamw(model, o, exempt)
    schedule = reference_schedule(opt, o, steps)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.compute_dtype)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    scaler = reference_scaler(cfg, device)
    data = batches(micro_batch)
    accum = cfg.zero.grad_accum_steps
    losses, history, norms = [], [], []
    for _ in range(steps):
        step_loss = 0.0
        for _ in range(accum):
            x, y = (torch.cat(parts).to(device) for parts in zip(*(data.next() for _ in range(concat)), strict=True))
            with autocast:
                loss = model(x, y)
            scaler.scale(loss / accum if accum > 1 else loss).backward()
            step_loss += loss.item() / accum
        scaler.unscale_(opt)
        clipped = o.grad_clip > 0
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)) if clipped else None)
        scaler.step(opt)  # skipped where a gradient overflowed
        scaler.update()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
        history.append(_snapshot(model))
    return {"losses": losses, "params": history[-1], "history": history, "grad_norms": norms}


def reference_scaler(cfg: Config, device: torch.device) -> torch.amp.GradScaler:
    """``torch.amp.GradScaler`` as the engine's ``precision`` section configures dynamic loss
    scaling; a disabled one (every call passes through) without it."""
    p = cfg.precision
    assert p.loss_scaling in ("dynamic", "none"), f"no reference for loss_scaling = {p.loss_scaling!r}"
    return torch.amp.GradScaler(
        device.type,
        init_scale=p.initial_scale,
        growth_factor=p.growth_factor,
        backoff_factor=p.backoff_factor,
        growth_interval=p.growth_interval,
        enabled=p.loss_scaling == "dynamic",
    )


def schedule_factor(step: int, optim: OptimConfig, total_steps: int) -> float:
    """The learning-rate multiplier at optimizer step ``step`` (0-based) as ``optim.schedule``
    documents it, written here apart from the engine's ``lr_factor`` so that a reference built
    on it does not follow the engine's mistakes (``tests.engine.test_schedule`` holds it to
    torch's own ``LinearLR``, ``CosineAnnealingLR`` and ``SequentialLR``): ``(step + 1) / W``
    over ``W`` warmup steps, then from 1 down to ``min_lr_ratio`` over ``decay_steps`` (0: the
    steps left of ``total_steps``) along a half cosine or a line, held there after; or 1."""
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    if optim.schedule == "constant":
        return 1.0
    length = optim.decay_steps if optim.decay_steps > 0 else max(1, total_steps - warmup)
    done = min(1.0, (step - warmup) / length)
    if optim.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - done)
    assert optim.schedule == "cosine", optim.schedule
    return floor + (1.0 - floor) * (1.0 + math.cos(math.pi * done)) / 2


def reference_schedule(
    opt: torch.optim.Optimizer, optim: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` along ``schedule_factor``: a reference optimizer's learning rate, the same
    bits as the engine's ``lr * lr_factor`` when both are right."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: schedule_factor(step, optim, total_steps))


def decay_groups(model: torch.nn.Module, optim: OptimConfig, exempt: Exempt | None = None) -> list[dict]:
    """``torch.optim.AdamW``'s parameter groups for the engine's ``optim.no_decay``, by rules
    written here apart from the engine's own (``engine.zero.decay``), so that a test comparing
    the two checks which parameters decay: with the default list, 1-D parameters (biases, norm
    gains) and embedding weights (a tied head being one) take no decay; with ``[]`` every
    trainable parameter does; another list needs the test's own ``exempt``."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not optim.no_decay:
        return [{"params": [p for _, p in trainable], "weight_decay": optim.weight_decay}]
    if exempt is None:
        assert optim.no_decay == ["bias", "norm", "embedding"], f"no hand-written rule for {optim.no_decay}"
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        skip = [p.ndim < 2 or id(p) in embeddings for _, p in trainable]
    else:
        skip = [exempt(n, p) for n, p in trainable]
    groups = [
        {"params": [p for (_, p), s in zip(trainable, skip, strict=True) if not s], "weight_decay": optim.weight_decay},
        {"params": [p for (_, p), s in zip(trainable, skip, strict=True) if s], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def reference_adamw(model: torch.nn.Module, optim: OptimConfig, exempt: Exempt | None = None) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over the model's trainable parameters as the engine's ``optim``
    configures it: its hyper-parameters, its kernel (``fused`` or the default foreach), and
    the two groups of ``decay_groups``."""
    kernel = {"fused": True} if optim.kernel == "fused" else {}
    groups = decay_groups(model, optim, exempt)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, **kernel)


def change_error(got: dict, expected: dict, initial: dict) -> float:
    """``||got - expected|| / ||expected - initial||`` over all parameters as one vector: the
    engine's distance from a reference relative to how far the reference moved them."""
    diff = sum(((got[k] - expected[k]).double() ** 2).sum() for k in expected) ** 0.5
    moved = sum(((expected[k] - initial[k]).double() ** 2).sum() for k in expected) ** 0.5
    return float(diff / moved)


def initial_params(seed: int = 0, tie: bool = False) -> dict[str, torch.Tensor]:
    """The tiny GPT's parameters before any step."""
    return _snapshot(tiny_gpt(seed, tie=tie))


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all parameters as one vector.

    Per tensor would be the wrong yardstick: some gradients are analytically zero (the key
    bias of attention: softmax ignores a constant shift), so they are pure rounding noise,
    and Adam's ``m / sqrt(v)`` turns any change in summation order into a full-size step.
    """
    assert a.keys() == b.keys()
    diff = sum(((a[k] - b[k]).double() ** 2).sum() for k in b) ** 0.5
    return (diff / sum((b[k].double() ** 2).sum() for k in b) ** 0.5).item()
