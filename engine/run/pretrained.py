"""A pretrained Hugging Face causal LM, streamed into the engine one unit at a time.

The model is built from the folder's ``config.json`` on the ``meta`` device (no memory), and
``Pretrained`` is the engine's ``init_unit``: when the engine materialises a unit, it reads just
that unit's tensors from the folder's safetensors files (one file or several with
``model.safetensors.index.json``; fp32, bf16 or fp16) and casts them into its parameters
(fp32, or the compute dtype where the masters share it). So a model larger than memory
imports, on any tier and any world size (each rank reads whole units and keeps its shard).

The checkpoint's names and layout are converted to the model's by transformers' own rules
(``engine.run.conversion``): renamed keys, and one tensor per expert on disk stacked into the
model's fused expert tensors. Everything that can be checked is checked before any work, from
the files' headers alone and after conversion: a tensor the model needs but the checkpoint
lacks, one it holds but the model has no place for, a shape that differs (each named on disk
and in the model), a dtype that is not a float, a file cut short. A weight the model ties to
another (GPT-2's ``lm_head`` is its token embedding) is loaded once, under whichever of its
names the checkpoint holds; a persistent buffer the checkpoint holds is loaded with the model.

The folder's other files (``config.json``, the tokenizer's) are copied into ``<store>/hf/``
(``record_source``) so that ``python -m engine export`` can write a folder that
``from_pretrained`` loads with no other input.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from engine.config import Config
from engine.config_sections import SOURCE_FOLDER, SOURCE_RECORD
from engine.run.conversion import converts, match_checkpoint
from engine.run.loss import chunked_cross_entropy
from engine.run.read_ahead import SAFETENSORS_DTYPES, CheckpointReadAhead, CheckpointTensor, read_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.engine import Engine

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BUFFERS_FILE = "buffers.safetensors"
"""The persistent buffers the checkpoint holds, kept beside ``source.json`` for ``export``."""
CONVERTED = "converted"
"""The key of ``source.json`` saying whether ``save_pretrained`` stores the model's tensors under
other names or layouts (``engine.run.conversion.converts``): if not, ``export`` needs no model."""
DTYPE_NAMES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
ITEM_BYTES = {name: dtype.itemsize for name, dtype in SAFETENSORS_DTYPES.items()}
"""Bytes per element of each safetensors dtype, to check a header's offsets."""
ENCODE_BATCH = 1024  # lines the tokenizer encodes at once
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the ones its index names, or its one file."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index ({err}): write the checkpoint again") from err
        for name in names:
            if Path(name).name != name:
                raise ValueError(f"{index} names the file {name!r} outside its folder: the index is corrupt")
        return [folder / name for name in names]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise FileNotFoundError(
        f"{folder} holds no {SINGLE_FILE} and no {INDEX_FILE}: give the folder that save_pretrained wrote "
        f"(safetensors weights; convert .bin weights with save_pretrained(safe_serialization=True))"
    )


def read_header(path: Path) -> dict[str, CheckpointTensor]:
    """The tensors of one safetensors file, from its header; refuses a file cut short or corrupt."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing: copy the whole checkpoint folder")
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if length < 0 or 8 + length > size:
            raise ValueError(f"checkpoint file {path} is truncated (its header is cut short): copy it again")
        try:
            header = json.loads(file.read(length))
        except ValueError as err:
            raise ValueError(f"checkpoint file {path} has a corrupt header ({err}): copy it again") from err
    tensors, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"checkpoint file {path}: tensor {name!r} has a corrupt header entry: copy it again"
            ) from err
        if dtype not in ITEM_BYTES or stop - start != math.prod(shape) * ITEM_BYTES[dtype]:
            raise ValueError(f"checkpoint file {path}: tensor {name!r} has a corrupt header entry: copy it again")
        tensors[name] = CheckpointTensor(path, dtype, shape, 8 + length + start, stop - start)
        end = max(end, stop)
    if 8 + length + end > size:
        raise ValueError(
            f"checkpoint file {path} is truncated ({size} bytes, its tensors need {8 + length + end}): copy it again"
        )
    return tensors


def read_headers(folder: Path) -> dict[str, CheckpointTensor]:
    """Every tensor of a checkpoint folder, from the headers of its files."""
    tensors: dict[str, CheckpointTensor] = {}
    for path in checkpoint_files(folder):
        for name, tensor in read_header(path).items():
            if name in tensors:
                raise ValueError(
                    f"checkpoint tensor {name!r} is in both {tensors[name].file.name} and {path.name} in {folder}: "
                    f"the checkpoint is corrupt; write it again"
                )
            tensors[name] = tensor
    return tensors


class Pretrained:
    """The ``init_unit`` that fills a meta-built model's units from a checkpoint folder, checked
    against the model first (``Engine(model, config, init_unit=Pretrained(folder, model))``).

    The checkpoint is read through transformers' conversion rules (``engine.run.conversion``):
    a unit's parameters are made by the conversions that make them, each reading its tensors
    from the files and, for a stacked expert tensor, stacking that layer's experts."""

    copies_values = True
    """Every value is copied from the checkpoint (none is drawn or computed), so the engine may
    build units straight in the compute dtype where the masters share it (``build_units``)."""

    def __init__(self, folder: str | os.PathLike[str], model: nn.Module):
        self.folder = Path(folder)
        self.model = model
        self.tensors = read_headers(self.folder)
        self.match = match_checkpoint(model, self.tensors, self.folder)
        self._ahead: CheckpointReadAhead | None = None
        self._read(list(dict.fromkeys(self.match.buffers.values())), self._set_buffer)

    def buffer_values(self) -> dict[str, torch.Tensor]:
        """The persistent buffers the checkpoint holds, by model name, as stored."""
        values: dict[str, torch.Tensor] = {}

        def keep(name: str, tensor: torch.Tensor) -> None:
            if name in self.match.buffers:
                values[name] = tensor.contiguous()

        self._read(list(dict.fromkeys(self.match.buffers.values())), keep)
        return values

    def _set_buffer(self, name: str, values: torch.Tensor) -> None:
        """A persistent buffer the checkpoint holds, in place of the meta one (which the engine
        would otherwise compute from the model's code, losing what training made of it)."""
        if name in self.match.buffers:
            module, _, key = name.rpartition(".")
            owner = self.model.get_submodule(module)
            meta = owner._buffers[key]
            assert meta is not None
            owner._buffers[key] = values.to(meta.dtype)

    @property
    def dtype(self) -> str:
        """The checkpoint's dtype (``fp32``, ``bf16``, ``fp16``): that of most of its elements."""
        counts: dict[str, int] = {}
        for group in self.match.conversions.values():
            for name in group.names:
                tensor = self.tensors[name]
                counts[tensor.dtype] = counts.get(tensor.dtype, 0) + math.prod(tensor.shape)
        return DTYPE_NAMES[max(counts, key=lambda d: counts[d])] if counts else "fp32"

    def __call__(self, params: dict[str, torch.Tensor]) -> None:
        """Make one unit's parameters (by their first names) from the checkpoint, cast to their
        dtype. The first call starts reading every parameter's tensors ahead, in the order the
        engine builds its units (``_build_order``)."""
        firsts = list(dict.fromkeys(self.match.made_by[name] for name in params))

        def fill(target: str, values: torch.Tensor) -> None:
            param = self.match.param_of.get(target)
            if param in params:
                params[param].copy_(values)

        if self._ahead is None:
            self._ahead = CheckpointReadAhead(
                self.tensors, self._build_order(self.match.conversions[firsts[0]].names[0])
            )
            weakref.finalize(self, self._ahead.close)  # a build that failed leaves the rest unread
        self._read(firsts, fill, self._ahead.take)

    def _build_order(self, first: str) -> list[str]:
        """The checkpoint names of the model's parameters in the model's order, from ``first``
        (the tensor the engine asked for first) round to the one before it: the engine builds
        the units in the model's order but for the root unit (what the others leave over: the
        embedding, the final norm and the head), which it builds last."""
        made_by = self.match.made_by
        groups = dict.fromkeys(made_by[name] for name, _ in self.model.named_parameters() if name in made_by)
        order = [name for group in groups for name in self.match.conversions[group].names]
        start = order.index(first) if first in order else 0
        return order[start:] + order[:start]

    def _read(
        self,
        firsts: list[str],
        put: Callable[[str, torch.Tensor], None],
        take: Callable[[str], torch.Tensor] | None = None,
    ) -> None:
        """Run the conversions ``firsts`` (by first target) on the checkpoint's tensors, each got
        by ``take(checkpoint name)`` (by default read now), handing each tensor they make to
        ``put(model name, values)``."""
        groups = [self.match.conversions[first] for first in firsts]
        get = take or (lambda name: read_tensor(self.tensors[name]))
        with torch.no_grad():
            for group in groups:
                made = group.run(get, self.model)
                for target, values in made.items():
                    put(target, values)
                del made


def meta_model(folder: str | os.PathLike[str]) -> nn.Module:
    """The causal LM that ``folder/config.json`` describes, on the meta device (no memory)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("model.hf needs Hugging Face 'transformers': pip install transformers") from err
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model.hf = {str(folder)!r} holds no config.json: give the folder that save_pretrained wrote"
        )
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def record_source(
    folder: str | os.PathLike[str], store: str | os.PathLike[str], dtype: str, lora: dict[str, Any] | None = None
) -> Path:
    """Copy the checkpoint folder's files other than weights (config, tokenizer) into
    ``<store>/hf/``, with the persistent buffers it holds (``BUFFERS_FILE``) and ``source.json``
    naming the folder, its dtype, whether its checkpoint stores the tensors under other names
    (``CONVERTED``, for a checkpoint read) and the run's ``[lora]`` settings if it trains
    adapters, for ``export`` and ``generate``."""
    folder, target = Path(folder), Path(store) / SOURCE_FOLDER
    staging = target.with_name(f".{SOURCE_FOLDER}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name != INDEX_FILE:
            shutil.copyfile(path, staging / path.name)
    weighed = (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()  # not a model built from config
    model = meta_model(folder) if weighed else None
    buffers = Pretrained(folder, model).buffer_values() if model is not None else {}
    if buffers:
        from safetensors.torch import save_file

        save_file(buffers, staging / BUFFERS_FILE)
    record: dict[str, Any] = {"folder": str(folder.resolve()), "dtype": dtype}
    record |= {CONVERTED: converts(model)} if model is not None else {}  # unsaid: export asks the model
    record |= {"lora": lora} if lora else {}
    (staging / SOURCE_RECORD).write_text(json.dumps(record) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def source_keeper(config: Config, dtype: str) -> Callable[[], None]:
    """What records a ``model.hf`` run's config and tokenizer in its store, for ``export``
    (``record_source``, on rank 0): done now if the store is there (the nvme tiers make it as
    they start), else once the first checkpoint has made it (the memory tiers)."""
    store, hf = Path(config.offload.store_path), config.model.hf
    lora = dataclasses.asdict(config.lora) if config.lora.r else None
    recorded = not hf

    def keep() -> None:
        nonlocal recorded
        if not recorded and store.is_dir():
            record_source(hf, store, dtype, lora)
            recorded = True

    keep()
    return keep


def check_vocabulary(model: nn.Module, vocab_size: int, folder: str) -> None:
    """Refuse data whose token ids the model has no embedding for."""
    hf: Any = model  # a PreTrainedModel, whose methods nn.Module's typing does not know
    rows = hf.get_input_embeddings().num_embeddings
    if vocab_size > rows:
        raise ValueError(
            f"the data has {vocab_size} token ids but the model in {folder} embeds {rows}: tokenise with the "
            f"model's own tokenizer (model.hf does, for a text corpus), not a .bin file of another"
        )


def max_positions(model: nn.Module) -> int | None:
    """The most positions a Hugging Face model takes, as its config says (None: it does not)."""
    settings = model.config
    return getattr(settings, "n_positions", None) or getattr(settings, "max_position_embeddings", None)


class RecordedSource:
    """The ``init_unit`` of a ``model.hf`` run that resumes: its store holds every value, and in
    ``hf/`` the model's config and tokenizer (``record_source``), so the source checkpoint is
    not read again, and may be gone (deleted after the import to make room)."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.dtype: str = json.loads((Path(folder) / SOURCE_RECORD).read_text())["dtype"]

    def __call__(self, params: dict[str, torch.Tensor]) -> None:
        raise RuntimeError("a resumed run builds no unit from its source checkpoint: its store holds them")


def recorded_folder(store: Path) -> str | None:
    """The store's copy of its ``model.hf`` run's config and tokenizer (``record_source``), if
    it has one: a run that resumes reads them there, not from the source checkpoint."""
    folder = store / SOURCE_FOLDER
    return str(folder) if (folder / SOURCE_RECORD).is_file() else None


def pretrained_model(
    folder: str, seq_len: int, recorded: bool = False
) -> tuple[nn.Module, Pretrained | RecordedSource]:
    """The meta model of ``folder`` and its ``init_unit``, checked against the checkpoint (or,
    ``recorded``, the store's ``hf/`` folder of a run that resumes), and refused if it cannot
    take sequences of ``seq_len``."""
    model = meta_model(folder)
    init = RecordedSource(folder) if recorded else Pretrained(folder, model)
    positions = max_positions(model)
    if positions is not None and seq_len > positions:
        raise ValueError(
            f"data.seq_len = {seq_len} is longer than the {positions} positions the model in {folder} was "
            f"trained for: set data.seq_len to at most {positions}"
        )
    return model, init


def causal_lm_loss(
    engine: Engine, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The next-token loss of a causal LM on inputs ``x`` and their shifted targets ``y`` (-100:
    not counted), its logits never made whole (``chunked_cross_entropy``). ``positions``
    (``[batch, seq]``) are packed examples' position ids, given to the model as ``position_ids``:
    transformers then keeps attention within each example.

    The model runs through the engine's forward, asked for its hidden states and the logits of
    the last position alone (``logits_to_keep=1``), and the loss is computed inside that call,
    by a forward hook that runs before the engine's own: at stage 3 the root unit, which holds
    the head, is still gathered then. The loss becomes the model's output, so the engine's hook
    arms the root's re-gather on the loss's gradient, which arrives before the loss's backward
    recomputes the logits: that recompute reads the head's real weight even when the root was
    released after forward. (It is on the first step, whose order is not yet traced, and when
    the device budget is short; otherwise it stays gathered, being the next unit to run.) At
    stages 1 and 2 every unit stays gathered."""
    model: Any = engine.module
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"the model's output head is a {type(head).__module__}.{type(head).__qualname__}, not an nn.Linear "
            f"(a LoRA adapter on it?): the chunked loss needs its plain weight; leave the head out of "
            f"lora.target_modules"
        )

    def loss_of(module: nn.Module, args: Any, output: Any) -> torch.Tensor:
        hidden = _head_input(output, head)
        return chunked_cross_entropy(hidden, head.weight, y.to(hidden.device), head.bias)

    handle = model.register_forward_hook(loss_of, prepend=True)
    try:
        packed = {} if positions is None else {"position_ids": positions}
        # No cache: training keeps no keys and values, and with one transformers ignores packing.
        return engine(input_ids=x, logits_to_keep=1, output_hidden_states=True, use_cache=False, **packed)
    finally:
        handle.remove()


def _head_input(output: Any, head: nn.Linear) -> torch.Tensor:
    """The last hidden state of a causal LM's ``output``, checked to be what its head turns into
    its logits on the one position it made them for: a model that changes its logits after the
    head (Gemma 2's soft-capping, Cohere's scale) is refused, as the chunked loss is not its loss."""
    states = getattr(output, "hidden_states", None)
    if not states:
        raise ValueError(
            f"the model returned no hidden states ({type(output).__name__}): causal_lm_loss needs a transformers "
            f"causal LM that takes output_hidden_states and logits_to_keep"
        )
    hidden = states[-1]
    if head.weight.untyped_storage().nbytes() == 0:
        raise RuntimeError(
            "the output head's parameters are released where the loss needs them: keep the head in the root "
            "unit (leave its class out of zero.unit_classes)"
        )
    with torch.no_grad():
        made = F.linear(hidden[:, -1:], head.weight, head.bias)
    if not torch.allclose(made.float(), output.logits.float(), rtol=1e-5, atol=1e-6):
        raise ValueError(
            "the model's logits are not its output head applied to its last hidden state (soft-capped or "
            "scaled?): causal_lm_loss cannot chunk its loss; compute it from engine(input_ids=x).logits"
        )
    return hidden


def tokenizer_digest(folder: str | os.PathLike[str]) -> str:
    """A digest of the folder's tokenizer files: tokens cached for one tokenizer are never
    taken for another's."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and path.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def load_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the model folder ``folder``, offline, for text of any length."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"model.hf = {folder!r}: its tokenizer does not load ({err}); save it into the folder with "
            f"tokenizer.save_pretrained, or give a pre-tokenised .bin data.source"
        ) from err
    tokenizer.model_max_length = 1 << 62  # a long line is data, not an overflow
    return tokenizer


def encode(folder: str, lines: list[str]) -> tuple[np.ndarray, int]:
    """Token ids of ``lines`` (joined, no special tokens added) by the tokenizer in ``folder``,
    and its vocabulary size, offline."""
    tokenizer = load_tokenizer(folder)

    def ids() -> Iterator[int]:
        for start in range(0, len(lines), ENCODE_BATCH):
            for row in tokenizer(lines[start : start + ENCODE_BATCH], add_special_tokens=False)["input_ids"]:
                yield from row

    return np.fromiter(ids(), dtype=np.uint32), len(tokenizer)
