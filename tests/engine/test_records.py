"""Fine-tuning records: each form tokenised as the tokenizer's own template renders it, the loss
on the replies only, refusals that name the record, and batches of whole examples that visit
each example once an epoch and resume at the exact example."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from benchmarks.chat import conversations, save_chat_tokenizer, write_chat_jsonl
from engine.run.examples import ExampleBatches, Examples, lay_out
from engine.run.loss import IGNORE_INDEX
from engine.run.records import RecordTokenizer, detect_form, is_records, load_records, tokenize_records

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who is there?"},
    {"role": "assistant", "content": "Nay, answer me."},
    {"role": "user", "content": "Long live the king!"},
    {"role": "assistant", "content": "Bernardo?"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> transformers.PreTrainedTokenizerBase:
    folder = tmp_path_factory.mktemp("tokenizer")
    save_chat_tokenizer(folder, vocab_size=400, characters=50_000)
    return transformers.AutoTokenizer.from_pretrained(folder)


def replies_text(tokenizer, ids: list[int], in_loss: list[int]) -> str:
    return tokenizer.decode([i for i, counted in zip(ids, in_loss, strict=True) if counted])


def test_chat_records_are_rendered_by_the_template_with_the_loss_on_the_replies(tokenizer) -> None:
    ids, in_loss = RecordTokenizer(tokenizer, "messages", "completion", "chat")({"messages": CHAT}, 1)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"], "the template's own rendering"
    assert replies_text(tokenizer, ids, in_loss) == "Nay, answer me.<|im_end|>\nBernardo?<|im_end|>\n"
    _, every = RecordTokenizer(tokenizer, "messages", "all", "chat")({"messages": CHAT}, 1)
    assert all(every)


def test_prompt_completion_records_of_both_kinds(tokenizer) -> None:
    strings = RecordTokenizer(tokenizer, "prompt_completion", "completion", "pc")
    ids, in_loss = strings({"prompt": "Who is there?", "completion": " Bernardo."}, 1)
    prompt, completion = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("Who is there?", " Bernardo."))
    assert ids == prompt + completion + [tokenizer.eos_token_id]
    assert in_loss == [0] * len(prompt) + [1] * (len(completion) + 1), "the completion and its EOS"

    chat = RecordTokenizer(tokenizer, "prompt_completion", "completion", "pc")
    ids, in_loss = chat({"prompt": CHAT[:4], "completion": CHAT[4:]}, 1)
    assert ids == RecordTokenizer(tokenizer, "messages", "completion", "c")({"messages": CHAT}, 1)[0]
    assert replies_text(tokenizer, ids, in_loss) == "Bernardo?<|im_end|>\n", "only the completion's reply"


def test_text_records_count_every_token_and_end_with_eos(tokenizer) -> None:
    ids, in_loss = RecordTokenizer(tokenizer, "text", "completion", "t")({"text": "To be, or not to be"}, 1)
    assert ids[-1] == tokenizer.eos_token_id and all(in_loss)


def test_records_are_refused_naming_what_is_wrong(tmp_path, tokenizer) -> None:
    with pytest.raises(ValueError, match=r"have the fields question, answer: a record holds 'text', 'messages'"):
        detect_form(["question", "answer"], "auto", "qa.jsonl")
    with pytest.raises(ValueError, match=r"data.format = 'messages' needs the field\(s\) messages"):
        detect_form(["text"], "messages", "t.jsonl")
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"text": "stray"}) + "\n")
    records = load_records(str(path), tmp_path / "cache")
    with pytest.raises(ValueError, match=r"chat.jsonl record 2: no 'messages' field \(it has text\)"):
        tokenize_records(records, tokenizer, "messages", "completion", str(path), tmp_path / "cache")
    plain = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="the tokenizer has no chat template to render them"):
        RecordTokenizer(plain, "messages", "completion", str(path))


def test_every_source_form_is_read_as_records(tmp_path) -> None:
    import datasets

    rows = conversations(5)
    write_chat_jsonl(tmp_path / "folder" / "a.jsonl", 5)
    (tmp_path / "one.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for source in ("folder", "one.json", "rows.parquet", "saved"):
        path = str(tmp_path / source)
        assert is_records(path), source
        loaded = load_records(path, tmp_path / "cache")
        assert len(loaded) == 5 and loaded[0]["messages"] == rows[0]["messages"], source
    assert not is_records(str(tmp_path / "nothing.txt"))


def examples_of(tokenizer, tmp_path: Path, count: int, limit: int) -> Examples:
    path = write_chat_jsonl(tmp_path / "chat.jsonl", count, turns=1)
    tokenized = tokenize_records(
        load_records(str(path), tmp_path / "cache"), tokenizer, "messages", "completion", str(path), tmp_path / "cache"
    )
    return Examples(tokenized, np.arange(count), limit)


def test_packed_rows_hold_whole_examples_once_an_epoch(tmp_path, tokenizer) -> None:
    examples = examples_of(tokenizer, tmp_path, 40, 129)
    batches = ExampleBatches(examples, seq_len=128, micro_batch=2, seed=3)
    seen: list[int] = []
    for epoch in range(2):
        rows = batches.rows_of(epoch)
        assert all(int(batches._positions[row].sum()) <= 128 for row in rows), "a row holds what fits"
        seen = [int(e) for row in rows for e in row]
        assert sorted(seen) == list(range(40)), f"epoch {epoch} visits every example once"
    assert [int(e) for row in batches.rows_of(0) for e in row] != seen, "each epoch has its own order"
    positions = np.array([5, 5, 5])
    assert [r.tolist() for r in lay_out(np.arange(3), positions, 10, pack=True)] == [[0, 1], [2]]
    assert [r.tolist() for r in lay_out(np.arange(3), positions, 10, pack=False)] == [[0], [1], [2]]


def test_a_row_is_each_examples_inputs_targets_and_positions(tmp_path, tokenizer) -> None:
    examples = examples_of(tokenizer, tmp_path, 6, 129)
    x, y, positions = ExampleBatches(examples, seq_len=128, micro_batch=1, seed=0).next()
    row = ExampleBatches(examples, seq_len=128, micro_batch=1, seed=0).rows_of(0)[0]
    used = 0
    for example in row:
        ids, in_loss = examples.tokens(int(example))
        n = len(ids) - 1
        assert torch.equal(x[0, used : used + n], torch.from_numpy(ids[:-1]))
        assert torch.equal(y[0, used : used + n], torch.from_numpy(np.where(in_loss[1:], ids[1:], IGNORE_INDEX)))
        assert torch.equal(positions[0, used : used + n], torch.arange(n))
        used += n
    assert (y[0, used:] == IGNORE_INDEX).all() and (positions[0, used:] == torch.arange(128 - used)).all()


def test_batches_resume_mid_epoch_and_are_the_same_at_any_world_size(tmp_path, tokenizer) -> None:
    examples = examples_of(tokenizer, tmp_path, 30, 129)

    def stream(world: int, steps: int, resume_at: int | None = None) -> list[torch.Tensor]:
        ranks = [ExampleBatches(examples, seq_len=128, micro_batch=4 // world, rank=r, world_size=world, seed=1)
                 for r in range(world)]  # fmt: skip
        out = []
        for step in range(steps):
            if step == resume_at:  # a new process continues from the saved state
                saved = ranks[0].state_dict()
                ranks = [ExampleBatches(examples, seq_len=128, micro_batch=4 // world, rank=r, world_size=world,
                                        seed=1) for r in range(world)]  # fmt: skip
                for batches in ranks:
                    batches.load_state_dict(saved)
            out.append(torch.cat([torch.stack(b.next()) for b in ranks], dim=1))
        return out

    straight = stream(1, 12)
    assert len(ExampleBatches(examples, seq_len=128, micro_batch=4, seed=1).rows_of(0)) < 12 * 4, "epochs are crossed"
    for other in (stream(1, 12, resume_at=5), stream(2, 12), stream(2, 12, resume_at=7)):
        assert all(torch.equal(a, b) for a, b in zip(straight, other, strict=True))


def test_an_unpacked_row_holds_one_example_padded(tmp_path, tokenizer) -> None:
    examples = examples_of(tokenizer, tmp_path, 5, 129)
    batches = ExampleBatches(examples, seq_len=128, micro_batch=5, seed=0, pack=False, pad_id=7)
    assert all(len(row) == 1 for row in batches.rows_of(0))
    x, y, _ = batches.next()
    fractions = batches.take_fractions()
    assert fractions["padding_fraction"] > 0 and (x[y == IGNORE_INDEX] == 7).any()
    assert 0 < fractions["loss_token_fraction"] < 1 - fractions["padding_fraction"]
    assert fractions["loss_token_fraction"] == int((y != IGNORE_INDEX).sum()) / y.numel()
    assert batches.take_fractions() == {"loss_token_fraction": 0.0, "padding_fraction": 0.0}, "taken once"
