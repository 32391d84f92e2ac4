"""Typed run configuration, mirrored one-to-one by a TOML, JSON or YAML file: the whole run's
``Config`` (its sections are ``engine.config_sections``'), what a configuration implies that
several parts of the engine must agree on (``shares_master``, ``overlaps_backward``,
``spills_gradients``), and its checks.

Every field is validated before any work starts (no process group, no model,
no disk touched), so a typo in a 3-hour run's config costs a second, not the run:
ranges and combinations, each refused with a ``ConfigError`` that names the key, its value
and the fix. A file holds sections named like the dataclasses of ``engine.config_sections``
(``[zero]``, ``[offload]``, ...); command-line overrides use ``section.key=value`` or just
``key=value`` when the key name is unique across sections (``engine.config_parse``).

This module and the two beside it import nothing else of the engine: every part of it reads
its configuration, so the configuration stands below them all.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config_parse import ConfigError, build_section, parse_override, read_file
from engine.config_sections import (
    NODE,
    SOURCE_FOLDER,
    SOURCE_RECORD,
    CheckpointConfig,
    DataConfig,
    DType,
    LoraConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    PrecisionConfig,
    StoreConfig,
    Tier,
    TrainConfig,
    ZeroConfig,
)

__all__ = [
    "NODE",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DType",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "PrecisionConfig",
    "StoreConfig",
    "Tier",
    "TrainConfig",
    "ZeroConfig",
    "overlaps_backward",
    "shares_master",
    "spills_gradients",
    "validate",
]


@dataclass
class Config:
    """A whole run; each attribute is one section of the config file."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | None = None) -> Config:
        """Read a ``.toml``, ``.json``, ``.yaml`` or ``.yml`` file, apply ``key=value`` overrides, validate."""
        return cls.from_dict(read_file(Path(path)), overrides)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: list[str] | None = None) -> Config:
        """Build from nested dicts (as a TOML/JSON file gives them), apply overrides, validate."""
        raw = {section: dict(values) for section, values in raw.items() if isinstance(values, dict)} | {
            k: v for k, v in raw.items() if not isinstance(v, dict)
        }
        for item in overrides or []:
            section, key, value = parse_override(item, cls)
            raw.setdefault(section, {})[key] = value
        config = build_section(cls, raw, "")
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Ranges and combinations; raises ConfigError naming the key and the fix."""
        validate(self)


def shares_master(config: Config) -> bool:
    """Whether the parameter tier reads each trained unit's shard from its bf16 master rather
    than keeping a copy of its own: at stage 3, parameters on nvme (a copy on disk, rewritten
    each step, is what the sharing saves; one in memory is cheap to keep). In another compute
    dtype the master is cast on its way to the device, in the copy a gather makes anyway."""
    return config.optim.master_dtype == "bf16" and config.zero.stage == 3 and config.offload.param == "nvme"


def overlaps_backward(config: Config) -> bool:
    """Whether each unit is updated as its gradient is reduced on the step's last micro-batch:
    asked for, and nothing (clipping, loss scaling) needs every gradient first. Stage 1 reduces
    at the step, so it has nothing to overlap."""
    return (
        config.optim.overlap
        and config.optim.grad_clip == 0
        and config.zero.stage >= 2
        and config.precision.loss_scaling == "none"
    )


def spills_gradients(config: Config) -> bool:
    """Whether each unit's final gradient shard goes to the store's scratch folder during
    backward and comes back with its optimizer state at the step (``offload.grad_spill``): on
    ``auto``, whenever the optimizer is on nvme and the update waits for every gradient at stage
    2 or 3 (the config refuses ``true`` elsewhere)."""
    if config.offload.grad_spill != "auto":
        return bool(config.offload.grad_spill)
    return config.offload.optimizer == "nvme" and config.zero.stage >= 2 and not overlaps_backward(config)


def validate(config: Config) -> None:
    """Ranges and combinations; raises ConfigError naming the key and the fix."""
    _check_finite(config)
    z, o, p = config.zero, config.offload, config.precision
    _check(z.stage in (1, 2, 3), "zero.stage", z.stage, "must be 1, 2 or 3")
    _check(z.grad_accum_steps >= 1, "zero.grad_accum_steps", z.grad_accum_steps, "must be >= 1")
    _check(
        z.stage == 3 or o.param == "device",
        "offload.param",
        o.param,
        'offloading parameters needs zero.stage = 3 (set zero.stage = 3, or offload.param = "device")',
    )
    _check(
        z.prefetch_mb == "auto" or z.prefetch_mb >= 0,
        "zero.prefetch_mb",
        z.prefetch_mb,
        'must be >= 0 (0: no prefetch), or "auto"',
    )
    _check(z.persistence_threshold >= 0, "zero.persistence_threshold", z.persistence_threshold, "must be >= 0")
    _check(
        z.device_memory_limit_mb >= 0,
        "zero.device_memory_limit_mb",
        z.device_memory_limit_mb,
        "must be >= 0 (0: no limit)",
    )
    chunk_mb = 1 if o.chunk_mb == "auto" else o.chunk_mb  # auto stays within buffer_mb / 3
    _check(chunk_mb >= 1, "offload.chunk_mb", o.chunk_mb, 'must be >= 1 (or "auto")')
    if o.buffer_mb != "auto":
        _check(o.buffer_mb >= 1, "offload.buffer_mb", o.buffer_mb, 'must be >= 1 (or "auto")')
        _check(
            o.buffer_mb >= 3 * chunk_mb,
            "offload.buffer_mb",
            o.buffer_mb,
            f"must hold at least one unit's master and moments of one chunk each (3 x offload.chunk_mb = "
            f'{3 * chunk_mb}), or be "auto"',
        )
    _check(o.pinned_mb == "auto" or o.pinned_mb > 0, "offload.pinned_mb", o.pinned_mb, 'must be > 0 (or "auto")')
    _check(
        o.io_threads == "auto" or 1 <= o.io_threads <= 64,
        "offload.io_threads",
        o.io_threads,
        'must be in [1, 64] (or "auto")',
    )
    _check_spill(config)
    _check(
        p.compute_dtype != "fp16" or p.loss_scaling != "none",
        "precision.loss_scaling",
        p.loss_scaling,
        "fp16 needs loss scaling to keep small gradients from flushing to zero: set "
        'precision.loss_scaling = "dynamic" (or use compute_dtype = "bf16")',
    )
    _check(p.initial_scale > 0, "precision.initial_scale", p.initial_scale, "must be > 0")
    _check(p.growth_interval >= 1, "precision.growth_interval", p.growth_interval, "must be >= 1")
    _check(p.growth_factor > 1, "precision.growth_factor", p.growth_factor, "must be > 1")
    _check(0 < p.backoff_factor < 1, "precision.backoff_factor", p.backoff_factor, "must be in (0, 1)")
    _check_optim(config)
    _check_run(config)


def _check_optim(config: Config) -> None:
    """AdamW's hyper-parameters, the parameters it exempts from decay, and the schedule."""
    opt = config.optim
    _check(opt.lr > 0, "optim.lr", opt.lr, "must be > 0")
    _check(all(0 <= b < 1 for b in opt.betas), "optim.betas", opt.betas, "each must be in [0, 1)")
    _check(opt.eps > 0, "optim.eps", opt.eps, "must be > 0")
    _check(opt.weight_decay >= 0, "optim.weight_decay", opt.weight_decay, "must be >= 0")
    _check(
        all(entry.strip() for entry in opt.no_decay),
        "optim.no_decay",
        opt.no_decay,
        'holds an empty entry, which names no parameter: remove it (keywords "bias", "norm", "embedding", '
        "or fnmatch patterns over parameter names; [] decays every parameter)",
    )
    _check(opt.grad_clip >= 0, "optim.grad_clip", opt.grad_clip, "must be >= 0 (0 disables clipping)")
    _check(
        not opt.defer_update or (config.zero.stage == 3 and not overlaps_backward(config)),
        "optim.defer_update",
        opt.defer_update,
        "updates each unit in the next forward, which needs zero.stage = 3 and an update that waits for every "
        "gradient (optim.grad_clip > 0, or loss scaling); set those, or defer_update = false",
    )
    _check(opt.warmup_steps >= 0, "optim.warmup_steps", opt.warmup_steps, "must be >= 0")
    _check(opt.decay_steps >= 0, "optim.decay_steps", opt.decay_steps, "must be >= 0")
    _check(0 <= opt.min_lr_ratio <= 1, "optim.min_lr_ratio", opt.min_lr_ratio, "must be in [0, 1]")


def _check_spill(config: Config) -> None:
    """``offload.grad_spill = true`` only where there is a store to spill to and a shard
    that waits for the step, ``grad_spill_dtype = "bf16"`` only where gradients spill;
    ``offload.host_worker = true`` only where AdamW runs on the host."""
    _check(
        config.offload.host_worker is not True or config.offload.optimizer != "device",
        "offload.host_worker",
        config.offload.host_worker,
        'runs AdamW on the host, but offload.optimizer = "device" updates on the device: set '
        'offload.optimizer = "cpu" or "nvme", or host_worker = "auto"',
    )

    _check(
        config.offload.grad_spill_dtype == "fp32" or spills_gradients(config),
        "offload.grad_spill_dtype",
        config.offload.grad_spill_dtype,
        'has no spilled gradient to store: gradients spill only with offload.optimizer = "nvme", '
        'zero.stage >= 2 and clipping or loss scaling (offload.grad_spill); set grad_spill_dtype = "fp32"',
    )
    spill = config.offload.grad_spill
    if spill is not True:
        return
    key = "offload.grad_spill"
    _check(
        config.offload.optimizer == "nvme",
        key,
        spill,
        f'spills gradients to the nvme store, but offload.optimizer = "{config.offload.optimizer}": set '
        f'offload.optimizer = "nvme", or grad_spill = "auto"',
    )
    _check(
        config.zero.stage >= 2,
        key,
        spill,
        "needs zero.stage >= 2 (stage 1 reduces every gradient at the step, so none is final before it); "
        'set zero.stage = 2, or grad_spill = "auto"',
    )
    _check(
        not overlaps_backward(config),
        key,
        spill,
        "has nothing to spill: without clipping or loss scaling each unit is updated as its gradient is "
        'reduced (optim.overlap); set grad_spill = "auto"',
    )


def _check_run(config: Config) -> None:
    """The model, data, loop and checkpoint sections, and where the store is."""
    _check_model(config)
    _check(config.data.seq_len >= 1, "data.seq_len", config.data.seq_len, "must be >= 1")
    _check(config.data.micro_batch >= 1, "data.micro_batch", config.data.micro_batch, "must be >= 1")
    _check(config.data.vocab_size >= 257, "data.vocab_size", config.data.vocab_size, "must be > 256 for a BPE")
    _check(config.train.steps >= 1, "train.steps", config.train.steps, "must be >= 1")
    _check(config.train.log_every >= 1, "train.log_every", config.train.log_every, "must be >= 1")
    _check(config.train.epochs >= 0, "train.epochs", config.train.epochs, "must be >= 0 (0: train for train.steps)")
    _check(0 <= config.data.val_fraction < 1, "data.val_fraction", config.data.val_fraction, "must be in [0, 1)")
    _check(config.train.eval_every >= 0, "train.eval_every", config.train.eval_every, "must be >= 0")
    _check(config.train.eval_batches >= 1, "train.eval_batches", config.train.eval_batches, "must be >= 1")
    _check(
        config.train.eval_every == 0 or config.data.val_fraction > 0,
        "train.eval_every",
        config.train.eval_every,
        "needs held-out tokens: set data.val_fraction (for example 0.05)",
    )
    _check(
        not config.train.tensorboard or importlib.util.find_spec("tensorboard") is not None,
        "train.tensorboard",
        config.train.tensorboard,
        "needs the tensorboard package: pip install tensorboard (or leave train.tensorboard empty)",
    )
    _check_nvme_paths(config)
    ckpt = config.checkpoint
    _check(ckpt.interval >= 0, "checkpoint.interval", ckpt.interval, "must be >= 0 (0: no periodic checkpoints)")
    _check(ckpt.keep >= 0, "checkpoint.keep", ckpt.keep, "must be >= 0 (0 keeps every checkpoint)")


def _check_nvme_paths(config: Config) -> None:
    paths = config.offload.nvme_paths
    for path in paths:
        _check(path != "", "offload.nvme_path", config.offload.nvme_path, "names an empty folder: give every folder")
        _check(
            not set("{}") & set(path.replace(NODE, "")),
            "offload.nvme_path",
            config.offload.nvme_path,
            f"the only placeholder it may hold is {NODE} (the host's index, for a store on each host)",
        )
    _check(
        len({NODE in p for p in paths}) == 1,
        "offload.nvme_path",
        config.offload.nvme_path,
        f"holds {NODE} in some folders only: put it in every one (each host stripes its store across its own drives)",
    )
    _check(
        len(set(paths)) == len(paths),
        "offload.nvme_path",
        config.offload.nvme_path,
        "names a folder twice: give each drive's folder once",
    )


def _check_model(config: Config) -> None:
    _check(config.model.params >= 0, "model.params", config.model.params, "must be >= 0")
    hf = config.model.hf
    recorded = Path(config.offload.store_path) / SOURCE_FOLDER / SOURCE_RECORD  # a run that resumes reads it
    _check(
        not hf or (Path(hf) / "config.json").is_file() or recorded.is_file(),
        "model.hf",
        hf,
        "is not a folder holding config.json: give the folder save_pretrained wrote (weights, config, tokenizer)",
    )
    lora = config.lora
    _check(lora.r >= 0, "lora.r", lora.r, "must be >= 0 (0: no LoRA)")
    if lora.r:
        _check(hf != "", "lora.r", lora.r, "LoRA fine-tunes a pretrained model: set model.hf = FOLDER (or lora.r = 0)")
        _check(
            importlib.util.find_spec("peft") is not None,
            "lora.r",
            lora.r,
            "needs the peft library: pip install peft (or lora.r = 0)",
        )
    _check(lora.alpha > 0, "lora.alpha", lora.alpha, "must be > 0")
    _check(0 <= lora.dropout < 1, "lora.dropout", lora.dropout, "must be in [0, 1)")


def _check_finite(config: Config) -> None:
    """Refuse inf and nan in every float (TOML, JSON and overrides all spell them): no setting
    means either, and the range checks alone would let inf through (``inf > 0``)."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for key in dataclasses.fields(values):
            value = getattr(values, key.name)
            items = value if isinstance(value, (tuple, list)) else (value,)
            finite = all(math.isfinite(x) for x in items if isinstance(x, float))
            _check(finite, f"{section.name}.{key.name}", value, "must be finite (a number, not inf or nan)")


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {why}")
