"""Fine-tuning records in, as the field writes them: tokens, and which of them the loss counts.

A record is in one of the four forms TRL's ``SFTTrainer`` documents: ``{"text"}``;
``{"messages": [{"role", "content"}, ...]}`` (the chat format of OpenAI and Hugging Face);
``{"prompt", "completion"}`` as strings; or the same as lists of messages. The form is told by
the fields (``data.format`` forces one). Chat records are rendered by the tokenizer's own chat
template, as text, then tokenised once with character offsets: a token is in the loss when it
starts inside a reply, so the mask never depends on how a template's pieces would tokenise
apart. A template that does not render a conversation's beginning as a prefix of the whole
cannot say where a reply starts, and is refused by name.

Records are read through Hugging Face ``datasets``: files become Arrow tables on disk,
memory-mapped, and tokenising is a cached ``map`` (one pass, with a progress bar, redone only
when the records, the tokenizer or these settings change), so a data set larger than memory is
never loaded whole.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffixes of records, and the ``datasets`` builder that reads each."""
FORMS = ("text", "messages", "prompt_completion")
"""The record forms; ``prompt_completion`` takes strings or lists of messages."""
FIELDS = {"text": ("text",), "messages": ("messages",), "prompt_completion": ("prompt", "completion")}
SAVED_DATASET = "dataset_info.json"
"""The file ``datasets.Dataset.save_to_disk`` writes in its folder."""


def is_records(source: str) -> bool:
    """Whether ``data.source`` names records (a file of them, a folder of them, or a saved data
    set) rather than a text corpus or a token file."""
    path = Path(source)
    if path.is_file():
        return path.suffix in RECORD_SUFFIXES
    return path.is_dir() and ((path / SAVED_DATASET).is_file() or bool(_record_files(path)))


def _record_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in RECORD_SUFFIXES)


def load_records(source: str, cache_dir: Path) -> datasets.Dataset:
    """The records of ``source`` as an Arrow-backed data set, converted once into ``cache_dir``."""
    import datasets

    path = Path(source)
    if path.is_dir() and (path / SAVED_DATASET).is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(
                    f"data.source = {source!r} holds the splits {', '.join(loaded)} and no 'train': save the "
                    f"split to train on alone, or name it train"
                )
            loaded = loaded["train"]
        return loaded
    files = [path] if path.is_file() else _record_files(path)
    kinds = {RECORD_SUFFIXES[f.suffix] for f in files}
    if len(kinds) > 1:
        raise ValueError(f"data.source = {source!r} mixes JSON and Parquet files: keep one kind in the folder")
    return datasets.load_dataset(
        kinds.pop(), data_files=[str(f) for f in files], split="train", cache_dir=str(cache_dir / "records")
    )


def detect_form(columns: Sequence[str], forced: str, source: str) -> str:
    """The form of the records with these fields, or ``forced`` (``data.format``) if not ``auto``."""
    if forced != "auto":
        missing = [f for f in FIELDS[forced] if f not in columns]
        if missing:
            raise ValueError(
                f"data.format = {forced!r} needs the field(s) {', '.join(missing)}, which the records of "
                f"{source!r} lack (they have {', '.join(columns)})"
            )
        return forced
    for form in ("messages", "prompt_completion", "text"):
        if all(f in columns for f in FIELDS[form]):
            return form
    raise ValueError(
        f"the records of {source!r} have the fields {', '.join(columns)}: a record holds 'text', 'messages', or "
        f"'prompt' and 'completion' (TRL's forms)"
    )


@dataclass
class Segment:
    """A piece of a record's text, tokenised on its own: with the tokenizer's own special tokens
    (``specials``: a BOS before a prompt) or not, its tokens counted by the loss all (True), none
    (False), or those that start inside one of ``replies`` (character spans)."""

    text: str
    specials: bool
    counted: bool | list[tuple[int, int]]


class RecordTokenizer:
    """Turns records of a form into ``(input_ids, in_loss)``: ``in_loss[i]`` says whether token
    ``i`` is a target the loss counts (a reply's, with ``train_on = "completion"``). A batch of
    records is tokenised in one call of the (Rust) tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, form: str, train_on: str, source: str):
        self.tokenizer, self.form, self.source = tokenizer, form, source
        self.everything = train_on == "all" or form == "text"
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token, which ends each example: set tokenizer.eos_token")
        chat = form == "messages"
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the records of {source!r} are chat messages, but the tokenizer has no chat template to render them: "
                f"save one with the tokenizer (tokenizer.chat_template = ...; save_pretrained), or give "
                f"prompt/completion or text records"
            )

    def __call__(self, record: dict[str, Any], line: int) -> tuple[list[int], list[int]]:
        [ids], [in_loss] = self.batch([record], [line])
        return ids, in_loss

    def batch(self, records: list[dict[str, Any]], lines: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Each record's tokens and in-loss flags (``lines``: their record numbers, for messages)."""
        plans = [self.segments(record, line) for record, line in zip(records, lines, strict=True)]
        flat = [segment for segments, _ in plans for segment in segments]
        tokens: list[tuple[list[int], list[int]]] = [([], [])] * len(flat)
        for specials in (True, False):
            chosen = [i for i, segment in enumerate(flat) if segment.specials == specials]
            if not chosen:
                continue
            encoded = self.tokenizer(
                [flat[i].text for i in chosen], add_special_tokens=specials, return_offsets_mapping=True
            )
            for i, ids, offsets in zip(chosen, encoded["input_ids"], encoded["offset_mapping"], strict=True):
                tokens[i] = (ids, self._counted(flat[i].counted, offsets))
        out_ids, out_loss = [], []
        at = 0
        for segments, eos in plans:
            ids = [i for ids, _ in tokens[at : at + len(segments)] for i in ids]
            in_loss = [c for _, counted in tokens[at : at + len(segments)] for c in counted]
            at += len(segments)
            if eos is not None:
                ids.append(self.tokenizer.eos_token_id)
                in_loss.append(int(eos))
            out_ids.append(ids)
            out_loss.append(in_loss)
        return out_ids, out_loss

    def _counted(self, counted: bool | list[tuple[int, int]], offsets: list[tuple[int, int]]) -> list[int]:
        if isinstance(counted, bool):
            return [int(counted or self.everything)] * len(offsets)
        return [int(self.everything or any(lo <= first < hi for lo, hi in counted)) for first, _ in offsets]

    def segments(self, record: dict[str, Any], line: int) -> tuple[list[Segment], bool | None]:
        """What of ``record`` is tokenised, and whether an EOS follows (None: none, the chat
        template ends each turn itself), counted or not."""
        for field in FIELDS[self.form]:
            if record.get(field) is None:
                present = ", ".join(k for k, v in record.items() if v is not None)
                raise ValueError(
                    f"{self.source} record {line}: no {field!r} field (it has {present or 'none'}); every record "
                    f"of these {self.form} records needs {' and '.join(FIELDS[self.form])}"
                )
        if self.form == "text":
            return [Segment(record["text"], True, True)], True
        if self.form == "messages":
            return [self._chat(record["messages"], line)], None
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return [Segment(prompt, True, False), Segment(completion, False, True)], True
        if isinstance(prompt, list) and isinstance(completion, list):
            return [self._chat(prompt + completion, line, replies_from=len(prompt))], None
        raise ValueError(
            f"{self.source} record {line}: 'prompt' and 'completion' must both be strings or both lists of messages"
        )

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the chat template writes it, as text."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert isinstance(text, str)  # tokenize=False renders text
        return text

    def _chat(self, messages: list[dict], line: int, replies_from: int = 0) -> Segment:
        """The conversation rendered by the chat template; the assistant's replies (from message
        ``replies_from`` on) in the loss, as character spans of the rendered text."""
        text = self._render(messages)
        spans = []
        for index, message in enumerate(messages):
            if message.get("role") != "assistant" or index < replies_from:
                continue
            start = self._render(messages[:index], add_generation_prompt=True) if index else ""
            end = self._render(messages[: index + 1])
            if not (text.startswith(start) and text.startswith(end)):
                raise ValueError(
                    f"{self.source} record {line}: the chat template does not render the conversation's beginning as "
                    f"a prefix of the whole, so the reply's tokens cannot be found; use a template that does, or "
                    f'data.train_on = "all"'
                )
            spans.append((len(start), len(end)))
        return Segment(text, False, spans)


def tokenizer_key(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what a tokenizer does to records: its vocabulary and rules, chat template and EOS."""
    parts = [
        tokenizer.backend_tokenizer.to_str(),
        str(getattr(tokenizer, "chat_template", "")),
        str(tokenizer.eos_token),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def tokenize_records(
    records: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    form: str,
    train_on: str,
    source: str,
    cache_dir: Path,
) -> datasets.Dataset:
    """Every record as ``input_ids`` and ``in_loss`` columns, in one pass cached in ``cache_dir``
    under a key of the records, the tokenizer and the settings (never beside the user's files)."""
    to_tokens = RecordTokenizer(tokenizer, form, train_on, source)
    key = hashlib.sha256(f"{records._fingerprint}:{tokenizer_key(tokenizer)}:{form}:{train_on}".encode()).hexdigest()
    cache_dir.mkdir(parents=True, exist_ok=True)

    def batch(rows: dict[str, list], indices: list[int]) -> dict[str, list]:
        records = [{k: v[offset] for k, v in rows.items()} for offset in range(len(indices))]
        ids, in_loss = to_tokens.batch(records, [index + 1 for index in indices])
        return {"input_ids": ids, "in_loss": in_loss}

    return records.map(
        batch,
        batched=True,
        with_indices=True,
        remove_columns=records.column_names,
        desc=f"tokenising {Path(source).name}",
        cache_file_name=str(cache_dir / f"records-{key[:24]}.arrow"),
        new_fingerprint=key[:32],
    )
