"""Batches of whole fine-tuning examples: packed into rows or padded, epoch after epoch, resumable.

An example is a record's tokens and which of them the loss counts (``engine.run.records``).
Each epoch visits every example once, in an order drawn from ``(seed, epoch)`` alone, so it is
the same at any world size and differs per epoch. The examples of an epoch are then laid into
rows of ``seq_len`` positions in that order: several to a row with ``pack`` (a new row when the
next one does not fit), else one; an example longer than a row is cut to it. Within a row the
position ids restart at 0 for each example, which is what keeps examples from attending to
each other (the built-in GPT builds a block-diagonal mask from them, a Hugging Face model's
attention does the same from ``position_ids``). Padding is a target of no loss (-100).

The rows form one stream across epochs; a step's micro-batch takes the next ``micro_batch x
world_size`` of them, rank ``r`` its slice, as ``TokenBatches`` does: a resume needs only the
epoch and the row, and continues at the exact example.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.run.loss import IGNORE_INDEX

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

_SETTING_OF = {
    "seed": "data.seed",
    "seq_len": "data.seq_len",
    "global_batch": "data.micro_batch x ranks",
    "num_examples": "data.source and data.val_fraction",
    "pack": "data.pack",
}


class Examples:
    """Tokenised examples (``input_ids``, ``in_loss``) of a data set, those at ``indices`` only,
    each cut to at most ``limit`` tokens (a row's positions plus the shifted target)."""

    def __init__(self, tokenized: datasets.Dataset, indices: np.ndarray, limit: int):
        import pyarrow.compute as pc

        self._data, self.indices, self.limit = tokenized, indices, limit
        every = pc.list_value_length(tokenized.data.column("input_ids")).to_numpy(zero_copy_only=False)
        self.full_lengths = every[indices].astype(np.int64)
        self.lengths = np.minimum(self.full_lengths, limit)
        """Tokens of each example, as cut."""

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def truncated(self) -> np.ndarray:
        """The examples (positions in ``indices``) longer than ``limit``."""
        return np.flatnonzero(self.full_lengths > self.limit)

    def tokens(self, example: int) -> tuple[np.ndarray, np.ndarray]:
        """Example ``example``'s token ids and in-loss flags, as cut."""
        row = self._data[int(self.indices[example])]
        return (
            np.asarray(row["input_ids"][: self.limit], dtype=np.int64),
            np.asarray(row["in_loss"][: self.limit], dtype=bool),
        )


def lay_out(order: np.ndarray, positions: np.ndarray, seq_len: int, pack: bool) -> list[np.ndarray]:
    """The rows of one epoch: the examples of ``order`` (each taking ``positions`` of a row) in
    order, several to a row when they fit and ``pack``, else one."""
    rows: list[np.ndarray] = []
    start, used = 0, 0
    for index, example in enumerate(order):
        need = int(positions[example])
        if index > start and (not pack or used + need > seq_len):
            rows.append(order[start:index])
            start, used = index, 0
        used += need
    if len(order) > start:
        rows.append(order[start:])
    return rows


class ExampleBatches:
    """Rows of whole examples for this rank, epoch after epoch (see the module's note)."""

    def __init__(
        self,
        examples: Examples,
        *,
        seq_len: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        pack: bool = True,
        pad_id: int = 0,
    ) -> None:
        usable = examples.lengths >= 2  # an example needs a token to predict
        if not usable.any():
            raise ValueError("no example has two tokens or more, so nothing can be predicted: check data.source")
        self.examples, self.seq_len, self.micro_batch = examples, seq_len, micro_batch
        self.rank, self.world_size, self.seed, self.pack, self.pad_id = rank, world_size, seed, pack, pad_id
        self._usable = np.flatnonzero(usable)
        self._positions = examples.lengths - 1
        self.epoch, self.row = 0, 0  # the next row of the stream
        self._rows: tuple[int, list[np.ndarray]] | None = None
        self._counts = np.zeros(
            3, dtype=np.int64
        )  # positions in the loss, of padding, in all, since ``take_fractions``

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size

    def rows_of(self, epoch: int) -> list[np.ndarray]:
        """Epoch ``epoch``'s rows, each the examples it holds (the latest epoch's kept)."""
        if self._rows is None or self._rows[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self._usable)
            self._rows = (epoch, lay_out(order, self._positions, self.seq_len, self.pack))
        return self._rows[1]

    def steps_for(self, epochs: int, rows_per_step: int) -> int:
        """Optimizer steps that visit every example ``epochs`` times, ``rows_per_step`` rows a step."""
        rows = sum(len(self.rows_of(epoch)) for epoch in range(epochs))
        return -(-rows // rows_per_step)

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's ``(x, y, positions)``, int64 ``[micro_batch, seq_len]``; then advance."""
        taken: list[np.ndarray] = []
        while len(taken) < self.global_batch:
            rows = self.rows_of(self.epoch)
            if self.row >= len(rows):
                self.epoch, self.row = self.epoch + 1, 0
                continue
            taken.append(rows[self.row])
            self.row += 1
        mine = taken[self.rank * self.micro_batch : (self.rank + 1) * self.micro_batch]
        x, y, positions = (np.empty((self.micro_batch, self.seq_len), dtype=np.int64) for _ in range(3))
        used = sum(self._fill(row, x[index], y[index], positions[index]) for index, row in enumerate(mine))
        self._counts += (int((y != IGNORE_INDEX).sum()), y.size - used, y.size)
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(positions)

    def take_fractions(self) -> dict[str, float]:
        """Of this rank's positions since the last call: the fraction the loss counts, and the
        fraction of padding (what packing is for)."""
        counted, padding, total = (int(c) for c in self._counts)
        self._counts[:] = 0
        return {"loss_token_fraction": counted / max(1, total), "padding_fraction": padding / max(1, total)}

    def _fill(self, row: np.ndarray, x: np.ndarray, y: np.ndarray, positions: np.ndarray) -> int:
        """One row: each example's inputs, shifted targets (-100 where the loss does not count)
        and positions from 0; then padding, a segment of its own that no loss counts. The
        positions the examples take."""
        used = 0
        for example in row:
            ids, in_loss = self.examples.tokens(int(example))
            n = len(ids) - 1
            x[used : used + n] = ids[:-1]
            y[used : used + n] = np.where(in_loss[1:], ids[1:], IGNORE_INDEX)
            positions[used : used + n] = np.arange(n)
            used += n
        x[used:] = self.pad_id
        y[used:] = IGNORE_INDEX
        positions[used:] = np.arange(self.seq_len - used)
        return used

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is, and what must match for it to mean the same rows."""
        return {
            "epoch": self.epoch,
            "row": self.row,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_examples": len(self.examples),
            "pack": self.pack,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved stream; refuses a state of other examples or another row shape."""
        different = {
            k: (state.get(k), v) for k, v in self.state_dict().items() if k in _SETTING_OF and state.get(k) != v
        }
        if different:
            detail = ", ".join(f"{key} saved {saved} vs now {now}" for key, (saved, now) in different.items())
            raise ValueError(
                f"the saved batch state does not match these examples ({detail}): to resume them, run with the saved "
                f"{', '.join(_SETTING_OF[key] for key in different)}, or train into a new offload.nvme_path"
            )
        self.epoch, self.row = int(state["epoch"]), int(state["row"])
