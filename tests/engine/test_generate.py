"""``python -m engine generate``: text from a run's store, the same as a plain PyTorch model
with the store's weights would write, repeatable with a seed, and one line for bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from engine.config import Config, ConfigError
from engine.run import cli
from engine.run.data import ByteTokenizer
from engine.run.generate import Sampling, continue_ids, generate, sample_ids
from engine.run.models.gpt import GPT
from engine.run.train import meta_model, train
from engine.tools.consolidate import consolidate
from tests.caches import fresh_cache

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 30
PROMPT = "To be"


def run_config(tmp_path, **offload) -> Config:
    """A tiny built-in GPT on a small corpus, fp32, stage 3 with every shard on nvme."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    return Config.from_dict(
        {
            "zero": {"stage": 3, "prefetch_mb": 1},
            "offload": {"optimizer": "nvme", "param": "nvme", "nvme_path": str(tmp_path / "store")} | offload,
            "precision": {"compute_dtype": "fp32"},
            "model": {"preset": "tiny"},
            "data": {"source": str(corpus), "seq_len": 32, "micro_batch": 2},
            "optim": {"lr": 3e-3},
            "train": {"steps": 3, "log_every": 3},
        }
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Config:
    """One step: the weights still far from the corpus's, so the greedy text depends on every
    position (three steps write " t t t ..." wherever they are, which a wrong cache writes too)."""
    tmp_path = tmp_path_factory.mktemp("run")
    config = run_config(tmp_path)
    config.train.steps = 1
    train(config)
    return config


def plain_greedy(config: Config, prompt: list[int], tokens: int, tmp_path) -> list[int]:
    """Greedy decoding by hand with a plain GPT holding the store's consolidated weights."""
    consolidate(config.offload.nvme_path, tmp_path / "weights.safetensors")
    model = GPT(meta_model(config, ByteTokenizer.vocab_size)[0].config)
    missing, unexpected = model.load_state_dict(load_file(tmp_path / "weights.safetensors"), strict=False)
    assert not missing and not unexpected
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(torch.tensor([ids[-model.config.seq_len :]]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_equals_a_plain_pytorch_greedy_decode_of_the_stores_weights(trained, tmp_path) -> None:
    prompt = ByteTokenizer().encode(PROMPT).tolist()
    greedy = Sampling(tokens=40, temperature=0)  # more than seq_len: the context window slides
    ours = continue_ids(trained, prompt, greedy)
    assert ours == plain_greedy(trained, prompt, greedy.tokens, tmp_path)
    assert len(set(ours)) > 2 and len(set(ours[:32])) > 2, "a text that tells positions apart"
    assert generate(trained, PROMPT, greedy) == ByteTokenizer().decode(ours)


def test_a_seed_repeats_the_sampled_text_and_another_seed_changes_it(trained) -> None:
    sampling = Sampling(tokens=30, temperature=1.0, top_k=0, seed=1)
    first = generate(trained, PROMPT, sampling)
    assert generate(trained, PROMPT, sampling) == first
    assert generate(trained, PROMPT, dataclasses.replace(sampling, seed=2)) != first


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(0)
    table = torch.randn(256, 256)
    forward = lambda ids, cache: (table[ids], None)  # noqa: E731  (a bigram model: logits of each position's id)
    greedy = sample_ids(forward, [3], Sampling(tokens=20, temperature=0), None)
    assert sample_ids(forward, [3], Sampling(tokens=20, temperature=2.0, top_k=1, seed=5), None) == greedy


def test_cli_prints_the_prompt_and_its_continuation(trained, capsys) -> None:
    args = ["generate", "--prompt", PROMPT, "--tokens", "12", "--temperature", "0", *overrides(trained)]
    assert cli.main(args) == 0
    expected = PROMPT + generate(trained, PROMPT, Sampling(tokens=12, temperature=0))
    assert capsys.readouterr().out == expected + "\n"


def overrides(config: Config) -> list[str]:
    """The command-line overrides that give ``config`` (those of ``run_config``)."""
    out = []
    for section, keys in config.to_dict().items():
        for key, value in keys.items():
            if value != getattr(getattr(Config(), section), key) and not isinstance(value, (list, tuple)):
                out += [f"--{section}.{key}", str(value)]
    return out


@pytest.mark.parametrize(
    ("change", "extra", "message"),
    [
        ({"nvme_path": "nowhere"}, [], "holds no store: point --offload.nvme_path"),
        ({"optimizer": "cpu", "param": "cpu"}, [], "kept the run's state in memory: generate from one of its"),
        ({}, ["--temperature", "-1"], "config error: --temperature -1.0: must be >= 0"),
        ({}, ["--top-k", "-2"], "config error: --top-k -2: must be >= 0"),
        ({}, ["--from-checkpoint", "step-9"], "step-9"),
    ],
)
def test_bad_input_ends_with_one_line_naming_the_fix(trained, tmp_path, caplog, change, extra, message) -> None:
    config = dataclasses.replace(trained, offload=dataclasses.replace(trained.offload, **change))
    if "nvme_path" in change:
        config.offload.nvme_path = str(tmp_path / "nowhere")
    args = ["generate", "--prompt", PROMPT, *extra, *overrides(config)]
    assert cli.main(args) in (1, 2)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], errors


def test_a_store_with_no_committed_step_is_refused(tmp_path) -> None:
    config = run_config(tmp_path)
    train(config)
    (tmp_path / "store" / "COMMITTED").unlink()
    with pytest.raises(ValueError, match="holds no committed step to generate from: train at least one step"):
        generate(config, PROMPT, Sampling(tokens=2))


def test_an_empty_prompt_is_refused(trained) -> None:
    with pytest.raises(ConfigError, match="--prompt is empty"):
        generate(trained, "", Sampling(tokens=2))


def test_a_pretrained_model_generates_as_its_plain_hugging_face_model_would(tmp_path, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.engine.test_pretrained import SHARD, llama, save_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    folder = tmp_path / "pretrained"
    torch.manual_seed(0)
    llama(vocab=320).save_pretrained(folder, max_shard_size=SHARD)
    save_tokenizer(folder)
    config = dataclasses.replace(run_config(tmp_path), model=dataclasses.replace(Config().model, hf=str(folder)))
    config.train.steps = 2
    train(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("the quick brown")["input_ids"]
    greedy = Sampling(tokens=12, temperature=0)
    ours = continue_ids(config, prompt, greedy)
    consolidate(config.offload.nvme_path, tmp_path / "weights.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.load_state_dict(load_file(tmp_path / "weights.safetensors"), strict=False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(greedy.tokens):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert ours == ids[len(prompt) :]
    assert generate(config, "the quick brown", greedy) == tokenizer.decode(ours, skip_special_tokens=True)
    unnamed = dataclasses.replace(config, model=Config().model)  # the store records the model and tokenizer
    assert generate(unnamed, "the quick brown", greedy) == tokenizer.decode(ours, skip_special_tokens=True)


def test_a_bpe_run_generates_with_the_bpe_it_trained(tmp_path, monkeypatch) -> None:
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    base = run_config(tmp_path)
    config = dataclasses.replace(base, data=dataclasses.replace(base.data, tokenizer="bpe", vocab_size=300))
    config.train.steps = 1
    train(config)
    text = generate(config, PROMPT, Sampling(tokens=8, temperature=0))
    from engine.run.generate import text_codec

    codec = text_codec(config)
    assert codec.vocab_size <= 300 and text == codec.decode(continue_ids(config, codec.encode(PROMPT), Sampling(8, 0)))
