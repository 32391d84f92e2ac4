"""Which parameters take weight decay (``optim.no_decay``), and where they lie in each shard.

Fine-tuning recipes (Hugging Face's Trainer, torchtune) leave biases, normalisation gains and
embeddings undecayed: decay pulls a LayerNorm gain towards 0 rather than towards its identity
of 1, and shrinks the rows of rare tokens, which get few gradients to pull them back. The
choice is made from the model (module types and parameter names) at every start, never stored:
a resume with another ``optim.no_decay`` changes the groups from then on, as torch's
``AdamW`` built with other groups would.

A unit's flat buffer lays its parameters end to end, so within one rank's shard the decayed
and undecayed elements form a few contiguous runs (``ShardDecay``): the fp32 update runs
torch's kernel once per kind of run, on views (``engine.zero.optim.ShardAdamW``), and the
compact one masks the decay per element (``engine.zero.compact_update``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.runtime.scratch import scratch
from engine.state.partition import ModelLayout, UnitLayout

BIAS, NORM, EMBEDDING = "bias", "norm", "embedding"
"""The keywords of ``optim.no_decay``: parameters named ``*bias``; the parameters of
normalisation modules (``is_norm``); the weights of embeddings (and an output head tied to one,
being the same parameter). Any other entry is an fnmatch pattern over a parameter's full name."""
NORM_CLASSES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
"""torch's normalisation modules that hold parameters (batch and instance norms share the base)."""


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` normalises: one of torch's (``NORM_CLASSES``), or a class whose name
    ends with ``Norm``, which is how Hugging Face names its own (``LlamaRMSNorm``, ``T5LayerNorm``)."""
    return isinstance(module, NORM_CLASSES) or type(module).__name__.endswith("Norm")


def no_decay_names(model: nn.Module, no_decay: Sequence[str]) -> frozenset[str]:
    """The names (as the layout holds them: ``named_parameters``' first name of each) of the
    parameters ``no_decay`` exempts from weight decay. A tied parameter is exempt if any of its
    names or modules is, so a head tied to an embedding follows it. A pattern that matches no
    parameter is refused: a typo there would decay silently what it meant to exempt."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    exempt: set[int] = set()
    for entry in no_decay:
        matched = _matching(model, names, entry)
        if not matched and entry not in (BIAS, NORM, EMBEDDING):
            shown = ", ".join(n[0] for n in list(names.values())[:4])
            raise ValueError(
                f"optim.no_decay names {entry!r}, which matches no parameter of this model (its names are like "
                f"{shown}): fix the fnmatch pattern (e.g. '*.ln_f.*') or remove it"
            )
        exempt |= matched
    return frozenset(n for n, p in model.named_parameters() if id(p) in exempt)


def _matching(model: nn.Module, names: dict[int, list[str]], entry: str) -> set[int]:
    """The ids of the parameters one ``optim.no_decay`` entry exempts."""
    if entry == NORM:
        return {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)}
    if entry == EMBEDDING:
        embeddings = (nn.Embedding, nn.EmbeddingBag)
        return {id(m.weight) for m in model.modules() if isinstance(m, embeddings)}
    pattern = "*bias" if entry == BIAS else entry
    return {key for key, all_names in names.items() if any(fnmatch.fnmatchcase(n, pattern) for n in all_names)}


Run = tuple[int, int, bool]
"""Elements ``[start, stop)`` of a shard, and whether they decay."""


@dataclass(frozen=True)
class ShardDecay:
    """Which elements of one rank's shard of a unit take weight decay: runs ``(start, stop,
    decays)`` that cover the shard in order, neighbours differing (the padding at a unit's end
    joins the run before it; a shard of padding alone decays, its zeros unchanged either way)."""

    runs: tuple[Run, ...]

    @property
    def uniform(self) -> bool | None:
        """True where every element decays, False where none does, None where some do."""
        return self.runs[0][2] if len(self.runs) == 1 else None

    def slices(self, decays: bool) -> list[slice]:
        """The runs that decay (``decays``) or do not, as slices of the shard."""
        return [slice(start, stop) for start, stop, decayed in self.runs if decayed == decays]

    def mask(self, device: torch.device) -> torch.Tensor:
        """True at each element that decays (bool, the shard's length): what a kernel taking
        decay per element reads, one byte per element, valid until the thread's next ``mask``
        (``engine.runtime.scratch``): a mask kept per unit would cost a byte per parameter for
        the whole run, and one made anew for each update was fresh memory each time (36M
        elements: 33 ms, against 1.5 ms written over the last one)."""
        mask = scratch("decay mask", self.runs[-1][1], torch.bool, device)
        for start, stop, decays in self.runs:
            mask[start:stop] = decays
        return mask


def shard_decay(unit: UnitLayout, rank: int, no_decay: frozenset[str]) -> ShardDecay:
    """Where the parameters of ``unit`` that decay (those not in ``no_decay``) lie in ``rank``'s
    shard of it, as merged runs."""
    part = unit.shard_slice(rank)
    runs: list[Run] = []
    for slot in unit.params:
        start, stop = max(slot.offset, part.start), min(slot.offset + slot.numel, part.stop)
        if start >= stop:
            continue
        decays = slot.name not in no_decay
        if runs and runs[-1][2] == decays:
            runs[-1] = (runs[-1][0], stop - part.start, decays)
        else:
            runs.append((start - part.start, stop - part.start, decays))
    if not runs:
        return ShardDecay(((0, unit.shard_numel, True),))
    runs[-1] = (runs[-1][0], unit.shard_numel, runs[-1][2])
    return ShardDecay(tuple(runs))


def shard_decays(layout: ModelLayout, rank: int, no_decay: frozenset[str]) -> dict[str, ShardDecay]:
    """``shard_decay`` of every trainable unit, by name."""
    return {unit.name: shard_decay(unit, rank, no_decay) for unit in layout.units}
