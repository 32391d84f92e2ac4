"""The buffers of a model built on the ``meta`` device: real memory and their own values.

The engine gives a meta model's parameters memory unit by unit, but buffers (tensors that are
not trained, e.g. a rotary embedding's ``inv_freq``) are computed by the model's own code when
it is built, and on the meta device that computation yields no values: the first forward would
fail with "Cannot copy out of meta tensor". Buffers are small, so each is recomputed whole here
as the model's own initialisation does it (a Hugging Face model's ``_init_weights`` on the module
that owns it, what ``from_pretrained`` does for the buffers no checkpoint holds). It runs before
any parameter has memory: an initialisation that also touches parameters does nothing to them.
"""

from __future__ import annotations

import torch
from torch import nn


def materialize_buffers_(model: nn.Module, device: torch.device) -> None:
    """Give every meta buffer of ``model`` its initial values and every buffer a place on
    ``device``, or refuse, naming the buffer, if the model's code does not say how to compute it."""
    for name, module in model.named_modules():
        if _meta_buffers(module):
            _initialize(model, name, module)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(device)


def _initialize(model: nn.Module, name: str, module: nn.Module) -> None:
    """Compute the meta buffers of ``module`` (``name`` in ``model``) on the host."""
    meta = _meta_buffers(module)
    for key in meta:
        buffer = module._buffers[key]
        assert buffer is not None
        fill = float("nan") if buffer.is_floating_point() else 0
        module._buffers[key] = torch.full(buffer.shape, fill, dtype=buffer.dtype)
    initializer = _initializer(model, name)
    if initializer is None:
        raise ValueError(_unknown(name, module))
    with torch.no_grad():
        initializer(module)
    for key in meta:
        buffer = module._buffers[key]
        if buffer is None or buffer.is_meta or (buffer.is_floating_point() and bool(torch.isnan(buffer).any())):
            raise ValueError(_unknown(name, module, key))


def _meta_buffers(module: nn.Module) -> list[str]:
    return [key for key, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]


def _initializer(model: nn.Module, name: str):
    """The ``_init_weights`` of the innermost model (a Hugging Face ``PreTrainedModel``) that
    contains module ``name``: it knows how that model's buffers are computed."""
    found = getattr(model, "_init_weights", None)
    parts = name.split(".") if name else []
    module = model
    for part in parts:
        module = getattr(module, part)
        found = getattr(module, "_init_weights", found) if module is not model else found
    return found


def _unknown(name: str, module: nn.Module, key: str | None = None) -> str:
    what = f"buffer {name}.{key}" if key else f"the buffers of {name or 'the model'}"
    return (
        f"{what} ({type(module).__name__}) of a model built on the meta device has no initial value: "
        f"the model's code does not say how to compute it (no _init_weights sets it); build the model "
        f"with real buffers, or give the module an _init_weights that computes them"
    )
