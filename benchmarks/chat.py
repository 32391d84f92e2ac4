"""Chat fine-tuning material made here, offline: a tokenizer with a chat template, and chat records.

Nothing can be downloaded, so the fine-tuning benchmarks and tests make what a user would bring:
a byte-level BPE trained on the built-in Shakespeare, saved as a Hugging Face tokenizer with
ChatML's template (``<|im_start|>role\\n...<|im_end|>\\n``, the template Qwen's models use), and a
JSON-lines file of conversations in the OpenAI/Hugging Face ``messages`` form: a user gives a
line of a play and the assistant answers with the lines that follow it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from engine.run.data import shakespeare_text

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_chat_tokenizer(folder: Path, vocab_size: int = 512, characters: int = 200_000) -> int:
    """A byte-level BPE of ``vocab_size`` tokens trained on the first ``characters`` of the
    built-in corpus, with ChatML's template, EOS ``<|im_end|>`` and pad ``<|endoftext|>``, saved
    in ``folder``; its vocabulary size."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    bpe.train_from_iterator([shakespeare_text()[:characters]], trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def conversations(count: int, seed: int = 0, turns: int = 2) -> list[dict]:
    """``count`` chat records: each of ``turns`` exchanges gives a line of a play and answers
    with the two lines after it, preceded by a system message."""
    lines = [line.strip() for line in shakespeare_text().splitlines() if len(line.strip()) > 20]
    draw = random.Random(seed)
    records = []
    for _ in range(count):
        messages = [{"role": "system", "content": "You continue lines of Shakespeare."}]
        for _ in range(turns):
            at = draw.randrange(len(lines) - 3)
            messages.append({"role": "user", "content": lines[at]})
            messages.append({"role": "assistant", "content": f"{lines[at + 1]}\n{lines[at + 2]}"})
        records.append({"messages": messages})
    return records


def write_chat_jsonl(path: Path, count: int, seed: int = 0, turns: int = 2) -> Path:
    """``conversations(count, seed, turns)`` as a JSON-lines file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for record in conversations(count, seed, turns):
            out.write(json.dumps(record) + "\n")
    return path
