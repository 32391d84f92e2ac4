"""The buffers of a model built on the ``meta`` device: real memory and their own values.

The engine gives a meta model's parameters memory unit by unit, but buffers (tensors that are
not trained, e.g. a rotary embedding's ``inv_freq``) are computed by the model's own code when
it is built, and on the meta device that computation yields no values: the first forward would
fail with "Cannot copy out of meta tensor". Buffers are small, so each is recomputed whole here
as the model's own initialisation does it: a Hugging Face model's ``_init_weights`` on the module
that owns it (what ``from_pretrained`` does for the buffers no checkpoint holds), or else a fresh
instance of the owning module built on the host from its ``config`` (a module that computes them
in ``__init__``). It runs before any parameter has memory: an initialisation that also touches
parameters does nothing to them. A buffer neither way computes is refused, by name.
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
    if initializer is not None:
        with torch.no_grad():
            initializer(module)
    left = [key for key in meta if not _computed(module._buffers[key])]
    if left:
        _from_config(name, module, left)


def _computed(buffer: torch.Tensor | None) -> bool:
    return buffer is not None and not buffer.is_meta and not (buffer.is_floating_point() and bool(buffer.isnan().any()))


def _from_config(name: str, module: nn.Module, keys: list[str]) -> None:
    """Buffers ``keys`` of ``module`` from a fresh instance of its class built on the host from
    its ``config`` (a module that computes them in ``__init__``, which no ``_init_weights`` knows)."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(_unknown(name, module, keys[0]))
    try:
        with torch.device("cpu"):
            fresh = type(module)(config)
    except (TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise ValueError(_unknown(name, module, keys[0])) from err
    for key in keys:
        value = fresh._buffers.get(key)
        old = module._buffers[key]
        if value is None or old is None or value.shape != old.shape or not _computed(value):
            raise ValueError(_unknown(name, module, key))
        module._buffers[key] = value.to(old.dtype)


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


def _unknown(name: str, module: nn.Module, key: str) -> str:
    what = f"buffer {name}.{key}" if name else f"buffer {key}"
    return (
        f"{what} ({type(module).__name__}) of a model built on the meta device has no initial value: "
        f"the model's code does not say how to compute it (no _init_weights sets it and the module "
        f"is not built from a config); build the model with real buffers, or give the module an _init_weights"
    )
