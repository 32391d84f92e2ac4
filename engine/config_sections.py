"""The sections of a run's configuration (``[zero]``, ``[offload]``, ...), each a dataclass whose
fields are the keys a TOML or JSON file may set, with their defaults and meanings. The whole
run's ``Config``, its loading and its checks are ``engine.config``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

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
    """Tier of the masters and AdamW moments: ``device`` (no offload), ``cpu`` or ``nvme``."""
    param: Tier = "device"
    """Tier of the compute-dtype parameter shards (stage 3 only)."""
    nvme_path: str | list[str] = "offload_store"
    """Folder of the zarr store used by the ``nvme`` tier (created if missing). A ``{node}`` in it
    stands for the index of the host a rank runs on: each host then writes its own store on its
    own disk (``/nvme/run/node-{node}``), and the hosts commit each step together. Without it,
    every rank writes one folder (a single host, or a filesystem every host shares). A list of
    folders (one per drive; on the command line, separated by commas) stripes the store's chunks
    across them (``offload.stripes``): the first keeps the store's identity and records the list,
    which a resume must give again, in the same order; ``{node}`` applies to every folder."""
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
    grad_spill_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the spilled gradient shards on disk: ``bf16`` halves their disk and I/O (2 B/param
    each way), rounded to nearest (a gradient is used once: no error piles up), and widened back to
    fp32 for the update; the norm and the overflow check are taken from the fp32 shard first."""
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
    def optimizer_on_device(self) -> bool:
        """Whether the optimizer state is held in device memory (``device``), where AdamW then runs."""
        return self.optimizer == "device"

    @property
    def optimizer_in_host_memory(self) -> bool:
        """Whether the optimizer state is held in host memory (``cpu``)."""
        return self.optimizer == "cpu"

    @property
    def optimizer_in_store(self) -> bool:
        """Whether the optimizer state lives in the store between steps (``nvme``): each step is
        committed there, and a run resumes from its last commit."""
        return self.optimizer == "nvme"

    @property
    def params_on_device(self) -> bool:
        """Whether the compute-dtype parameters stay whole on the device (``device``, and any stage below 3)."""
        return self.param == "device"

    @property
    def params_in_host_memory(self) -> bool:
        """Whether stage 3's parameter shards are held in host memory (``cpu``)."""
        return self.param == "cpu"

    @property
    def params_in_store(self) -> bool:
        """Whether stage 3's parameter shards live in the store (``nvme``)."""
        return self.param == "nvme"

    @property
    def uses_store(self) -> bool:
        """Whether a tier keeps its state in the store between steps (the optimizer's or the
        parameters'), reading and writing its disk every step."""
        return self.optimizer_in_store or self.params_in_store

    @property
    def nvme_paths(self) -> list[str]:
        """Every folder of the store, the first its identity: a list, or a string's comma-separated parts."""
        return list(self.nvme_path) if isinstance(self.nvme_path, list) else self.nvme_path.split(",")

    @property
    def store_path(self) -> str:
        """The store's own folder (the first of ``nvme_path``): its lock, commits and attributes."""
        return self.nvme_paths[0]

    @property
    def stripe_paths(self) -> tuple[str, ...]:
        """The store's other folders, holding shares of its chunks (none for one folder)."""
        return tuple(self.nvme_paths[1:])

    @property
    def node_local(self) -> bool:
        """Whether each host has its own store (``nvme_path`` holds ``{node}``)."""
        return NODE in self.store_path

    def on_node(self, node: int) -> OffloadConfig:
        """This section as host ``node`` sees it: ``{node}`` in every folder of ``nvme_path`` replaced by its index."""
        paths = [p.replace(NODE, str(node)) for p in self.nvme_paths]
        return dataclasses.replace(self, nvme_path=paths if len(paths) > 1 else paths[0])


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
    """Dtype of the parameters the model computes with; masters are fp32 unless ``optim.master_dtype = "bf16"``."""
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
    """AdamW on the master shards, and its learning-rate schedule."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter but those ``no_decay`` exempts."""
    no_decay: list[str] = field(default_factory=lambda: ["bias", "norm", "embedding"])
    """Parameters that take no weight decay, as Hugging Face's Trainer and torchtune leave them:
    ``bias`` (parameters named ``*bias``), ``norm`` (the parameters of normalisation modules:
    ``nn.LayerNorm``, ``nn.RMSNorm``, any class whose name ends with ``Norm``), ``embedding`` (the
    weights of ``nn.Embedding`` modules; an output head tied to one is the same parameter, so it
    follows its embedding); any other entry is an fnmatch pattern over a parameter's full name
    (``"*.ln_f.*"``), refused if it matches none. ``[]``: every parameter decays. Taken from the
    model at every start, so a resume with another list changes the groups from then on."""
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
    (``engine.state.forms``). A store resumes only in the form it was written in."""
    master_dtype: Literal["fp32", "bf16"] = "fp32"
    """How the master weights are held and stored: ``fp32`` (bit-exact with torch), or ``bf16``
    (2 B/param fewer, updated in fp32 and rounded back stochastically). At stage 3 with
    ``offload.param = "nvme"`` a bf16 master is the parameter itself, read by the gathers (one
    copy on disk, none rewritten each step), which needs ``precision.compute_dtype = "bf16"``.
    A store resumes only with the master dtype it was written with."""
    warmup_steps: int = 0
    """Steps of linear warmup from ``lr / warmup_steps`` to ``lr``."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After warmup: a half cosine down to ``min_lr_ratio * lr``, a straight line down to it
    (``linear``, Hugging Face's default schedule), or ``constant`` at ``lr``."""
    decay_steps: int = 0
    """Steps of the decay after warmup (cosine or linear); 0 means ``train.steps - warmup_steps``."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the decay, as a fraction of ``lr``."""


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
    """``shakespeare`` (built in), a .txt/.md file or folder, a uint16 token file ``*.bin``, or
    fine-tuning records: a ``.jsonl``, ``.json`` or ``.parquet`` file, a folder of them, or a folder
    ``datasets.save_to_disk`` wrote (tokenised by the ``model.hf`` tokenizer, see ``format``)."""
    format: Literal["auto", "text", "messages", "prompt_completion"] = "auto"
    """The form of the records: ``text``; ``messages`` (chat, rendered by the tokenizer's chat
    template); ``prompt_completion`` (strings, or lists of messages); ``auto``: told by their fields."""
    train_on: Literal["completion", "all"] = "completion"
    """Which tokens of a record the loss counts: ``completion`` (the completion, or the assistant's
    replies) or ``all``. ``text`` records count every token."""
    pack: bool = True
    """Put several records into one sequence of ``seq_len`` (no attention across them); false:
    one record a sequence, padded."""
    truncate: bool = True
    """Cut a record longer than ``seq_len`` (the run logs how many); false refuses such a record."""
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
    epochs: int = 0
    """Passes over fine-tuning records (``data.source`` records) instead of ``steps``: each visits
    every record once, in an order drawn anew each epoch; 0: train for ``steps``."""
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
