"""Every random-number generator a training step may draw from, as JSON-able state.

A resumed run must continue the random streams where the stopped one left them (dropout,
sampling, user code), on every rank: the committed record holds one of these per rank.
"""

from __future__ import annotations

import base64
import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """The current state of torch's CPU (and accelerator) generators, numpy's and Python's."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    keys = np.asarray(keys)
    state = {
        "torch": _encode(torch.get_rng_state()),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.accelerator.is_available():
        state["accelerator"] = _encode(torch.get_device_module().get_rng_state())
    return state


def restore(state: dict[str, Any]) -> None:
    """Put every generator back to ``state`` (as ``capture`` returned it)."""
    torch.set_rng_state(_decode(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "accelerator" in state and torch.accelerator.is_available():
        torch.get_device_module().set_rng_state(_decode(state["accelerator"]))


def restore_rank(states: list[dict[str, Any]], rank: int, world_size: int) -> None:
    """Restore rank ``rank``'s state of those a run of ``len(states)`` ranks saved: per-rank
    random states cannot be mapped onto another number of ranks, so there they are not."""
    if len(states) == world_size:
        restore(states[rank])
    else:
        logger.warning("random states saved by %d rank(s) are not restored on %d", len(states), world_size)


def check(state: Any) -> None:
    """Refuse (ValueError) a state ``restore`` could not apply, without changing any generator:
    the state is tried, and the current one put back whatever happens."""
    current = capture()
    try:
        restore(state)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, OverflowError) as err:
        raise ValueError(f"not a random-generator state ({type(err).__name__}: {err})") from None
    finally:
        restore(current)
