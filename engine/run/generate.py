"""``python -m engine generate``: text sampled from what a run trained, for a quick look.

The model is the run's (the built-in GPT or the ``model.hf`` one), built on the ``meta`` device
from the same config as ``train``, and the engine resumes it from the store at
``offload.nvme_path`` on the same tiers: the committed step's masters become its parameters,
so a model larger than memory streams unit by unit as it does in training (stage 3 with
``offload.param = "nvme"``). Each new token takes one forward under ``torch.no_grad()`` of its
own position alone, the earlier positions' keys and values kept in a cache (a Hugging Face
model's own ``past_key_values``, the built-in GPT's ``KVCache``); once the ids outgrow the
positions the model takes, the window slides and every position moves, so each token is a
forward of the whole window again. A token is chosen from the last position's logits: the most
likely (``temperature = 0``, greedy), or drawn from the ``top_k`` most likely at ``temperature``
with a generator seeded by ``seed``, so a seed repeats its text whatever the run's random
states were.

The prompt is tokenised with the run's tokenizer: bytes, the BPE the run trained (from the
token cache, as ``train`` left it) or the ``model.hf`` folder's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import Config, ConfigError, LoraConfig
from engine.engine import Engine
from engine.run.data import TOKEN_SUFFIX, ByteTokenizer, corpus_text, default_cache_dir, train_bpe
from engine.run.models.gpt import GPT, KVCache
from engine.tiers.store_checks import resume_point

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen."""

    tokens: int = 100
    """New tokens to generate."""
    temperature: float = 0.8
    """Softmax temperature; 0: greedy (the most likely token)."""
    top_k: int = 50
    """Draw among this many most likely tokens; 0: among all."""
    seed: int = 0

    def check(self) -> None:
        if self.tokens < 1:
            raise ConfigError(f"--tokens {self.tokens}: must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"--temperature {self.temperature}: must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: must be >= 0 (0: every token)")


class TextCodec:
    """The run's tokenizer as two functions: text to ids, ids to text."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], vocab_size: int):
        self.encode, self.decode, self.vocab_size = encode, decode, vocab_size


def text_codec(config: Config) -> TextCodec:
    """The tokenizer the run at ``config`` trained with."""
    data = config.data
    if config.model.hf:
        from transformers import AutoTokenizer

        hf: Any = AutoTokenizer.from_pretrained(config.model.hf, local_files_only=True)
        return TextCodec(
            lambda text: list(hf(text)["input_ids"]), lambda ids: hf.decode(ids, skip_special_tokens=True), len(hf)
        )
    if data.source.endswith(TOKEN_SUFFIX):
        raise ConfigError(
            f"data.source = {data.source!r} is a token file, whose tokenizer the run does not know: generate "
            f"needs the text corpus the run tokenised (or a model.hf folder with its tokenizer)"
        )
    if data.tokenizer == "bytes":
        byte = ByteTokenizer()
        return TextCodec(lambda text: byte.encode(text).tolist(), byte.decode, ByteTokenizer.vocab_size)
    bpe = train_bpe(corpus_text(data.source), data.vocab_size, default_cache_dir())
    return TextCodec(lambda text: bpe.encode(text).ids, bpe.decode, bpe.get_vocab_size())


def generation_model(config: Config, vocab_size: int) -> tuple[nn.Module, int | None]:
    """The run's model on the meta device, and the most positions it takes (None: no limit known)."""
    if config.model.hf:
        from engine.run.pretrained import max_positions
        from engine.run.pretrained import meta_model as hf_meta_model

        model = hf_meta_model(config.model.hf)
        positions = max_positions(model)
        if config.lora.r:  # the store holds the adapters under peft's names
            from engine.run.lora import with_lora

            model = with_lora(model, config.lora)
        return model, positions
    from engine.run.train import meta_model

    gpt, _ = meta_model(config, vocab_size)
    return gpt, gpt.config.seq_len


def resumed_engine(config: Config, model: nn.Module, checkpoint: str | None) -> Engine:
    """The engine of ``model`` with the store's committed step (or its checkpoint ``checkpoint``)."""
    path = Path(config.offload.store_path)
    if not (path / "zarr.json").is_file():
        raise FileNotFoundError(
            f"offload.nvme_path = {str(path)!r} holds no store: point --offload.nvme_path (or --config) at the "
            f"store that python -m engine train wrote"
        )
    if checkpoint is None:
        if not config.offload.optimizer_in_store:
            raise ValueError(
                f"offload.optimizer = {config.offload.optimizer!r} kept the run's state in memory: generate from "
                f"one of its checkpoints in {path} with --from-checkpoint TAG (python -m engine inspect {path} "
                f"lists them)"
            )
        resumable, checkpoint = resume_point(path)
        if not resumable:
            raise ValueError(
                f"the store {path} holds no committed step to generate from: train at least one step "
                f"(python -m engine train), or give --from-checkpoint TAG"
            )
    return Engine.resume(model, config, checkpoint=checkpoint)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The token chosen from one position's ``logits``: the most likely at temperature 0, else
    drawn from the ``top_k`` most likely (all if 0) at ``temperature``."""
    logits = logits.float().cpu()
    if sampling.temperature == 0:
        return int(logits.argmax())
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


Forward = Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]
"""ids ``[1, new]`` and the cache of the ids before them (None: no ids before) -> logits
``[1, new, vocab]`` and the cache of all of them."""


def sample_ids(forward: Forward, prompt: list[int], sampling: Sampling, positions: int | None) -> list[int]:
    """``sampling.tokens`` new ids after ``prompt``: the prompt in one ``forward``, then each id
    after it alone with the cache, until the ids exceed ``positions``; from then on each
    ``forward`` is of the last ``positions`` ids, without a cache."""
    generator = torch.Generator().manual_seed(sampling.seed)
    ids = list(prompt)
    cache, cached = None, 0
    with torch.no_grad():
        for _ in range(sampling.tokens):
            if positions and len(ids) > positions:  # the window slides: no cached position is where it was
                cache, cached = None, len(ids) - positions
            logits, cache = forward(torch.tensor([ids[cached:]], dtype=torch.long), cache)
            cached = len(ids)
            ids.append(next_token(logits[0, -1], sampling, generator))
    return ids[len(prompt) :]


def cached_forward(engine: Engine, hf: bool) -> Forward:
    """The engine's forward with a key/value cache: a Hugging Face model's ``past_key_values``,
    or the built-in GPT's ``KVCache``."""

    def forward(ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        if hf:
            output: Any = engine(input_ids=ids, past_key_values=cache, use_cache=True)
            return output.logits, output.past_key_values
        gpt = engine.module
        assert isinstance(gpt, GPT)  # hf is False for the built-in model alone
        cache = cache if cache is not None else KVCache(gpt.config)
        return engine(ids, cache=cache), cache

    return forward


def continue_ids(
    config: Config, prompt: list[int], sampling: Sampling, checkpoint: str | None = None, codec: TextCodec | None = None
) -> list[int]:
    """The ids ``sampling`` continues the ids ``prompt`` with, from the run whose config is
    ``config`` (whose tokenizer, ``codec``, sizes the built-in GPT's vocabulary)."""
    sampling.check()
    if not prompt:
        raise ConfigError("--prompt is empty once tokenised: give it some text, e.g. --prompt 'To be'")
    codec = codec or text_codec(config)
    model, positions = generation_model(config, codec.vocab_size)
    engine = resumed_engine(config, model, checkpoint)
    with contextlib.closing(engine):
        logger.info(
            "generating %d tokens from step %d of %s", sampling.tokens, engine.global_step, config.offload.store_path
        )
        return sample_ids(cached_forward(engine, bool(config.model.hf)), prompt, sampling, positions)


def recorded_model(config: Config) -> Config:
    """``config``, or where it names no ``model.hf`` but its store records the Hugging Face
    folder its run started from (``<store>/hf/``: config.json and tokenizer, and the run's
    ``[lora]`` settings if it trained adapters), the config with that folder as ``model.hf``."""
    from engine.run.pretrained import SOURCE_FOLDER, SOURCE_RECORD

    recorded = Path(config.offload.store_path) / SOURCE_FOLDER
    if config.model.hf or not (recorded / "config.json").is_file():
        return config
    logger.info("%s records a model.hf run: generating with its model and tokenizer from %s", recorded.parent, recorded)
    lora = json.loads((recorded / SOURCE_RECORD).read_text()).get("lora")
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, hf=str(recorded)),
        lora=LoraConfig(**lora) if lora else config.lora,
    )


def generate(config: Config, prompt: str, sampling: Sampling, checkpoint: str | None = None) -> str:
    """The text ``sampling`` continues ``prompt`` with, from the run whose config is ``config``
    (a ``model.hf`` run's model and tokenizer are found in its store if the config names none)."""
    sampling.check()
    config = recorded_model(config)
    codec = text_codec(config)
    return codec.decode(continue_ids(config, codec.encode(prompt), sampling, checkpoint, codec))
