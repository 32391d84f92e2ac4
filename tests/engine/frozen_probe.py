"""Train, in a fresh process, the built-in GPT with its base frozen (a fine-tune of a few
parameters), and print the process's high-water resident set in bytes.

``python -m tests.engine.frozen_probe TIERS_JSON``: the stage and tiers as config sections.
This module imports only the engine (not pytest), so the process holds what a run holds.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
from torch import nn

from engine.config import Config
from engine.engine import Engine
from engine.run.train import meta_model
from engine.runtime.heap import tune_heap
from engine.runtime.rss import peak_rss_bytes

VOCAB = 256
SETTINGS = {"model": {"params": 40e6}, "data": {"seq_len": 64, "micro_batch": 2}, "train": {"steps": 2}}
IO = {"chunk_mb": 16, "io_threads": 4}
"""Set, so that no run measures the disk first (a fresh machine's first run does, which adds to its peak)."""


def frozen_config(tiers: dict, store: str = "store") -> Config:
    """The run's config: ``SETTINGS`` with the ``zero`` and ``offload`` sections of ``tiers``."""
    return Config.from_dict({**SETTINGS, **tiers, "offload": {**tiers["offload"], **IO, "nvme_path": store}})


def frozen_model(config: Config) -> tuple[nn.Module, Callable[[dict[str, torch.Tensor]], None]]:
    """The built-in GPT on the meta device with every matrix but the head's frozen (the biases,
    norms and head train: about 1%), and its ``init_unit``."""
    model, init = meta_model(config, VOCAB)
    for name, param in model.named_parameters():
        param.requires_grad_(param.dim() < 2 or name.startswith("head."))
    return model, init


def main(tiers: dict) -> int:
    tune_heap()  # as python -m engine train does
    torch.manual_seed(0)
    config = frozen_config(tiers)
    model, init = frozen_model(config)
    eng = Engine(model, config, total_steps=2, init_unit=init)
    for _ in range(2):
        x = torch.randint(0, VOCAB, (config.data.micro_batch, config.data.seq_len + 1))
        eng.backward(eng(x[:, :-1], x[:, 1:]))
        eng.step()
    eng.close()
    return peak_rss_bytes()


if __name__ == "__main__":
    print(main(json.loads(sys.argv[1])))
