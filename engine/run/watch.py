"""What a user watches of ``python -m engine train``: one record of scalars per step, appended
to the ``train.metrics`` JSON-lines file and written to TensorBoard at ``train.tensorboard``.

Both get the same record (``step_record``), so a curve in TensorBoard and one drawn from the
metrics file by ``python -m engine plot`` are the same numbers. TensorBoard is optional (the
``tensorboard`` extra); the config check refuses ``train.tensorboard`` without it, before any
work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.engine import Engine
from engine.run.evaluate import perplexity


def step_record(
    engine: Engine, loss: float, val_loss: float | None, tokens_per_step: int, peak_rss: int
) -> dict[str, Any]:
    """The step just taken: loss, learning rate, gradient norm, validation loss and perplexity
    when taken, tokens per second (tokens per step over the step's seconds, which run from the
    end of the previous step) and the engine's step statistics."""
    stats = engine.last_step_stats.to_dict()
    record: dict[str, Any] = {
        "step": engine.global_step,
        "loss": loss,
        "lr": engine.last_lr,
        "grad_norm": engine.last_grad_norm,
    }
    if val_loss is not None:
        record |= {"val_loss": val_loss, "val_perplexity": perplexity(val_loss)}
    seconds = stats["seconds"]
    record["tokens_per_s"] = tokens_per_step / seconds if seconds > 0 else 0.0
    record["peak_rss_bytes"] = peak_rss
    return record | stats


class Scalars:
    """The sinks of the step records: the metrics file and a TensorBoard event folder, each if set."""

    def __init__(self, metrics: str, tensorboard: str):
        self.metrics = metrics
        if metrics:  # made before the first step, as TensorBoard makes its folder
            Path(metrics).parent.mkdir(parents=True, exist_ok=True)
        self.writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.writer = SummaryWriter(log_dir=tensorboard)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the metrics file; every number in it (bar the step) as a scalar."""
        if self.metrics:
            with open(self.metrics, "a") as metrics:
                metrics.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for tag, value in record.items():
                if tag != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        """Flush the event file (a run that stops early keeps every step it took)."""
        if self.writer is not None:
            self.writer.close()
