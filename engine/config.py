"""Typed run configuration, mirrored one-to-one by a TOML or JSON file.

Every field is validated before any work starts (no process group, no model,
no disk touched), so a typo in a 3-hour run's config costs a second, not the run.
A file holds sections named like the dataclasses below (``[zero]``, ``[offload]``,
...); command-line overrides use ``section.key=value`` or just ``key=value`` when
the key name is unique across sections.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.config_parse import ConfigError, build_section, parse_override

Tier = Literal["device", "cpu", "nvme"]
DType = Literal["fp32", "bf16", "fp16"]
NODE = "{node}"
"""The placeholder of ``offload.nvme_path`` for the index of the host a rank runs on."""


@dataclass
class ZeroConfig:
    """How training state is partitioned across ranks."""

    stage: int = 2
    """1: shard masters and optimizer state; 2: also gradients; 3: also the compute-dtype parameters."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; ``Engine.step()`` acts only on the last one."""
    activation_checkpointing: bool = False
    """Recompute each unit's activations in backward instead of keeping them (root excluded)."""
    unit_classes: list[str] = field(default_factory=list)
    """Module class names that form a unit (the grain of sharding and I/O). Empty: every
    entry of every ``nn.ModuleList`` (transformer blocks), plus a root unit for the rest."""
    prefetch_mb: float = 64.0
    """Stage 3: bytes of the units ahead in the traced order gathered while the current one
    computes, in MiB; 0 gathers each unit only when it is needed."""
    persistence_threshold: int = 0
    """Stage 3: units with fewer parameters than this stay gathered for the whole run (their
    gathers would cost more in latency than their bytes save)."""
    device_memory_limit_mb: float = 0.0
    """Device bytes the engine may hold (parameters, shards, gradient buckets, prefetch
    window), in MiB; the prefetch window shrinks to stay under it. 0: no limit."""


@dataclass
class OffloadConfig:
    """Where each kind of state lives, and how bytes move to and from disk."""

    optimizer: Tier = "nvme"
    """Tier of the fp32 masters and AdamW moments: ``device`` (no offload), ``cpu`` or ``nvme``."""
    param: Tier = "device"
    """Tier of the compute-dtype parameter shards (stage 3 only)."""
    nvme_path: str = "offload_store"
    """Folder of the zarr store used by the ``nvme`` tier (created if missing). A ``{node}`` in it
    stands for the index of the host a rank runs on: each host then writes its own store on its
    own disk (``/nvme/run/node-{node}``), and the hosts commit each step together. Without it,
    every rank writes one folder (a single host, or a filesystem every host shares)."""
    buffer_mb: int | Literal["auto"] = "auto"
    """Host staging budget for the ``nvme`` tier in MiB: peak host memory for streamed state.
    ``auto``: twice the largest unit's optimizer state (one unit read while another is written),
    at least 256 MiB (``engine.tiers.sizing.optimizer_buffer_bytes``)."""
    chunk_mb: int | Literal["auto"] = "auto"
    """Largest zarr chunk in MiB of fp32; a shard is cut into the fewest chunks within it, all of
    one 4 KiB-aligned size, so padding (read and written every step) stays under 4 KiB a chunk.
    ``auto``: the fastest on the store's disk, from the machine's I/O profile (measured in a few
    seconds by the first run on a disk, see ``offload.tuning``), at most ``buffer_mb / 3``; a
    resumed store keeps its own chunk size."""
    io_threads: int | Literal["auto"] = "auto"
    """Threads doing positional reads and writes; ``auto``: from the I/O profile, as ``chunk_mb``."""
    checksum: bool = True
    """Store a CRC-32C with every chunk and verify it on every read."""
    direct_io: bool = True
    """Use O_DIRECT where the filesystem allows it (falls back by itself where it does not)."""
    grad_spill: bool | Literal["auto"] = "auto"
    """Spill each unit's final gradient shard to the store's ``scratch`` folder during backward
    and read it back with its optimizer state at the step, when the update must wait for every
    gradient (clipping, loss scaling): host memory then holds no gradient shard of the whole
    model. ``auto``: whenever the optimizer is on ``nvme`` and the update waits (stages 2 and 3;
    stage 1 reduces every gradient at the step)."""
    pinned_mb: float | Literal["auto"] = "auto"
    """Host memory, in MiB, that copies between host and device go through: one bounded pool
    (pinned on an accelerator) of the host tensors a copy reads or fills and the nvme tiers'
    staging. ``auto``: what the plan needs (``python -m engine estimate`` prints it); a number
    below that is refused at start with the size that fits. Nothing is pinned on a CPU-only machine."""
    host_worker: bool | Literal["auto"] = "auto"
    """Run AdamW on the host shards (optimizer on ``cpu`` or ``nvme``) on a host thread of its
    own while the training thread goes on with backward; bit-identical either way. ``auto``: on
    where the device is not the host (an accelerator, or the simulated one); on a CPU-only
    machine the worker takes the cores backward computes on."""

    @property
    def node_local(self) -> bool:
        """Whether each host has its own store (``nvme_path`` holds ``{node}``)."""
        return NODE in self.nvme_path

    def on_node(self, node: int) -> OffloadConfig:
        """This section as host ``node`` sees it: ``{node}`` in ``nvme_path`` replaced by its index."""
        return dataclasses.replace(self, nvme_path=self.nvme_path.replace(NODE, str(node)))


@dataclass
class StoreConfig:
    """How the ``nvme`` store keeps its state between steps."""

    mode: Literal["generations", "in-place"] = "generations"
    """``generations``: each step writes a new generation and commits it atomically, so a crash
    at any instant resumes from the last step (about twice the disk). ``in-place``: one
    generation rewritten each step (half the disk); a crash mid-step leaves it unusable and
    resuming falls back to the last explicit checkpoint."""
    defer_commit: bool = True
    """Let a step's last writes, fsync and commit finish behind the next step's forward, which
    hides them; the commit then comes when the next step's optimizer state is first read (or
    at ``save``/``close``), so a crash in between resumes from the step before. ``false``
    commits every step before ``step()`` returns."""


@dataclass
class PrecisionConfig:
    """Compute dtype and loss scaling."""

    compute_dtype: DType = "bf16"
    """Dtype of the parameters the model computes with; masters are always fp32."""
    loss_scaling: Literal["dynamic", "static", "none"] = "none"
    """``dynamic`` (fp16's usual choice), ``static`` (fixed ``initial_scale``) or ``none``."""
    initial_scale: float = 65536.0
    growth_interval: int = 1000
    """Clean steps before the dynamic scale grows by ``growth_factor``."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    """Multiplier of the dynamic scale after a step with an inf/nan gradient (the step is skipped)."""


@dataclass
class OptimConfig:
    """AdamW on the fp32 master shards, and its learning-rate schedule."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter."""
    kernel: Literal["fused", "foreach"] = "fused"
    """``fused`` is torch's fastest AdamW (bit-identical to ``AdamW(fused=True)``); ``foreach``
    is bit-identical to torch's default AdamW."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping across ranks; 0 disables it."""
    overlap: bool = True
    """Without clipping (``grad_clip = 0``), update each unit as soon as its gradient shard is
    reduced on the last micro-batch, overlapped with the rest of backward; the result is
    bit-identical either way. With clipping every gradient must be reduced first."""
    state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """How AdamW's moments are held and stored: ``fp32`` (bit-exact with torch), ``bf16`` (a
    third fewer optimizer bytes) or ``int8`` (8-bit blocks, half), rounded stochastically
    (``engine.zero.moments``). The master is fp32 in every form. A store resumes only in the form it was written in."""
    warmup_steps: int = 0
    schedule: Literal["cosine", "constant"] = "cosine"
    decay_steps: int = 0
    """Steps of the cosine decay after warmup; 0 means ``train.steps - warmup_steps``."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine, as a fraction of ``lr``."""


@dataclass
class ModelConfig:
    """The model ``python -m engine train`` trains: the built-in GPT, or a pretrained one (``hf``)."""

    preset: str = "small"
    """``tiny``, ``small``, ``medium``, ``large``, ``1b``, ``3b``."""
    params: float = 0.0
    """If > 0, choose depth and width for about this many parameters instead of ``preset``."""
    tie_embeddings: bool = False
    hf: str = ""
    """A Hugging Face checkpoint folder (``config.json``, safetensors weights, tokenizer) to
    fine-tune instead of the built-in GPT: built on the meta device and imported unit by unit,
    the data tokenised with its own tokenizer. Empty: the built-in GPT."""


@dataclass
class LoraConfig:
    """LoRA adapters on a ``model.hf`` run, through the ``peft`` library: the pretrained weights
    frozen, the adapters trained; ``export`` writes the adapter in peft's format."""

    r: int = 0
    """Rank of the adapters; 0: no LoRA (every parameter trains)."""
    alpha: float = 16.0
    """peft's ``lora_alpha``: the adapters' output is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps training deterministic)."""
    target_modules: list[str] = field(default_factory=list)
    """Names of the linear layers that get adapters (e.g. ``["q_proj", "v_proj"]``); empty:
    peft's default for the model's architecture."""


@dataclass
class DataConfig:
    """The training text and how batches are drawn."""

    source: str = "shakespeare"
    """``shakespeare`` (built in), a .txt/.md file or folder, or a uint16 token file ``*.bin``."""
    tokenizer: Literal["bytes", "bpe"] = "bytes"
    vocab_size: int = 8192
    """BPE vocabulary size (``tokenizer = "bpe"`` only)."""
    seq_len: int = 128
    micro_batch: int = 8
    """Sequences per rank per micro-batch."""
    seed: int = 0
    val_fraction: float = 0.0
    """Fraction of the tokens, at the end of the corpus, held out for the validation loss; 0: none."""


@dataclass
class TrainConfig:
    """The training loop of ``python -m engine train``."""

    steps: int = 200
    log_every: int = 10
    seed: int = 0
    """Seed of the model initialisation."""
    metrics: str = ""
    """A JSON-lines file that rank 0 appends one record to per step (loss, learning rate, gradient
    norm, validation loss when taken, seconds, tokens/s, exposed parameter and optimizer waits, bytes read and
    written, prefetch hit rate, device high-water, peak RSS); empty: none."""
    tensorboard: str = ""
    """A folder that rank 0 writes the same scalars to as TensorBoard events (needs the
    ``tensorboard`` package); empty: none."""
    eval_every: int = 0
    """Steps between validation losses (``data.val_fraction > 0``); 0: after the last step only."""
    eval_batches: int = 8
    """Micro-batches per rank in one validation loss."""


@dataclass
class CheckpointConfig:
    """Steps kept as ``checkpoints/<tag>`` in the store at ``offload.nvme_path`` (``Engine.save``),
    to resume from later: on the ``nvme`` tier by a rename when the next step supersedes the step,
    on the memory tiers by writing their state there."""

    interval: int = 0
    """Steps between the checkpoints ``python -m engine train`` keeps, tagged ``step-<n>``; 0: none."""
    keep: int = 0
    """Checkpoints retained: once one more is kept, the oldest beyond this many are deleted; 0 keeps all."""


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
        """Read a ``.toml`` or ``.json`` file, apply ``key=value`` overrides, validate."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        text = path.read_text()
        try:
            raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {err}") from err
        return cls.from_dict(raw, overrides)

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
        self._check_finite()
        z, o, p, opt = self.zero, self.offload, self.precision, self.optim
        _check(z.stage in (1, 2, 3), "zero.stage", z.stage, "must be 1, 2 or 3")
        _check(z.grad_accum_steps >= 1, "zero.grad_accum_steps", z.grad_accum_steps, "must be >= 1")
        _check(
            z.stage == 3 or o.param == "device",
            "offload.param",
            o.param,
            'offloading parameters needs zero.stage = 3 (set zero.stage = 3, or offload.param = "device")',
        )
        _check(z.prefetch_mb >= 0, "zero.prefetch_mb", z.prefetch_mb, "must be >= 0 (0: no prefetch)")
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
        self._check_spill()
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
        _check(opt.lr > 0, "optim.lr", opt.lr, "must be > 0")
        _check(all(0 <= b < 1 for b in opt.betas), "optim.betas", opt.betas, "each must be in [0, 1)")
        _check(opt.eps > 0, "optim.eps", opt.eps, "must be > 0")
        _check(opt.weight_decay >= 0, "optim.weight_decay", opt.weight_decay, "must be >= 0")
        _check(opt.grad_clip >= 0, "optim.grad_clip", opt.grad_clip, "must be >= 0 (0 disables clipping)")
        _check(opt.warmup_steps >= 0, "optim.warmup_steps", opt.warmup_steps, "must be >= 0")
        _check(opt.decay_steps >= 0, "optim.decay_steps", opt.decay_steps, "must be >= 0")
        _check(0 <= opt.min_lr_ratio <= 1, "optim.min_lr_ratio", opt.min_lr_ratio, "must be in [0, 1]")
        self._check_run()

    def _check_spill(self) -> None:
        """``offload.grad_spill = true`` only where there is a store to spill to and a shard
        that waits for the step; ``offload.host_worker = true`` only where AdamW runs on the host."""
        from engine.zero.update import overlaps_backward  # the update's own rule, which imports this module

        _check(
            self.offload.host_worker is not True or self.offload.optimizer != "device",
            "offload.host_worker",
            self.offload.host_worker,
            'runs AdamW on the host, but offload.optimizer = "device" updates on the device: set '
            'offload.optimizer = "cpu" or "nvme", or host_worker = "auto"',
        )

        spill = self.offload.grad_spill
        if spill is not True:
            return
        key = "offload.grad_spill"
        _check(
            self.offload.optimizer == "nvme",
            key,
            spill,
            f'spills gradients to the nvme store, but offload.optimizer = "{self.offload.optimizer}": set '
            f'offload.optimizer = "nvme", or grad_spill = "auto"',
        )
        _check(
            self.zero.stage >= 2,
            key,
            spill,
            "needs zero.stage >= 2 (stage 1 reduces every gradient at the step, so none is final before it); "
            'set zero.stage = 2, or grad_spill = "auto"',
        )
        _check(
            not overlaps_backward(self),
            key,
            spill,
            "has nothing to spill: without clipping or loss scaling each unit is updated as its gradient is "
            'reduced (optim.overlap); set grad_spill = "auto"',
        )

    def _check_run(self) -> None:
        """The model, data, loop and checkpoint sections, and where the store is."""
        self._check_model()
        _check(self.data.seq_len >= 1, "data.seq_len", self.data.seq_len, "must be >= 1")
        _check(self.data.micro_batch >= 1, "data.micro_batch", self.data.micro_batch, "must be >= 1")
        _check(self.data.vocab_size >= 257, "data.vocab_size", self.data.vocab_size, "must be > 256 for a BPE")
        _check(self.train.steps >= 1, "train.steps", self.train.steps, "must be >= 1")
        _check(self.train.log_every >= 1, "train.log_every", self.train.log_every, "must be >= 1")
        _check(0 <= self.data.val_fraction < 1, "data.val_fraction", self.data.val_fraction, "must be in [0, 1)")
        _check(self.train.eval_every >= 0, "train.eval_every", self.train.eval_every, "must be >= 0")
        _check(self.train.eval_batches >= 1, "train.eval_batches", self.train.eval_batches, "must be >= 1")
        _check(
            self.train.eval_every == 0 or self.data.val_fraction > 0,
            "train.eval_every",
            self.train.eval_every,
            "needs held-out tokens: set data.val_fraction (for example 0.05)",
        )
        _check(
            not self.train.tensorboard or importlib.util.find_spec("tensorboard") is not None,
            "train.tensorboard",
            self.train.tensorboard,
            "needs the tensorboard package: pip install tensorboard (or leave train.tensorboard empty)",
        )
        path = self.offload.nvme_path
        _check(
            not set("{}") & set(path.replace(NODE, "")),
            "offload.nvme_path",
            path,
            f"the only placeholder it may hold is {NODE} (the host's index, for a store on each host)",
        )
        ckpt = self.checkpoint
        _check(ckpt.interval >= 0, "checkpoint.interval", ckpt.interval, "must be >= 0 (0: no periodic checkpoints)")
        _check(ckpt.keep >= 0, "checkpoint.keep", ckpt.keep, "must be >= 0 (0 keeps every checkpoint)")

    def _check_model(self) -> None:
        _check(self.model.params >= 0, "model.params", self.model.params, "must be >= 0")
        hf = self.model.hf
        _check(
            not hf or (Path(hf) / "config.json").is_file(),
            "model.hf",
            hf,
            "is not a folder holding config.json: give the folder save_pretrained wrote (weights, config, tokenizer)",
        )
        lora = self.lora
        _check(lora.r >= 0, "lora.r", lora.r, "must be >= 0 (0: no LoRA)")
        if lora.r:
            _check(
                hf != "", "lora.r", lora.r, "LoRA fine-tunes a pretrained model: set model.hf = FOLDER (or lora.r = 0)"
            )
            _check(
                importlib.util.find_spec("peft") is not None,
                "lora.r",
                lora.r,
                "needs the peft library: pip install peft (or lora.r = 0)",
            )
        _check(lora.alpha > 0, "lora.alpha", lora.alpha, "must be > 0")
        _check(0 <= lora.dropout < 1, "lora.dropout", lora.dropout, "must be in [0, 1)")

    def _check_finite(self) -> None:
        """Refuse inf and nan in every float (TOML, JSON and overrides all spell them): no setting
        means either, and the range checks alone would let inf through (``inf > 0``)."""
        for section in dataclasses.fields(self):
            values = getattr(self, section.name)
            for key in dataclasses.fields(values):
                value = getattr(values, key.name)
                items = value if isinstance(value, (tuple, list)) else (value,)
                finite = all(math.isfinite(x) for x in items if isinstance(x, float))
                _check(finite, f"{section.name}.{key.name}", value, "must be finite (a number, not inf or nan)")


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {why}")
