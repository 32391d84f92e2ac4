"""Fine-tuning records for ``python -m engine train``: read, tokenised with the model's own
tokenizer, split into training and held-out examples, and laid into batches.

A run whose ``data.source`` holds records (``engine.run.records``) fine-tunes: the records are
tokenised once (cached), whole records are held out for validation (``data.val_fraction``, the
last records), and ``train.epochs``, if set, becomes the number of steps that visits every
training record that many times.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.config import Config
from engine.run.data import default_cache_dir
from engine.run.examples import ExampleBatches, Examples
from engine.run.pretrained import load_tokenizer
from engine.run.records import detect_form, load_records, tokenize_records

logger = logging.getLogger(__name__)


@dataclass
class RecordData:
    """The tokenised examples a fine-tuning run trains on, and those it holds out."""

    train: Examples
    held_out: Examples | None
    pad_id: int
    vocab_size: int

    def batches(
        self, config: Config, rank: int, world_size: int, micro_batch: int = 0, held_out: bool = False
    ) -> ExampleBatches:
        """This rank's batches of the training (or held-out) examples, ``micro_batch`` rows each
        (0: ``data.micro_batch``)."""
        examples = self.held_out if held_out and self.held_out is not None else self.train
        return ExampleBatches(
            examples,
            seq_len=config.data.seq_len,
            micro_batch=micro_batch or config.data.micro_batch,
            rank=rank,
            world_size=world_size,
            seed=config.data.seed,
            pack=config.data.pack,
            pad_id=self.pad_id,
        )

    def with_steps(self, config: Config) -> Config:
        """``config`` with ``train.steps`` that visit every training example ``train.epochs`` times
        (as it is without epochs)."""
        train = config.train
        if not train.epochs:
            return config
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rows_per_step = config.data.micro_batch * world * config.zero.grad_accum_steps
        steps = self.batches(config, 0, world).steps_for(train.epochs, rows_per_step)
        logger.info(
            "%d epoch(s) of %d examples: %d steps of %d rows", train.epochs, len(self.train), steps, rows_per_step
        )
        return dataclasses.replace(config, train=dataclasses.replace(train, steps=steps))


def record_data(config: Config, cache_dir: Path | None = None) -> RecordData:
    """The records of ``data.source`` tokenised by the ``model.hf`` tokenizer and split."""
    data, source = config.data, config.data.source
    if not config.model.hf:
        raise ValueError(
            f"data.source = {source!r} holds fine-tuning records, which the pretrained model's own tokenizer renders: "
            f"set model.hf = FOLDER (a Hugging Face checkpoint with its tokenizer)"
        )
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokenizer = load_tokenizer(config.model.hf)
    records = load_records(source, cache)
    form = detect_form(records.column_names, data.format, source)
    tokenized = tokenize_records(records, tokenizer, form, data.train_on, source, cache)
    count = len(tokenized)
    held = int(count * data.val_fraction)
    if data.val_fraction and not 0 < held < count:
        raise ValueError(
            f"data.val_fraction = {data.val_fraction} of {count} records leaves an empty side: use more records or "
            f"another fraction"
        )
    limit = data.seq_len + 1  # a row's positions, and the target after the last
    train = Examples(tokenized, np.arange(count - held), limit)
    _check_lengths(train, data.truncate, source, data.seq_len)
    held_out = Examples(tokenized, np.arange(count - held, count), limit) if held else None
    logger.info(
        "%d %s records from %s: %d tokens, %d for training, %d held out",
        count,
        form,
        source,
        int(train.full_lengths.sum()),
        len(train),
        held,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return RecordData(train, held_out, pad, len(tokenizer))


def _check_lengths(examples: Examples, truncate: bool, source: str, seq_len: int) -> None:
    """Refuse a record too long for a row (``data.truncate = false``), or count those cut."""
    cut = examples.truncated
    if not len(cut):
        return
    first = int(cut[0])
    if not truncate:
        raise ValueError(
            f"{source} record {int(examples.indices[first]) + 1} has {int(examples.full_lengths[first])} tokens, more "
            f"than data.seq_len + 1 = {seq_len + 1}: raise data.seq_len, or set data.truncate = true to cut such records"
        )
    logger.warning(
        "%d of %d records are longer than data.seq_len + 1 = %d tokens and are cut (data.truncate = false refuses them)",
        len(cut),
        len(examples),
        seq_len + 1,
    )
