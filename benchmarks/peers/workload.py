"""What every contestant trains, and where: one definition read by the parent and by each rank.

A side-by-side comparison means something only if the systems do the same work, so
the model, the data, the batch, the optimizer and its hyper-parameters live here,
once, and each rank builds them from the same `Workload` (sent as JSON). Contestants
differ only in the system and the tiers of `Contestant`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from engine.config import OptimConfig, Tier
from engine.run.data import TokenBatches, load_tokens
from engine.run.models.gpt import GPT, GPTConfig

System = Literal["plain", "fsdp2", "deepspeed", "ours"]

SYSTEM_NAMES: dict[System, str] = {
    "plain": "plain PyTorch (DDP)",
    "fsdp2": "FSDP2",
    "deepspeed": "DeepSpeed ZeRO-3",
    "ours": "ours stage 3",
}


@dataclass(frozen=True)
class Workload:
    """The model, data, batch and AdamW of every contestant, and how many steps each runs.

    The optimizer takes the engine's default hyper-parameters, a constant learning rate
    and no gradient clipping unless `grad_clip` says otherwise: every system implements
    those the same way, so any difference in step time is the system's. The model is the built-in GPT, untied
    (DeepSpeed's NVMe parameter offload needs it), initialised from `seed` before any
    system sees it, so all contestants start from the same weights and their first
    losses agree.
    """

    tokenizer: Literal["bytes", "bpe"]
    vocab_size: int
    """BPE vocabulary (tokenizer "bpe" only); the model's vocabulary is the data's."""
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    micro_batch: int
    """Sequences per rank per step."""
    warmup: int
    """Steps run before timing: first-touch allocations, lazy initialisation."""
    steps: int
    """Timed steps; a contestant reports their median."""
    world_size: int = 2
    seed: int = 0
    partitioned: bool = False
    """Whether a system that can build the model already partitioned does so (DeepSpeed's
    `zero.Init`): needed once the model's fp32 weights would not fit in memory whole."""
    lr: float = OptimConfig.lr
    betas: tuple[float, float] = OptimConfig.betas
    eps: float = OptimConfig.eps
    weight_decay: float = OptimConfig.weight_decay
    grad_clip: float = 0.0
    """The global gradient norm every system clips to; 0 clips nothing."""

    def tokens(self) -> tuple[np.ndarray, int]:
        """The built-in corpus, tokenised (cached after the first call), and its vocabulary size."""
        return load_tokens("shakespeare", self.tokenizer, vocab_size=self.vocab_size)

    def batches(self, tokens: np.ndarray, rank: int) -> TokenBatches:
        """This rank's share of the same global batches for every contestant."""
        return TokenBatches(
            tokens,
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            rank=rank,
            world_size=self.world_size,
            seed=self.seed,
        )

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=vocab_size,
            seq_len=self.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.d_model,
            tie_embeddings=False,
        )

    def model(self, vocab_size: int) -> GPT:
        """A freshly initialised fp32 GPT on the CPU, the same weights on every rank and run."""
        return GPT(self.gpt_config(vocab_size), seed=self.seed)

    def adamw_kwargs(self) -> dict[str, Any]:
        """The hyper-parameters as `torch.optim.AdamW` (and DeepSpeed's AdamW) take them."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    @property
    def tokens_per_step(self) -> int:
        return self.world_size * self.micro_batch * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Workload:
        return cls(**{**raw, "betas": tuple(raw["betas"])})


FULL = Workload(
    tokenizer="bpe", vocab_size=8192, seq_len=256, n_layer=4, n_head=8, d_model=512, micro_batch=4, warmup=2, steps=10
)
"""The peers' shape in FACTS.md: 21.1M parameters untied, 4 x 256 tokens per rank, median of 10 steps."""

QUICK = Workload(
    tokenizer="bytes", vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64, micro_batch=4, warmup=1, steps=2
)
"""A smoke run: byte tokens (no tokenizer to train), a 0.14M-parameter model, three steps."""


@dataclass(frozen=True)
class Contestant:
    """One system with its fp32 optimizer state and its parameters each on a tier.

    Tiers use the engine's names: `device` is no offload. Systems with one offload
    switch (FSDP2's `CPUOffloadPolicy`) take equal tiers.
    """

    system: System
    optimizer: Tier
    param: Tier

    @property
    def placement(self) -> str:
        """The tiers as one word when they agree, which is how contestants are paired."""
        return self.optimizer if self.optimizer == self.param else f"{self.optimizer}/{self.param}"

    @property
    def label(self) -> str:
        return f"{SYSTEM_NAMES[self.system]}, {self.placement}"

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.optimizer, self.param)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Contestant:
        return cls(**raw)
