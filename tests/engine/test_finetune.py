"""Chat fine-tuning through the engine: the loss on the assistant's replies equals Hugging Face's
with labels -100 elsewhere (the mask taken from the chat template's own ``{% generation %}``
marks, not from the engine's code), packed and unpacked; and ``python -m engine train`` on a chat
jsonl with ``train.epochs`` resumes mid-epoch bit-identically to a run that never stopped."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from benchmarks.chat import save_chat_tokenizer, write_chat_jsonl
from engine.config import Config
from engine.engine import Engine
from engine.run import train as train_module
from engine.run.examples import ExampleBatches, Examples
from engine.run.loss import IGNORE_INDEX
from engine.run.models.gpt import GPT, GPTConfig
from engine.run.pretrained import causal_lm_loss
from engine.run.records import load_records, tokenize_records
from tests.caches import fresh_cache
from tests.ranks import run_ranks
from tests.training import config

GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (the template the engine renders with) marked for transformers' own assistant mask."""
SEQ = 256


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama with a ChatML tokenizer, saved as ``save_pretrained`` writes one."""
    folder = tmp_path_factory.mktemp("llama")
    vocab = save_chat_tokenizer(folder, vocab_size=400, characters=50_000)
    torch.manual_seed(0)
    settings = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="sdpa",
    )  # fmt: skip
    transformers.LlamaForCausalLM(settings).save_pretrained(folder)
    return folder


def hugging_face_loss(logits_of, tokenizer, conversations: list[dict]) -> float:
    """The mean next-token loss over every reply token of ``conversations``, each run alone
    through ``logits_of(ids)`` with labels -100 outside the assistant mask that transformers
    computes from the template."""
    total, count = 0.0, 0
    for record in conversations:
        rendered = tokenizer.apply_chat_template(
            record["messages"], chat_template=GENERATION, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor([rendered["input_ids"]])
        labels = torch.where(torch.tensor([rendered["assistant_masks"]]) == 1, ids, IGNORE_INDEX)
        logits = logits_of(ids).float()
        losses = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum")
        total, count = total + float(losses), count + int((labels[0, 1:] != IGNORE_INDEX).sum())
    return total / count


def chat_batch(tmp_path: Path, tokenizer, pack: bool) -> tuple[tuple[torch.Tensor, ...], list[list[dict]]]:
    """The first micro-batch (one row) of six chat records, and the conversations it holds."""
    path = write_chat_jsonl(tmp_path / "chat.jsonl", 6, turns=1)
    tokenized = tokenize_records(
        load_records(str(path), tmp_path / "cache"), tokenizer, "messages", "completion", str(path), tmp_path / "cache"
    )
    examples = Examples(tokenized, np.arange(6), SEQ + 1)
    batches = ExampleBatches(examples, seq_len=SEQ, micro_batch=1, seed=0, pack=pack, pad_id=tokenizer.pad_token_id)
    row = [int(e) for e in batches.rows_of(0)[0]]
    assert len(row) > 1 if pack else len(row) == 1, "a packed row holds several conversations"
    return batches.next(), [{"messages": m} for m in _conversations(path, row)]


@pytest.mark.parametrize("pack", [True, False])
def test_the_loss_on_chat_records_equals_hugging_face_labels(tmp_path, folder, pack: bool) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    (x, y, positions), records = chat_batch(tmp_path, tokenizer, pack)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine = Engine(model, config(zero={"stage": 2}), total_steps=1)
    ours = causal_lm_loss(engine, x, y, positions=positions).item()
    engine.close()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert ours == pytest.approx(
        hugging_face_loss(lambda ids: reference(input_ids=ids).logits, tokenizer, records), rel=1e-6
    )


@pytest.mark.parametrize("pack", [True, False])
def test_the_built_in_gpt_takes_chat_records_as_hugging_face_labels_say(tmp_path, folder, pack: bool) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    (x, y, positions), records = chat_batch(tmp_path, tokenizer, pack)
    settings = GPTConfig.preset("tiny", vocab_size=len(tokenizer), seq_len=SEQ)
    engine = Engine(GPT(settings, seed=1), config(zero={"stage": 3}), total_steps=1)
    ours = engine(x, y, positions=positions).item()
    engine.close()
    reference = GPT(settings, seed=1)
    assert ours == pytest.approx(hugging_face_loss(reference, tokenizer, records), rel=1e-6)


def _conversations(path: Path, indices: list[int]) -> list[list[dict]]:
    import json

    lines = path.read_text().splitlines()
    return [json.loads(lines[i])["messages"] for i in indices]


def fine_tune(folder: Path, root: Path, *extra: str) -> Config:
    """The config of ``python -m engine train`` fine-tuning ``folder`` on a chat jsonl for 2 epochs."""
    data = root / "chat.jsonl"
    if not data.exists():
        write_chat_jsonl(data, 24, turns=1)
    overrides = [f"model.hf={folder}", f"data.source={data}", "train.epochs=2", f"data.seq_len={SEQ}"]
    overrides += ["data.micro_batch=2", "compute_dtype=fp32", "optim.lr=1e-3", f"nvme_path={root / 'store'}"]
    return Config.from_dict({}, [*overrides, *extra])


def test_a_fine_tune_resumes_mid_epoch_as_if_it_never_stopped(tmp_path, folder, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    straight = train_module.train(fine_tune(folder, tmp_path / "a"))
    assert straight.steps_done > 4 and straight.losses[-1] < straight.losses[0]

    real_step, taken = train_module.train_step, []

    def stopped(*args, **kwargs) -> float:
        taken.append(real_step(*args, **kwargs))
        if len(taken) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-epoch: the first epoch has more steps
        return taken[-1]

    monkeypatch.setattr(train_module, "train_step", stopped)
    first = train_module.train(fine_tune(folder, tmp_path / "b"))
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    rest = train_module.train(fine_tune(folder, tmp_path / "b"))
    assert first.steps_done == 3 and rest.steps_done == straight.steps_done
    assert first.losses + rest.losses == straight.losses, "bit-identical losses, step for step"


def ranks_fine_tune(folder: Path, root: Path, stop_after: int) -> list[float]:
    """On this process's rank: the fine-tune of ``fine_tune``, stopped (as SIGTERM stops it, on
    every rank after the same step) after ``stop_after`` steps if not 0; its losses."""
    real_step, taken = train_module.train_step, []

    def stopped(*args, **kwargs) -> float:
        taken.append(real_step(*args, **kwargs))
        if len(taken) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return taken[-1]

    train_module.train_step = stopped
    try:
        return train_module.train(fine_tune(folder, root, "data.micro_batch=1")).losses
    finally:
        train_module.train_step = real_step


@pytest.mark.slow  # two ranks then one (one rank's resume stays in the default run): about 50 s
def test_a_fine_tune_of_two_ranks_resumes_mid_epoch_on_one(tmp_path, folder, monkeypatch) -> None:
    """The same rows make each step on 2 ranks and on 1 (a micro-batch of 1 a rank, of 2 once
    resumed on one: the global batch is kept), so the losses go on as the 2 ranks' would, to
    the precision of a sum over ranks against one over rows."""
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    straight = run_ranks(2, ranks_fine_tune, folder, tmp_path / "a", 0)[0]
    first = run_ranks(2, ranks_fine_tune, folder, tmp_path / "b", 3)[0]
    rest = train_module.train(fine_tune(folder, tmp_path / "b")).losses
    assert first == straight[:3] and len(first) + len(rest) == len(straight)
    assert rest == pytest.approx(straight[3:], rel=1e-5)
