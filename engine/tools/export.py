"""A store's weights as a Hugging Face folder that ``from_pretrained`` loads with no other step.

The folder holds the weights as safetensors shards of at most ``max_shard_size`` bytes
(``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``, or one
``model.safetensors``), in the dtype asked (default: the checkpoint the run started from), and
the ``config.json`` and tokenizer files the run recorded in ``<store>/hf/``
(``engine.run.pretrained.record_source``).

The folder is what ``save_pretrained`` of the same model writes, key for key: the tensors'
names and layout on disk come from transformers' conversion rules reversed
(``engine.run.conversion.stored_plan``), so a mixture-of-experts model's stacked experts are
written one tensor per expert, under the names its checkpoints use. A model with no such rules
(a Llama, as the import recorded) is written under its parameters' names with no model built.

The model may be larger than memory, so nothing is held whole that need not be: each shard's
header follows from the store's layout alone, and the masters are read chunk by chunk, the
next few in flight (``engine.tools.consolidate.open_masters``), and cast once as they are
appended to the shard they belong to. A unit whose stored tensors are not slices of its
parameters (split experts are copies) is read whole, one unit at a time. Tied weights are
written once, under the name the layout records, as ``save_pretrained`` does. Each shard is
written under a temporary name and renamed when complete, and the index and config come
last: an export cut short leaves no folder that loads.

A run that trained LoRA adapters (``lora.r > 0``) exports its adapter alone, as peft's
``save_pretrained`` writes it (``export_adapter``): the adapters are small, read whole; the
frozen base is not read at all. With ``merged`` it exports the base with the adapters merged
in (``engine.tools.merge``), streamed as any other export, a folder that needs no peft.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from engine.run.conversion import BUFFER_DTYPES, StoredTensor, stored_plan, stored_tensors
from engine.run.pretrained import (
    BUFFERS_FILE,
    CONVERTED,
    INDEX_FILE,
    SINGLE_FILE,
    SOURCE_FOLDER,
    SOURCE_RECORD,
    WEIGHT_SUFFIXES,
    meta_model,
)
from engine.runtime.sizes import GIB, MIB
from engine.state.partition import ModelLayout, UnitLayout
from engine.tools.consolidate import Masters, Stores, header_bytes, open_masters, unit_values
from offload.streamed_file import StreamedFile

logger = logging.getLogger(__name__)

DTYPES = {"fp32": ("F32", torch.float32), "bf16": ("BF16", torch.bfloat16), "fp16": ("F16", torch.float16)}
CONFIG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SAFETENSORS_CODES = {torch_dtype: code for code, torch_dtype in BUFFER_DTYPES.items()}
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": MIB, "GIB": GIB}


def parse_size(text: str | int) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a number of bytes, as ``save_pretrained``'s max_shard_size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in SIZE_UNITS or float(match.group(1)) * SIZE_UNITS[unit] < 1:
        raise ValueError(f"max shard size {text!r} is not a size: write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


@dataclass
class Shard:
    """One output file: the tensors it holds, in the order they are written, and its header."""

    name: str
    tensors: list[StoredTensor]
    header: bytes
    nbytes: int


def plan_shards(plan: list[StoredTensor], dtype: str, max_bytes: int, metadata: dict[str, str]) -> list[Shard]:
    """Cut the stored tensors, in order, into files of at most ``max_bytes`` (a larger tensor has
    a file of its own), as ``save_pretrained`` does."""
    itemsize = {t.name: (t.dtype or DTYPES[dtype][1]).itemsize for t in plan}
    groups: list[list[StoredTensor]] = [[]]
    size = 0
    for tensor in plan:
        nbytes = tensor.numel * itemsize[tensor.name]
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    count = len(groups)
    shards = []
    for index, tensors in enumerate(groups, 1):
        entries: dict[str, object] = {"__metadata__": metadata | {"format": "pt"}}
        offset = 0
        for tensor in tensors:
            end = offset + tensor.numel * itemsize[tensor.name]
            code = SAFETENSORS_CODES[tensor.dtype] if tensor.dtype else DTYPES[dtype][0]
            entries[tensor.name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, end]}
            offset = end
        name = SINGLE_FILE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"
        shards.append(Shard(name, tensors, header_bytes(entries), offset))
    return shards


class _ShardWriter:
    """Appends values to the shards in order, each under a temporary name until complete."""

    def __init__(self, folder: Path, shards: list[Shard]):
        self.folder, self.shards = folder, shards
        self.current = -1
        self.out: StreamedFile | None = None
        self.header = 0

    def write(self, shard: int, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Append ``values`` to shard ``shard``, cast to ``dtype`` as they are staged."""
        while self.current < shard:
            self._next()
        assert self.out is not None
        self.out.write(values, dtype)

    def _next(self) -> None:
        self.finish()
        self.current += 1
        shard = self.shards[self.current]
        self.out = StreamedFile(self._temporary(shard))
        self.out.write_bytes(shard.header)
        self.header = len(shard.header)

    def _temporary(self, shard: Shard) -> Path:
        return self.folder / f".{shard.name}.tmp"

    def finish(self) -> None:
        """Complete the shard being written: all its bytes, on disk, under its real name."""
        if self.out is None:
            return
        shard = self.shards[self.current]
        written = self.out.written - self.header
        if written != shard.nbytes:
            raise ValueError(f"{shard.name}: wrote {written} bytes of {shard.nbytes}; the store's layout is corrupt")
        self.out.close()
        self.out = None
        os.replace(self._temporary(shard), self.folder / shard.name)

    def abort(self) -> None:
        if self.out is not None:
            self.out.abort()


def _write_shards(
    model: nn.Module | None,
    layout: ModelLayout,
    pieces: Iterable[tuple[UnitLayout, int, torch.Tensor]],
    shards: list[Shard],
    dtype: torch.dtype,
    folder: Path,
    buffers: dict[str, torch.Tensor],
) -> None:
    """Stream the ``pieces`` of ``layout``'s units (``Masters.pieces``) into the shards, cast to
    ``dtype``: a slice as its pieces come, a unit with computed tensors once it is whole; then
    the persistent ``buffers``, which the plan puts last."""
    shard_of = {tensor.name: index for index, shard in enumerate(shards) for tensor in shard.tensors}
    stored: dict[str, list[StoredTensor]] = {}
    for shard in shards:
        for tensor in shard.tensors:
            stored.setdefault(tensor.unit, []).append(tensor)
    writer = _ShardWriter(folder, shards)
    whole = _WholeUnits(model, layout, stored)
    try:
        with tqdm(total=sum(s.nbytes for s in shards), desc="export", unit="B", unit_scale=True, disable=None) as bar:
            for unit, offset, values in pieces:
                for tensor, part in whole.parts(unit, offset, values):
                    writer.write(shard_of[tensor.name], part, dtype)
                    bar.update(part.numel() * dtype.itemsize)
            for name, values in buffers.items():  # an integer buffer as it is
                writer.write(shard_of[name], values, dtype if values.is_floating_point() else values.dtype)
            writer.write(len(shards) - 1, torch.empty(0), dtype)  # opens any shard left (empty tensors)
            writer.finish()
    except BaseException:
        writer.abort()
        raise


class _WholeUnits:
    """The stored tensors' values from a unit's pieces, in their order: a slice's overlap with
    each piece, or, for a unit with computed tensors, all of them once its pieces are gathered."""

    def __init__(self, model: nn.Module | None, layout: ModelLayout, stored: dict[str, list[StoredTensor]]):
        self.model, self.stored = model, stored
        self.units = {unit.name: unit for unit in layout.all_units}
        self.gathering: torch.Tensor | None = None

    def parts(self, unit: UnitLayout, offset: int, values: torch.Tensor) -> Iterator[tuple[StoredTensor, torch.Tensor]]:
        tensors = self.stored.get(unit.name, [])
        if not tensors or tensors[0].offset is not None:
            end = offset + values.numel()
            for tensor in tensors:
                assert tensor.offset is not None
                low, high = max(tensor.offset, offset), min(tensor.offset + tensor.numel, end)
                if low < high:
                    yield tensor, values[low - offset : high - offset]
            return
        if offset == 0:
            self.gathering = torch.empty(unit.numel, dtype=torch.float32)
        assert self.gathering is not None
        self.gathering[offset : offset + values.numel()] = values
        if offset + values.numel() == unit.numel:
            flat, self.gathering = self.gathering, None
            made = stored_tensors(
                self.model,
                {slot.name: flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in unit.params},
            )
            for tensor in tensors:
                yield tensor, made[tensor.name].reshape(-1)


def source_files(store_path: Path) -> tuple[Path, dict[str, str]]:
    """The folder of config and tokenizer files a store recorded, and its ``source.json``."""
    folder = store_path / SOURCE_FOLDER
    try:
        record = json.loads((folder / SOURCE_RECORD).read_text())
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"store {store_path} records no Hugging Face model ({folder / SOURCE_RECORD} is missing or damaged): "
            f"only a run started with model.hf = FOLDER can be exported; consolidate writes its fp32 weights"
        ) from err
    return folder, record


def export(
    store_path: Stores,
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    generation: int | None = None,
    checkpoint: str | None = None,
    merged: bool = False,
) -> list[str]:
    """Write the store's weights (of ``generation`` or ``checkpoint``, default: as ``open_masters``
    chooses), config and tokenizer to ``out_dir`` as a Hugging Face folder (of the stores of a
    run's hosts: host 0's holds the config and tokenizer); a LoRA run's adapter, or with
    ``merged`` its merged model. Returns the names of the weight files written."""
    out_dir = Path(out_dir)
    max_bytes = parse_size(max_shard_size)
    with open_masters(store_path, generation, checkpoint) as masters:
        source, record = source_files(masters.reader.store.path)
        adapter = "lora" in record
        if merged and not adapter:
            raise ValueError(
                f"store {masters.metadata['source']} trained no LoRA adapters, so there is nothing to merge: "
                f"export it without --merged"
            )
        dtype = dtype or ("fp32" if adapter and not merged else record.get("dtype", "fp32"))
        if dtype not in DTYPES:
            raise ValueError(
                f"export dtype {dtype!r} is not one of {', '.join(DTYPES)}: pass --dtype bf16, fp16 or fp32"
            )
        if out_dir.is_dir() and any(
            p.name.endswith(WEIGHT_SUFFIXES) or p.name == INDEX_FILE for p in out_dir.iterdir()
        ):
            raise FileExistsError(f"{out_dir} already holds model weights: export into a new or empty folder")
        out_dir.mkdir(parents=True, exist_ok=True)
        if adapter and not merged:
            return export_adapter(masters, out_dir, source, record, dtype)
        layout, pieces = _merged(masters, source, record) if merged else (masters.layout, masters.pieces())
        model = rules_model(source) if record.get(CONVERTED, True) else None
        buffers = stored_tensors(model, _recorded_buffers(source))
        plan = stored_plan(model, layout) + [
            StoredTensor(n, tuple(b.shape), BUFFERS_FILE, None, None if b.is_floating_point() else b.dtype)
            for n, b in buffers.items()
        ]
        shards = plan_shards(plan, dtype, max_bytes, masters.metadata)
        _write_shards(model, layout, pieces, shards, DTYPES[dtype][1], out_dir, buffers)
        _write_side_files(source, out_dir, shards, dtype)
    logger.info(
        "exported %.1fM %s weights of %s (%s) to %s in %d file(s)",
        (layout.numel + layout.frozen_numel) / 1e6,
        dtype,
        store_path,
        masters.what,
        out_dir,
        len(shards),
    )
    return [shard.name for shard in shards]


def _merged(
    masters: Masters, source: Path, record: dict
) -> tuple[ModelLayout, Iterator[tuple[UnitLayout, int, torch.Tensor]]]:
    from engine.tools.merge import merged_pieces

    return merged_pieces(masters, trained_weights(masters), source, record)


def trained_weights(masters: Masters) -> dict[str, torch.Tensor]:
    """The trainable parameters' masters by name (a LoRA run's adapters: small, held whole);
    the frozen units, which come after them, are not read."""
    weights: dict[str, torch.Tensor] = {}
    for unit in masters.layout.units:
        flat = unit_values(masters, unit)
        weights |= {slot.name: flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in unit.params}
    return weights


def export_adapter(masters: Masters, out_dir: Path, source: Path, record: dict, dtype: str) -> list[str]:
    """A LoRA run's trained adapter, written by peft's ``save_pretrained`` (``adapter_config.json``
    naming the pretrained folder, ``adapter_model.safetensors``): ``PeftModel.from_pretrained(base,
    out_dir)`` loads it. Returns the weight files written."""
    from engine.config import LoraConfig
    from engine.run.lora import with_lora

    adapters = trained_weights(masters)
    model: Any = with_lora(meta_model(source), LoraConfig(**record["lora"]))  # a PeftModel
    model.peft_config["default"].base_model_name_or_path = record["folder"]  # not the store's copy of its config
    cast = {name: values.to(DTYPES[dtype][1]) for name, values in adapters.items()}
    unexpected = model.load_state_dict(cast, strict=False, assign=True).unexpected_keys
    if unexpected:
        raise ValueError(
            f"store {masters.metadata['source']} holds {unexpected[0]!r}, which the LoRA model its {SOURCE_RECORD} "
            f"describes has "
            f"not: the store and its record do not match"
        )
    model.save_pretrained(out_dir)
    logger.info(
        "exported the %.2fM-parameter %s LoRA adapter of %s to %s",
        masters.layout.numel / 1e6,
        dtype,
        masters.metadata["source"],
        out_dir,
    )
    return sorted(p.name for p in out_dir.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))


def rules_model(source: Path) -> nn.Module | None:
    """The model whose conversion rules the export follows, on the meta device; ``None`` for a
    config transformers does not know (a custom model), which has none: its names are stored as
    the store holds them. Only a store whose ``source.json`` records its model ``CONVERTED`` (or
    does not say) asks for it: building it imports transformers' model code, seconds of an
    export's start."""
    try:
        return meta_model(source)
    except (ValueError, KeyError) as err:
        logger.info("no conversion rules for %s (%s): tensors keep the store's names", source / "config.json", err)
        return None


def _recorded_buffers(source: Path) -> dict[str, torch.Tensor]:
    """The persistent buffers the run's checkpoint held (``record_source``), by model name."""
    from safetensors.torch import load_file

    path = source / BUFFERS_FILE
    return load_file(path) if path.is_file() else {}


def _write_side_files(source: Path, out_dir: Path, shards: list[Shard], dtype: str) -> None:
    """The tokenizer and config files, the config naming the weights' dtype, and the index last."""
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in (SOURCE_RECORD, BUFFERS_FILE, "config.json"):
            shutil.copyfile(path, out_dir / path.name)
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = CONFIG_DTYPES[dtype]
    if "torch_dtype" in config:
        config["torch_dtype"] = CONFIG_DTYPES[dtype]
    _write_json(out_dir / "config.json", config)
    if len(shards) > 1:
        weight_map = {tensor.name: shard.name for shard in shards for tensor in shard.tensors}
        total = sum(shard.nbytes for shard in shards)
        _write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)
