"""The sections of a run's configuration (``[zero]``, ``[offload]``, ...), each a dataclass whose
fields are the keys a TOML or JSON file may set, with their defaults and meanings. The whole
run's ``Config``, its loading and its checks are ``engine.config``'s.

The docstrings below are the configuration reference: ``engine.config_docs`` renders them as
``docs/configuration.md`` and as ``python -m engine train --help``. A section's or a key's
first paragraph is its one-line summary; the paragraphs after it are detail.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

Tier = Literal["device", "cpu", "nvme"]
DType = Literal["auto", "fp32", "bf16", "fp16"]
NODE = "{node}"
"""The placeholder of ``offload.nvme_path`` for the index of the host a rank runs on."""
SOURCE_FOLDER = "hf"
"""Where a ``model.hf`` run's store keeps the source folder's config and tokenizer files, and
``SOURCE_RECORD``: a run that resumes reads them there, so its ``model.hf`` may be gone."""
SOURCE_RECORD = "source.json"


@dataclass
class ZeroConfig:
    """How training state is partitioned across ranks."""

    stage: int = 2
    """1: shard masters and optimizer state; 2: also gradients; 3: also the compute-dtype parameters."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; ``Engine.step()`` acts only on the last one."""
    activation_checkpointing: bool = False
    """Recompute each unit's activations in backward instead of keeping them (root unit excluded)."""
    unit_classes: list[str] = field(default_factory=list)
    """Module class names that form a unit, the grain of sharding and I/O.

    Empty: every entry of every ``nn.ModuleList`` (transformer blocks), plus a root unit for the rest.
    Named classes nest: ``["MixtralDecoderLayer", "MixtralExperts"]`` makes each layer's experts a
    unit of their own inside the unit of the rest of the layer; ``["LlamaDecoderLayer", "Linear"]``
    makes each projection a unit inside its layer's, which shrinks every buffer sized by the
    largest unit (the peak RSS of a 7.9B Llama from 8.1 to 3.1 GiB by ``estimate``). A
    transformers model's output head stays in the root unit whatever its class."""
    prefetch_mb: float | Literal["auto"] = "auto"
    """Stage 3: MiB of the units next in the traced order gathered while the current one computes.

    ``auto``: two of the largest unit in the compute dtype (the root unit aside), so that one
    unit's read is in flight while the next lands, at least 64 MiB
    (``engine.tiers.sizing.prefetch_bytes``); a 7.9B Llama's projections in bf16 make it 224
    MiB, where 64 MiB would hold one at a time. The next unit is gathered ahead whatever its size
    (a window smaller than a unit would otherwise gather none ahead); 0 gathers each unit only
    when it is needed. With the parameter
    shards in memory (``offload.param`` = ``cpu`` or ``device``) and an update that waits for
    every gradient (clipping), the same window of the next forward's first units starts on its
    way to the device during the update, each unit as soon as it is updated."""
    persistence_threshold: int = 0
    """Stage 3: units with fewer parameters than this stay gathered for the whole run.

    Their gathers would cost more in latency than their bytes save."""
    device_memory_limit_mb: float = 0.0
    """Device MiB the engine may hold (gathered units, shards, gradient buckets, prefetch window); 0: no limit.

    The prefetch window shrinks to stay under it, and a unit that cannot fit is refused before
    the first forward. Activations are not counted."""


@dataclass
class OffloadConfig:
    """Where each kind of state lives, and how bytes move to and from disk."""

    optimizer: Tier = "nvme"
    """Tier of the masters and AdamW moments: ``device`` (no offload), ``cpu`` or ``nvme``."""
    param: Tier = "device"
    """Tier of the compute-dtype parameter shards (stage 3 only): ``device``, ``cpu`` or ``nvme``.

    On ``nvme`` they are the store's kind ``param``; with ``optim.master_dtype = "bf16"`` there is
    no such copy: the gathers read the bf16 masters."""
    nvme_path: str | list[str] = "offload_store"
    """Folder of the zarr store of the ``nvme`` tier (created if missing); a list stripes it across drives.

    A ``{node}`` in it stands for the index of the host a rank runs on: each host then writes its
    own store on its own disk (``/nvme/run/node-{node}``), and the hosts commit each step together.
    Without it, every rank writes one folder (a single host, or a filesystem every host shares). A
    list of folders (one per drive; on the command line, separated by commas) stripes the store's
    chunks across them: the first keeps the store's identity and records the list, which a resume
    must give again, in the same order; ``{node}`` applies to every folder. Checkpoints of every
    tier are kept here too."""
    buffer_mb: int | Literal["auto"] = "auto"
    """Host staging budget of the ``nvme`` tier in MiB: the peak host memory of streamed state.

    ``auto``: twice the largest unit's optimizer state (one unit read while another is written), at
    least 256 MiB (``engine.tiers.sizing.optimizer_buffer_bytes``), refused if this machine's free
    memory cannot hold it. Half of it is the read-ahead window, counted in bytes whatever the units'
    sizes; every unit's chunks are read and written on all ``io_threads`` at once."""
    chunk_mb: int | Literal["auto"] = "auto"
    """Largest zarr chunk in MiB of fp32; ``auto``: the best for the store's disk, from its I/O profile.

    A shard is cut into the fewest chunks within it, all of one 4 KiB-aligned size, so padding (read
    and written every step) stays under 4 KiB a chunk; with int8 moments a large chunk is rounded
    to 2**18 elements, under an eighth of it, so that the packed moments are O_DIRECT-aligned too
    (docs/store-format.md). ``auto`` takes the fastest setting on the
    store's disk or, among those within 5% of it, the one costing least CPU per byte, from the
    machine's I/O profile (``$XDG_CACHE_HOME/offload-engine/io_profile.json``, measured in a few
    seconds by the first run on a disk, and for larger chunks by the first run that may take
    them, or by ``python -m benchmarks.tiers``), at most a third of ``buffer_mb``. A resumed store
    keeps its own chunk size."""
    io_threads: int | Literal["auto"] = "auto"
    """Threads doing positional reads and writes, each on its own chunk; ``auto``: from the I/O profile."""
    checksum: bool = True
    """Store a CRC-32C with every chunk and verify it on every read."""
    direct_io: bool = True
    """Use O_DIRECT where the filesystem allows it (falls back by itself where it does not)."""
    grad_spill: bool | Literal["auto"] = "auto"
    """Spill gradient shards to the store during backward when the update waits for every gradient.

    Each unit's final gradient shard goes to the store's ``scratch`` folder as soon as backward
    makes it and comes back with its optimizer state at the step (clipping, loss scaling), so host
    memory holds no gradient shard of the whole model. ``auto``: whenever the optimizer is on
    ``nvme`` and the update waits (stages 2 and 3; stage 1 reduces every gradient at the step);
    ``true`` elsewhere is refused. It costs 8 B/param of I/O a step and 4 B/param of disk."""
    grad_spill_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the spilled gradient shards on disk: ``fp32``, or ``bf16`` for half their disk and I/O.

    ``bf16`` rounds to nearest (a gradient is used once: no error piles up) and widens back to fp32
    for the update; the norm and the overflow check are taken from the fp32 shard first. On one
    rank computing in bf16 with one micro-batch a step and no loss scaling, the gradients are
    bf16 from the start: ``bf16`` rounds nothing there, and ``fp32`` only widens them, for twice
    the disk and I/O. Refused where no gradient is spilled."""
    pinned_mb: float | Literal["auto"] = "auto"
    """Host MiB that copies between host and device go through; ``auto``: what the plan needs.

    One bounded pool (pinned on CUDA) of the host tensors a copy reads or fills: gradient shards
    beside a host optimizer (where they are spilled, a window of them: ``SPILL_HELD`` of each
    size in ``engine.tiers.sizing``), parameter shards on the ``cpu`` tier, the rings that stage the
    masters' uploads (rounded to the compute dtype) and the gradients being added, and the nvme
    parameter tier's staging; no optimizer state is pinned. Pinned memory is
    mapped at its exact size (rounded up to the page) and registered with CUDA, never taken from
    torch's pinned allocator, which rounds to a power of two and caches what is freed: this bound
    is what is pinned. ``python -m engine estimate`` prints what a plan needs (its ``pinned``
    column); a number below that is refused at start with the size that fits. Nothing is pinned on
    a CPU-only machine."""
    host_worker: bool | Literal["auto"] = "auto"
    """Run AdamW on the host shards on a thread of its own while backward goes on; ``auto``: where it pays.

    Applies with the optimizer on ``cpu`` or ``nvme``; bit-identical either way. ``auto``: on where
    the device is not the host (an accelerator, or the simulated one) or gradients are spilled
    (``grad_spill``: their norms and writes then leave the training thread), else off on a
    CPU-only machine, where the worker would take the cores backward computes on. Beside an
    accelerator the worker's thread binds the rank's device, and while it runs torch's intra-op
    threads are capped at the rank's share of the cores less one, left to the thread that
    launches kernels. ``true`` with ``optimizer = "device"`` is refused."""

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
    """``generations``: a crash at any instant resumes from the last step; ``in-place``: half the disk.

    ``generations`` writes each step to a new generation and commits it atomically (about twice the
    disk of the state rewritten each step). ``in-place`` rewrites one generation each step, marked
    dirty while a step is in flight: ``python -m engine train`` resumes a dirty store from its last
    checkpoint, and ``Engine.resume`` refuses it, naming that checkpoint."""
    defer_commit: bool = True
    """Finish a step's last writes, fsync and commit behind the next step's forward.

    The commit then comes when the next step's optimizer state is first read (or at ``save`` or
    ``close``), so a crash in between resumes from the step before. ``false`` commits every step
    before ``step()`` returns."""


@dataclass
class PrecisionConfig:
    """Compute dtype and loss scaling."""

    compute_dtype: DType = "auto"
    """Dtype of the parameters the model computes with: ``auto``, ``fp32``, ``bf16`` or ``fp16``.

    ``auto`` is ``bf16`` where the device computes it natively (a GPU with bf16 units, a CPU
    whose bf16 matmuls torch runs through oneDNN: AVX-512 or AMX), else ``fp32``: on an AVX2 CPU
    a bf16 matmul runs 70x slower than an fp32 one (``engine.runtime.native_dtype``). It never picks
    ``fp16``, which needs loss scaling. The ranks take rank 0's choice, and the run's log says it.
    The masters are fp32 unless ``optim.master_dtype = "bf16"``."""
    loss_scaling: Literal["dynamic", "static", "none"] = "none"
    """``dynamic`` (needed by fp16), ``static`` (a fixed ``initial_scale``) or ``none``."""
    initial_scale: float = 65536.0
    """First loss scale, and the only one with ``static``."""
    growth_interval: int = 1000
    """Clean steps before the dynamic scale grows by ``growth_factor``."""
    growth_factor: float = 2.0
    """Multiplier of the dynamic scale after ``growth_interval`` clean steps."""
    backoff_factor: float = 0.5
    """Multiplier of the dynamic scale after a step with an inf/nan gradient (the step is skipped)."""


@dataclass
class OptimConfig:
    """AdamW on the master shards, and its learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's betas: the decay rates of the first and second moments."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the square root of the second moment."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter but those ``no_decay`` exempts."""
    no_decay: list[str] = field(default_factory=lambda: ["bias", "norm", "embedding"])
    """Parameters that take no weight decay: ``bias``, ``norm``, ``embedding``, or fnmatch patterns of names.

    As Hugging Face's Trainer and torchtune leave them: ``bias`` (parameters named ``*bias``),
    ``norm`` (the parameters of normalisation modules: ``nn.LayerNorm``, ``nn.RMSNorm``, any class
    whose name ends with ``Norm``), ``embedding`` (the weights of ``nn.Embedding`` modules; an
    output head tied to one is the same parameter, so it follows its embedding); any other entry is
    an fnmatch pattern over a parameter's full name (``"*.ln_f.*"``), refused if it matches none.
    ``[]``: every parameter decays. Taken from the model at every start, so a resume with another
    list changes the groups from then on. Bit-identical to ``torch.optim.AdamW`` with the two
    parameter groups."""
    kernel: Literal["fused", "foreach"] = "fused"
    """``fused`` (torch's fastest, equal to ``AdamW(fused=True)``) or ``foreach`` (torch's default AdamW).

    Each is bit-identical to the torch AdamW it names."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping across ranks; 0 disables it."""
    overlap: bool = True
    """Without clipping, update each unit as soon as its gradient shard is reduced, during backward.

    On the last micro-batch, overlapped with the rest of backward; the result is bit-identical
    either way. With clipping (``grad_clip > 0``) every gradient must be reduced first."""
    defer_update: bool = False
    """With clipping or loss scaling, update each unit in the next forward, just before it runs.

    The update then goes on behind the forward's compute instead of after backward: its
    optimizer state's disk reads and writes (``nvme``), or its host AdamW beside a device's
    forward (``cpu``); and each unit's new values go straight to the device from its master,
    with no read of the parameter shard. The step commits once its last unit is updated (or at
    ``save``, ``flush``, the next ``backward`` or ``close``), so a crash before that resumes
    from the step before, as with ``store.defer_commit``. Gradients held in memory stay there
    until their unit's update. Needs ``zero.stage = 3``; the result is bit-identical either way.
    It pays where the disk is the limit. With the optimizer in host memory it puts the host's
    AdamW beside the forward, which only a device apart from the host can overlap (on a CPU it
    gains little). A unit's copy to the device cannot start before its update, so where copies
    are slower the update after backward overlaps them better."""
    state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """AdamW's moments: ``fp32`` (bit-exact with torch), ``bf16`` or ``int8`` (8-bit blocks of 256).

    Stored bytes per parameter with an fp32 master: 12, 8 and 6.03. The compact forms are widened
    to fp32 for the update and rounded back stochastically (``engine.state.forms``). A store
    resumes only in the form it was written in."""
    master_dtype: Literal["fp32", "bf16"] = "fp32"
    """The master weights: ``fp32`` (bit-exact with torch) or ``bf16`` (2 B/param fewer, rounded stochastically).

    A bf16 master is updated in fp32 and rounded back. At stage 3 with ``offload.param = "nvme"``
    a bf16 master is the parameter itself, read by the gathers (one copy on disk, none rewritten
    each step) and cast to the compute dtype on its way to the device. A store resumes only
    with the master dtype it was written with."""
    warmup_steps: int = 0
    """Steps of linear warmup from ``lr / warmup_steps`` to ``lr``."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After warmup: ``cosine`` or ``linear`` decay to ``min_lr_ratio * lr``, or ``constant`` at ``lr``.

    ``linear`` is Hugging Face's default schedule."""
    decay_steps: int = 0
    """Steps of the decay after warmup (cosine or linear); 0: ``train.steps - warmup_steps``."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the decay, as a fraction of ``lr``."""


@dataclass
class ModelConfig:
    """The model ``python -m engine train`` trains: the built-in GPT, or a pretrained one (``hf``)."""

    preset: str = "small"
    """Size of the built-in GPT: ``tiny``, ``small``, ``medium``, ``large``, ``1b`` or ``3b``.

    About 0.24M, 4.9M, 26M, 129M, 1B and 3B parameters."""
    params: float = 0.0
    """If > 0, the built-in GPT's depth and width for about this many parameters instead of ``preset``."""
    tie_embeddings: bool = False
    """Share one weight between the built-in GPT's input embedding and its output head."""
    hf: str = ""
    """A Hugging Face checkpoint folder to fine-tune instead of the built-in GPT; empty: the built-in GPT.

    The folder holds ``config.json``, safetensors weights and a tokenizer: the model is built on the
    meta device and imported unit by unit, and the data is tokenised with its own tokenizer."""


@dataclass
class LoraConfig:
    """LoRA adapters on a ``model.hf`` run, through the ``peft`` library.

    The pretrained weights are frozen and the adapters trained; ``export`` writes the adapter in
    peft's format."""

    r: int = 0
    """Rank of the adapters; 0: no LoRA (every parameter trains)."""
    alpha: float = 16.0
    """peft's ``lora_alpha``: the adapters' output is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps training deterministic)."""
    target_modules: list[str] = field(default_factory=list)
    """Names of the linear layers that get adapters (``["q_proj", "v_proj"]``); empty: peft's default.

    The default is peft's for the model's architecture."""


@dataclass
class DataConfig:
    """The training text or records, and how batches are drawn."""

    source: str = "shakespeare"
    """``shakespeare`` (built in), a text file or folder, a uint16 token file ``*.bin``, or fine-tuning records.

    Text: a ``.txt`` or ``.md`` file or a folder of them. Records: a ``.jsonl``, ``.json`` or
    ``.parquet`` file, a folder of them, or a folder ``datasets.save_to_disk`` wrote, tokenised by
    the ``model.hf`` tokenizer (see ``format``)."""
    format: Literal["auto", "text", "messages", "prompt_completion"] = "auto"
    """The records' form: ``text``, ``messages``, ``prompt_completion``; ``auto``: told by their fields.

    ``messages`` are chats, rendered by the tokenizer's chat template; ``prompt_completion`` holds
    strings, or lists of messages."""
    train_on: Literal["completion", "all"] = "completion"
    """Which tokens of a record the loss counts: ``completion`` (or the assistant's replies) or ``all``.

    ``text`` records count every token."""
    pack: bool = True
    """Put several records into one sequence of ``seq_len``, attention within each; false: one record a sequence.

    Unpacked records are padded to ``seq_len``."""
    truncate: bool = True
    """Cut a record longer than ``seq_len`` (the run logs how many); false refuses such a record."""
    tokenizer: Literal["bytes", "bpe"] = "bytes"
    """``bytes`` (256 ids) or ``bpe`` (trained offline and cached; needs the ``bpe`` extra).

    With ``model.hf``, the model's own tokenizer is used instead."""
    vocab_size: int = 8192
    """BPE vocabulary size (``tokenizer = "bpe"`` only)."""
    seq_len: int = 128
    """Tokens per sequence."""
    micro_batch: int = 8
    """Sequences per rank per micro-batch."""
    seed: int = 0
    """Seed of the batch order, the same batches at any world size (``--seed`` sets it and ``train.seed``)."""
    val_fraction: float = 0.0
    """Fraction of the data held out for the validation loss; 0: none.

    Of a text corpus, the tokens at its end; of fine-tuning records, the last whole records."""


@dataclass
class TrainConfig:
    """The training loop of ``python -m engine train``."""

    steps: int = 200
    """Optimizer steps."""
    epochs: int = 0
    """Passes over fine-tuning records instead of ``steps``; 0: train for ``steps``.

    Each epoch visits every record once, in an order drawn anew from ``data.seed`` and the epoch."""
    log_every: int = 10
    """Steps between log lines (loss, tokens/s, peak RSS, bytes per tier)."""
    seed: int = 0
    """Seed of the model's (or the LoRA adapters') initialisation (``--seed`` sets it and ``data.seed``)."""
    metrics: str = ""
    """A JSON-lines file that gets one record per step (``python -m engine plot FILE`` draws it); empty: none.

    Rank 0 appends the loss, learning rate, gradient norm, validation loss and perplexity when taken,
    seconds, tokens/s, exposed parameter and optimizer waits, bytes read and written, prefetch hit
    rate, device high-water, peak RSS, the step's CPU seconds (``cpu_s``), and the stores' I/O
    CPU-seconds per GB moved by stage (``io_cpu_s_per_gb``: system calls, CRC-32C, open/close,
    fsync, copies, casts, zeroing, and their ``total``) with the bytes they are per (``io_bytes``);
    and the seconds and waits again by phase (``phases``: forward, backward, update, and the loop's
    own time, ``other``; ``python -m benchmarks.phase_plot`` draws them)."""
    tensorboard: str = ""
    """A folder that gets the same scalars as TensorBoard events (needs ``tensorboard``); empty: none."""
    eval_every: int = 0
    """Steps between validation losses (needs ``data.val_fraction > 0``); 0: after the last step only.

    The same held-out batches each time, under ``torch.no_grad()`` (at stage 3 each unit is gathered
    once per forward, never for a backward); logged, in the metrics and on the progress bar."""
    eval_batches: int = 8
    """Micro-batches per rank in one validation loss."""


@dataclass
class CheckpointConfig:
    """Steps kept as ``checkpoints/<tag>`` in the store at ``offload.nvme_path``, to resume from later.

    On the ``nvme`` tier a checkpoint is kept by a rename when the next step supersedes the step;
    on the memory tiers by writing their state there (``Engine.save``)."""

    interval: int = 0
    """Steps between the checkpoints ``python -m engine train`` keeps, tagged ``step-<n>``; 0: none."""
    keep: int = 0
    """Checkpoints retained: once one more is kept, the oldest beyond this many are deleted; 0 keeps all."""
