"""Full fp32 weights out of a store, as one ``.safetensors`` file under the model's own names.

The masters in the store are the weights (sharded and padded per unit), with the frozen
units' values stored once beside them (``engine.tiers.frozen``): those of the committed
generation, or of a kept checkpoint, which is all a store of the memory tiers (``offload.optimizer``
``cpu`` or ``device``) holds, in the same layout. The layout saved with the
store names every parameter and its place, so no model class is needed. The model may be
larger than memory, so the file is written by streaming: the safetensors header is known
from the layout alone and goes first, then each unit's master is read chunk by chunk (the
next few in flight) and its bytes appended, padding dropped. Units are written in layout
order and each unit's parameters lie end to end from offset 0, so the file's data section is
exactly the units' masters cut to their real length, one after another.

Tied weights: a parameter shared by several modules is stored once, under the name the
layout records (the first name ``named_parameters`` gives, e.g. ``tok_emb.weight`` for a
GPT whose head shares the embedding). Load such a file with
``model.load_state_dict(weights, strict=False)``: the only missing keys are the aliases of
the tied weight, which already share the loaded tensor.

The file is written to a temporary name beside ``out_path`` and renamed when complete, so
a crash never leaves a truncated file under the real name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.runtime.sizes import FP32
from engine.state.forms import StateForm
from engine.state.partition import ModelLayout, UnitLayout
from engine.tiers.frozen import frozen_array
from engine.tiers.store_checks import naming_way_out
from engine.tools.gather import gathered
from engine.tools.inspect import IO_THREADS, committed_record, open_store, store_layout
from offload import ChunkReader, Generations, IORunner, ShardStore, array_name, generation_prefix
from offload.streamed_file import StreamedFile

logger = logging.getLogger(__name__)

HEADER_ALIGN = 8  # safetensors pads its header with spaces so the data starts 8-byte aligned


@dataclass
class Masters:
    """The masters of one step of a store (a generation or a checkpoint), read chunk by chunk
    with the next chunks in flight, and handed out in the dtype stored (``optim.master_dtype``)."""

    layout: ModelLayout
    prefix: str
    """The group holding the masters: a generation, or a kept checkpoint."""
    what: str
    """Which step they are, for a reader (``generation 3``, ``checkpoint step-4``)."""
    metadata: dict[str, str]
    """What a weights file written from them says of them (source store, generation, step)."""
    reader: ChunkReader
    master_dtype: torch.dtype = torch.float32
    """The dtype the store records its masters in."""

    def pieces(self, units: Iterable[UnitLayout] | None = None) -> Iterator[tuple[UnitLayout, int, torch.Tensor]]:
        """Each unit's master in layout order, then each frozen unit's values, padding dropped,
        as ``(unit, offset, values)``: the values of elements ``[offset, offset + len(values))``
        of the unit, in the dtype stored (fp32, or bf16 masters: the consumer casts once, as it
        writes), in a reused buffer valid until the next piece. ``units``: those units alone."""
        by_array = {unit_array(self.prefix, unit): unit for unit in (self.layout.all_units if units is None else units)}
        for name, unit in by_array.items():
            self._check(name, unit)
        for name, offset, values in self.reader.contents((name, unit.numel) for name, unit in by_array.items()):
            yield by_array[name], offset, values

    def _check(self, name: str, unit: UnitLayout) -> None:
        """Refuse an array that cannot hold ``unit``'s values, before anything is read."""
        info = self.reader.infos[name]
        if (unit.trainable and info.dtype != self.master_dtype) or not info.dtype.is_floating_point:
            raise ValueError(
                f"array {name!r} in {self.reader.store.path} holds {info.dtype} elements, but unit {unit.name!r} "
                f"needs {f'{self.master_dtype} masters' if unit.trainable else 'float values'}; the store does "
                f"not match its layout"
            )
        if info.numel < unit.numel:
            raise ValueError(
                f"array {name!r} in {self.reader.store.path} holds {info.numel} elements, but unit "
                f"{unit.name!r} needs {unit.numel}; the store does not match its layout"
            )


def unit_values(masters: Masters, unit: UnitLayout) -> torch.Tensor:
    """One unit's weights whole, in fp32 (its master, or a frozen unit's values)."""
    flat = torch.empty(unit.numel, dtype=torch.float32)
    for _, offset, values in masters.pieces([unit]):
        flat[offset : offset + values.numel()] = values
    return flat


def unit_array(prefix: str, unit: UnitLayout) -> str:
    """The array holding a unit's weights: its master in the group ``prefix``, or a frozen unit's values."""
    return array_name(prefix, unit.name, "master") if unit.trainable else frozen_array(unit)


Stores = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
"""One store, or the stores of every host of one run (``offload.nvme_path`` with ``{node}``)."""


@contextlib.contextmanager
def open_masters(stores: Stores, generation: int | None = None, checkpoint: str | None = None) -> Iterator[Masters]:
    """The masters of the store at ``stores`` (or of the stores of a run's hosts read as one,
    ``engine.tools.gather.gathered``): of ``generation``, of the kept ``checkpoint``, or by
    default of the committed generation, else (a store of the memory tiers, which commit no live
    state) of the checkpoint kept last."""
    if generation is not None and checkpoint is not None:
        raise ValueError("pass --generation N or --checkpoint TAG, not both: each names the step to read")
    paths = [stores] if isinstance(stores, (str, os.PathLike)) else list(stores)
    with gathered(paths) as path, IORunner(threads=IO_THREADS) as runner:
        store = open_store(Path(path), runner)
        layout = store_layout(store)
        if checkpoint is None and generation is None and committed_record(store) is None:
            checkpoint = Generations(store).latest_checkpoint()
            if checkpoint is not None:
                logger.info(
                    "%s commits no live step (a memory tier's store): reading its last checkpoint, %s",
                    store.path,
                    checkpoint,
                )
        if checkpoint is not None:
            prefix, what, metadata = _choose_checkpoint(store, checkpoint)
        else:
            prefix, what, metadata = _choose_generation(store, generation)
        metadata["source"] = ", ".join(map(str, paths))
        reader = ChunkReader(store, (unit_array(prefix, u) for u in layout.all_units))
        master_dtype = StateForm.stored(store.attrs).dtypes()[0]
        yield Masters(layout, prefix, what, metadata, reader, master_dtype)


def consolidate(
    store_path: Stores,
    out_path: str | os.PathLike[str],
    generation: int | None = None,
    checkpoint: str | None = None,
) -> int:
    """Write the fp32 weights of ``generation`` or ``checkpoint`` (default: as ``open_masters``
    chooses) of the store at ``store_path`` (or of the stores of a run's hosts) to the
    safetensors file ``out_path``; return the number of tensors."""
    out_path = Path(out_path)
    if not out_path.parent.is_dir():
        raise FileNotFoundError(
            f"cannot write {out_path}: its folder {out_path.parent} does not exist; create it first"
        )
    with open_masters(store_path, generation, checkpoint) as masters:
        layout = masters.layout
        header = safetensors_header(layout, masters.metadata)
        fd, tmp_name = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the weights from other users
        os.close(fd)
        try:
            with StreamedFile(tmp_name) as out:
                out.write_bytes(header)
                _write_masters(masters, out)
                out.close()
            os.replace(tmp_name, out_path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)  # the stream removes its own file; not one it never opened
            raise
    count = sum(len(u.params) for u in layout.all_units)
    logger.info(
        "wrote %d tensors (%.1fM fp32 weights) of %s (%s) to %s",
        count,
        (layout.numel + layout.frozen_numel) / 1e6,
        store_path,
        masters.what,
        out_path,
    )
    return count


def _choose_checkpoint(store: ShardStore, tag: str) -> tuple[str, str, dict[str, str]]:
    """Where the kept checkpoint ``tag`` is, its name, and what the file's metadata says about it."""
    generations = Generations(store)
    with naming_way_out(generations):
        prefix, record = generations.checkpoint(tag)
    metadata = {"format": "pt", "source": str(store.path), "checkpoint": tag, "generation": str(record["generation"])}
    if "step" in record:
        metadata["step"] = str(record["step"])
    return prefix, f"checkpoint {tag}", metadata


def _choose_generation(store: ShardStore, generation: int | None) -> tuple[str, str, dict[str, str]]:
    """Where the generation to read is, its name, and what the file's metadata says about it."""
    record = committed_record(store)
    on_disk = Generations(store).on_disk()
    if generation is None:
        if record is None and (Generations(store).is_new() or not on_disk):
            raise ValueError(
                f"offload store {store.path} holds nothing to read: the run that made it committed no step and kept no "
                f"checkpoint (it stopped before its first commit); train into it first"
            )
        if record is None:
            raise ValueError(
                f"offload store {store.path} has no committed generation (no COMMITTED file) and keeps no "
                f"checkpoint; pass --generation N (in Python: generation=N) to read one of the generations on disk, "
                f"{on_disk}, at your own risk"
            )
        generation = record["generation"]
    if generation not in on_disk:
        raise FileNotFoundError(
            f"generation {generation} is not on disk in offload store {store.path} (generations present: "
            f"{on_disk}); pass one of those as --generation N (in Python: generation=N)"
        )
    metadata = {"format": "pt", "source": str(store.path), "generation": str(generation)}
    if record is not None and record["generation"] == generation and "step" in record:
        metadata["step"] = str(record["step"])
    return generation_prefix(generation), f"generation {generation}", metadata


def safetensors_header(layout: ModelLayout, metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding every parameter of
    ``layout`` in fp32, its data laid out unit by unit in layout order."""
    entries: dict[str, object] = {"__metadata__": metadata}
    base = 0
    for unit in layout.all_units:
        end = 0
        for slot in unit.params:
            if slot.offset != end or slot.numel != math.prod(slot.shape):
                raise ValueError(
                    f"layout of unit {unit.name!r}: parameter {slot.name!r} (offset {slot.offset}, numel "
                    f"{slot.numel}, shape {list(slot.shape)}) does not follow the previous parameter end to end "
                    f"(expected offset {end}) or its numel is not its shape's; the store's layout is corrupt"
                )
            entries[slot.name] = {
                "dtype": "F32",
                "shape": list(slot.shape),
                "data_offsets": [base + slot.offset * FP32, base + (slot.offset + slot.numel) * FP32],
            }
            end += slot.numel
        if end != unit.numel:
            raise ValueError(
                f"layout of unit {unit.name!r}: its parameters cover {end} elements but the unit has {unit.numel}; "
                f"the store's layout is corrupt"
            )
        base += unit.numel * FP32
    return header_bytes(entries)


def header_bytes(entries: dict[str, object]) -> bytes:
    """A safetensors file's length prefix and JSON header, padded so that its data starts aligned."""
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGN)
    return len(text).to_bytes(8, "little") + text


def _write_masters(masters: Masters, out: StreamedFile) -> None:
    """Append each unit's master, cut to its real length, one chunk at a time."""
    total = (masters.layout.numel + masters.layout.frozen_numel) * FP32
    with tqdm(total=total, desc="consolidate", unit="B", unit_scale=True, disable=None) as bar:
        for _, _, values in masters.pieces():
            out.write(values, torch.float32)
            bar.update(values.numel() * FP32)
