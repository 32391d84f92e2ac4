"""Chat fine-tuning as users run it: packed against unpacked, the chunked loss against the full
one, and the memory of tokenising a large record file.

Three measurements, each phase in a process of its own so that its peak RSS is its own:

- ``train``: a Llama-shaped model of about ``--params`` parameters from a config (random bf16
  weights, a ChatML tokenizer trained here), fine-tuned on a generated chat jsonl with
  parameters and optimizer state on nvme (stage 3), ``--steps`` steps packed and as many
  unpacked: seconds a step, tokens a second (all positions, and those the loss counts), the
  fraction of positions in the loss and of padding.
- ``loss``: one forward and backward of the output head's cross-entropy over ``--loss-tokens``
  tokens at a ``--loss-vocab`` vocabulary (Llama 3's, 128,256), chunked and full: the growth of
  peak RSS over the inputs' own, and seconds.
- ``tokenize``: text records of ``--tokenize-mb`` and of a tenth of it, read and tokenised as a
  run does: peak RSS of each, and the peak of its anonymous part (what the process allocated,
  which must not grow with the file; the Arrow files it maps count in RSS while their pages are
  cached, and the kernel drops them under pressure).

    python -m benchmarks.sft --params 1e9 --steps 3 --dir /path/on/nvme
    python -m benchmarks.sft --only loss tokenize
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.chat import save_chat_tokenizer, write_chat_jsonl
from benchmarks.pretrained import llama_config
from benchmarks.report import base_parser, print_table, save_json, setup_logging
from engine.runtime.rss import peak_rss_bytes
from engine.runtime.sizes import GIB, MIB

PHASES = ("train", "loss", "tokenize")
PLAN = ["stage=3", "offload.param=nvme", "offload.optimizer=nvme", "compute_dtype=bf16", "store.mode=in-place"]
TOKENIZER_VOCAB = 8192


class AnonymousPeak:
    """The peak of this process's anonymous resident memory (``RssAnon``: what it allocated,
    not the pages of files it maps, which the kernel drops when it wants them), sampled every
    ``every`` seconds on a thread of its own while the block runs."""

    def __init__(self, every: float = 0.02):
        self.every, self.peak = every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> AnonymousPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)
            if self._done.wait(self.every):
                return


def llama_folder(params: float, folder: Path, seq_len: int) -> int:
    """A random bf16 Llama of about ``params`` parameters with a ChatML tokenizer in ``folder``;
    its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    vocab = save_chat_tokenizer(folder, vocab_size=TOKENIZER_VOCAB)
    settings = llama_config(params, vocab, positions=seq_len)
    torch.manual_seed(0)
    model = LlamaForCausalLM(settings).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="500MB")
    return sum(p.numel() for p in model.parameters())


def train_phase(folder: Path, data: Path, store: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Fine-tune from ``folder`` for ``steps`` steps, packed or not; every step's record."""
    from engine.config import Config
    from engine.run.train import train

    metrics = store.parent / f"{store.name}.jsonl"
    overrides = [*PLAN, f"model.hf={folder}", f"data.source={data}", f"nvme_path={store}", f"metrics={metrics}"]
    overrides += [f"steps={options['steps']}", f"seq_len={options['seq_len']}", f"micro_batch={options['micro_batch']}"]
    overrides += [f"data.pack={str(options['pack']).lower()}", "warmup_steps=0", "lr=1e-5", "log_every=1"]
    overrides += [f"zero.activation_checkpointing={str(options['recompute']).lower()}"]
    train(Config.from_dict({}, overrides))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"steps": records, "peak_rss_bytes": peak_rss_bytes()}


def loss_phase(chunked: bool, tokens: int, vocab: int, hidden: int) -> dict[str, Any]:
    """One forward and backward of the head's loss in bf16: peak RSS above the inputs'."""
    import torch

    from engine.run.loss import chunked_cross_entropy

    generator = torch.Generator().manual_seed(0)
    states = (torch.randn(1, tokens, hidden, generator=generator) / 8).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) / 64).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), generator=generator)
    before = peak_rss_bytes()
    start = time.perf_counter()
    if chunked:
        loss = chunked_cross_entropy(states, weight, targets)
    else:
        logits = states @ weight.T
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    return {"seconds": time.perf_counter() - start, "growth_bytes": peak_rss_bytes() - before, "loss": float(loss)}


def tokenize_phase(folder: Path, data: Path, cache: Path) -> dict[str, Any]:
    """Read and tokenise ``data`` as a fine-tuning run does (into an empty cache)."""
    from engine.run.pretrained import load_tokenizer
    from engine.run.records import load_records, tokenize_records

    start = time.perf_counter()
    with AnonymousPeak() as anonymous:
        tokenizer = load_tokenizer(str(folder))
        tokenized = tokenize_records(load_records(str(data), cache), tokenizer, "text", "all", str(data), cache)
    seconds, peak = time.perf_counter() - start, peak_rss_bytes()
    return {"seconds": seconds, "records": len(tokenized), "peak_rss_bytes": peak, "peak_anon_bytes": anonymous.peak}


def text_records(path: Path, megabytes: float) -> Path:
    """Text records of the built-in corpus's lines, about ``megabytes`` of JSON lines."""
    from engine.run.data import shakespeare_text

    lines = [line for line in shakespeare_text().splitlines() if line.strip()]
    target, written, at = megabytes * MIB, 0, 0
    with path.open("w") as out:
        while written < target:
            text = "\n".join(lines[at % len(lines) : at % len(lines) + 12])
            written += out.write(json.dumps({"text": text}) + "\n")
            at += 12
    return path


def in_process(phase: str, *arguments: str) -> dict[str, Any]:
    """Run one phase in a fresh process; its JSON result."""
    command = [sys.executable, "-m", "benchmarks.sft", "--phase", phase, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the {phase} phase failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_rows(work: Path, params: float, options: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """The fine-tune packed and unpacked: a row each, from their steps after the first."""
    folder, data = work / "model", work / "chat.jsonl"
    count = llama_folder(params, folder, options["seq_len"])
    write_chat_jsonl(data, options["records"], turns=options["turns"])
    rows = []
    for pack in (True, False):
        name = "packed" if pack else "unpacked"
        result = in_process("train", str(folder), str(data), str(work / name), json.dumps(options | {"pack": pack}))
        steady = result["steps"][1:] or result["steps"]
        seconds = sum(r["seconds"] for r in steady)
        positions = options["micro_batch"] * options["seq_len"] * len(steady)
        counted = sum(r["loss_token_fraction"] for r in steady) / len(steady)
        rows.append(
            {
                "data": name,
                "s/step": seconds / len(steady),
                "tokens/s": positions / seconds,
                "loss tokens/s": positions * counted / seconds,
                "loss fraction": counted,
                "padding": sum(r["padding_fraction"] for r in steady) / len(steady),
                "peak RSS GiB": result["peak_rss_bytes"] / GIB,
            }
        )
    return count, rows


def loss_rows(tokens: int, vocab: int, hidden: int) -> list[dict[str, Any]]:
    rows = []
    for chunked in (False, True):
        result = in_process("loss", str(int(chunked)), str(tokens), str(vocab), str(hidden))
        name = "chunked" if chunked else "full"
        rows.append({"loss": name, "peak growth GiB": result["growth_bytes"] / GIB, "seconds": result["seconds"]})
    return rows


def tokenize_rows(work: Path, megabytes: float) -> list[dict[str, Any]]:
    folder = work / "tokenizer"
    save_chat_tokenizer(folder, vocab_size=TOKENIZER_VOCAB)
    rows = []
    for size in (megabytes / 10, megabytes):
        data = text_records(work / f"text-{size:g}.jsonl", size)
        result = in_process("tokenize", str(folder), str(data), str(work / f"cache-{size:g}"))
        rows.append(
            {
                "file MB": data.stat().st_size / 1e6,
                "records": result["records"],
                "seconds": result["seconds"],
                "MB/s": data.stat().st_size / 1e6 / result["seconds"],
                "peak RSS GiB": result["peak_rss_bytes"] / GIB,
                "peak anonymous GiB": result["peak_anon_bytes"] / GIB,
            }
        )
    return rows


def run_phase(phase: str, arguments: list[str]) -> dict[str, Any]:
    """One phase, in this process (``--phase``)."""
    if phase == "train":
        folder, data, store, options = arguments
        return train_phase(Path(folder), Path(data), Path(store), json.loads(options))
    if phase == "loss":
        chunked, tokens, vocab, hidden = arguments
        return loss_phase(bool(int(chunked)), int(tokens), int(vocab), int(hidden))
    folder, data, cache = arguments
    return tokenize_phase(Path(folder), Path(data), Path(cache))


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("arguments", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="+", choices=PHASES, default=list(PHASES), help="measure only these")
    parser.add_argument("--params", type=float, default=1e9, help="the model's size (default 1e9)")
    parser.add_argument("--steps", type=int, default=3, help="steps of each fine-tune (default 3)")
    parser.add_argument("--records", type=int, default=2000, help="chat records generated (default 2000)")
    parser.add_argument("--turns", type=int, default=2, help="exchanges a chat record holds (default 2)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--recompute", action="store_true", help="zero.activation_checkpointing: the blocks' activations recomputed"
    )
    parser.add_argument("--loss-tokens", type=int, default=4096)
    parser.add_argument("--loss-vocab", type=int, default=128_256, help="Llama 3's vocabulary")
    parser.add_argument("--loss-hidden", type=int, default=2048)
    parser.add_argument("--tokenize-mb", type=float, default=1024.0, help="the larger record file (default 1 GiB)")
    parser.add_argument("--dir", type=Path, help="work folder on the disk to measure (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.arguments)))
        return 0
    setup_logging(args.verbose)
    if args.quick:
        args.params, args.steps, args.records, args.turns, args.seq_len, args.micro_batch = 2e6, 2, 40, 1, 256, 2
        args.loss_tokens, args.loss_vocab, args.loss_hidden, args.tokenize_mb = 512, 8192, 128, 2.0
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        work = Path(scratch)
        result: dict[str, Any] = {}
        if "train" in args.only:
            options = {
                "steps": args.steps,
                "seq_len": args.seq_len,
                "micro_batch": args.micro_batch,
                "recompute": args.recompute,
            }
            options |= {"records": args.records, "turns": args.turns}
            result["params"], result["train"] = train_rows(work, args.params, options)
            print_table(f"fine-tune of {result['params'] / 1e6:.0f}M params, everything on nvme", result["train"])
        if "loss" in args.only:
            result["loss"] = loss_rows(args.loss_tokens, args.loss_vocab, args.loss_hidden)
            print_table(f"loss of {args.loss_tokens} tokens at a {args.loss_vocab} vocabulary (bf16)", result["loss"])
        if "tokenize" in args.only:
            result["tokenize"] = tokenize_rows(work, args.tokenize_mb)
            print_table("tokenising text records", result["tokenize"])
    save_json(args.out, "sft", vars(args) | {"dir": str(args.dir), "out": str(args.out)} | result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
