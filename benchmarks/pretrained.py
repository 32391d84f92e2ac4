"""Import, fine-tune and export of a pretrained checkpoint against the disk's own bandwidth.

A randomly initialised Llama of about ``--params`` parameters is saved in bf16 shards, as
``save_pretrained`` writes a downloaded model. Then, each in its own process so that its peak
RSS is its own: the engine imports it into a stage-3 store with parameters and optimizer state
on nvme (every unit read from the checkpoint and written to the store); with
``--finetune-steps N``, ``train`` continues from that store for N steps on the built-in text
(byte tokens, a pre-tokenised file: the random checkpoint has no tokenizer), a tenth of it held
out for a validation loss after every step; ``export`` writes the store back as a Hugging Face
folder, and the same process then reloads it (its config, and one trained tensor read from its
shard, equal to the store's; ``from_pretrained`` too at small sizes), its peak RSS taken first.
Each phase's bytes read and written per second are set against raw O_DIRECT disk bandwidth
measured in the same run.

With ``--moe`` the checkpoint is a Mixtral-style mixture of experts (8 experts, 2 per token,
stored one tensor per expert as ``save_pretrained`` writes it), whose experts train as units of
their own inside their layers'.

    python -m benchmarks.pretrained --params 1e9 --dir /path/on/nvme
    python -m benchmarks.pretrained --params 3e9 --finetune-steps 20 --dir /path/on/nvme
    python -m benchmarks.pretrained --params 1e9 --moe --finetune-steps 3 --dir /path/on/nvme
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bandwidth import raw_disk_gbps
from benchmarks.report import base_parser, print_table, save_json, setup_logging
from benchmarks.runs import disk_usage
from engine.runtime.rss import peak_rss_bytes
from engine.runtime.sizes import GIB, MIB

VOCAB = 32_000
PLAN = ["stage=3", "offload.param=nvme", "offload.optimizer=nvme", "compute_dtype=bf16", "store.mode=in-place"]
"""Import and fine-tune alike: the fine-tune resumes the store the import wrote. One generation of
optimizer state on disk: a 3B fine-tune's (36 GB) twice, beside the checkpoint and the export,
would not fit the ~80 GB free here."""
FINETUNE = ["seq_len=128", "micro_batch=1", "lr=1e-3", "warmup_steps=0", "val_fraction=0.1", "eval_every=1"]
MOE_UNITS = "zero.unit_classes=MixtralDecoderLayer,MixtralExperts"
"""A mixture of experts' units: each layer's experts apart from the rest of the layer."""
CHECKED = "model.layers.0.self_attn.q_proj.weight"
"""The tensor the reload compares with the store's trained value and the checkpoint's first one."""
FROM_PRETRAINED_MAX_BYTES = GIB
"""Up to this many bytes of exported weights the reload also loads the whole model with ``from_pretrained``."""


def llama_config(params: float, vocab: int = VOCAB, positions: int = 512) -> Any:
    """A Llama whose width follows its size and whose depth makes up ``params``."""
    from transformers import LlamaConfig

    hidden = 2048 if params >= 5e8 else 256
    layers = max(1, round((params - 2 * vocab * hidden) / (12 * hidden * hidden)))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=positions,
    )


def mixtral_config(params: float, vocab: int = VOCAB, positions: int = 512) -> Any:
    """A Mixtral (8 experts, 2 a token) whose depth makes up ``params``."""
    from transformers import MixtralConfig

    hidden = 1024 if params >= 2e8 else 256
    ffn, experts = int(hidden * 8 / 3) // 64 * 64, 8
    layers = max(1, round((params - 2 * vocab * hidden) / (4 * hidden * hidden + experts * 3 * hidden * ffn)))
    return MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=positions,
    )


def plan(folder: Path) -> list[str]:
    """The import's and fine-tune's settings for the checkpoint in ``folder``."""
    moe = "num_local_experts" in json.loads((folder / "config.json").read_text())
    return [*PLAN, MOE_UNITS] if moe else PLAN


def save_checkpoint(params: float, folder: Path, moe: bool = False) -> int:
    """Save a random model of about ``params`` parameters in bf16 shards; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    settings = mixtral_config(params) if moe else llama_config(params)
    model = AutoModelForCausalLM.from_config(settings).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="500MB")
    return sum(p.numel() for p in model.parameters())


def import_phase(folder: Path, store: Path) -> dict[str, float]:
    """Import the checkpoint into a new stage-3 store, everything on nvme."""
    from engine.config import Config
    from engine.engine import Engine
    from engine.run.pretrained import pretrained_model, record_source

    model, init = pretrained_model(str(folder), seq_len=128)
    config = Config.from_dict({}, [*plan(folder), f"nvme_path={store}"])  # buffer_mb "auto": sized for the root
    start = time.perf_counter()
    engine = Engine(model, config, init_unit=init)
    engine.close()
    seconds = time.perf_counter() - start
    record_source(folder, store, init.dtype)
    return {"seconds": seconds, "peak_rss_bytes": peak_rss_bytes()}


def byte_tokens(folder: Path) -> Path:
    """The built-in text as byte tokens in a ``.bin`` file under ``folder``, which ``train``
    reads as it is, whatever the model's tokenizer (ids below 256 lie in any Llama's vocabulary)."""
    from engine.run.data import load_tokens

    tokens, _ = load_tokens(cache_dir=folder)
    return Path(tokens.filename)  # type: ignore[attr-defined]  # a memmap of the cached token file


def finetune_phase(folder: Path, store: Path, tokens: Path, metrics: Path, steps: int, eval_batches: int) -> dict:
    """``train`` from the imported store for ``steps`` steps, optimizer and parameters on nvme,
    a validation loss after each; every step's record of the metrics file."""
    from engine.config import Config
    from engine.run.train import resumable, train

    overrides = [*plan(folder), *FINETUNE, f"model.hf={folder}", f"data.source={tokens}", f"nvme_path={store}"]
    overrides += [f"steps={steps}", f"eval_batches={eval_batches}", f"metrics={metrics}", f"log_every={steps}"]
    config = Config.from_dict({}, overrides)
    resumed = resumable(config)  # from the imported store, not the checkpoint again
    start = time.perf_counter()
    result = train(config)
    wall = time.perf_counter() - start
    keys = ("step", "loss", "val_loss", "seconds", "bytes_read", "bytes_written")
    records = [{k: r[k] for k in keys if k in r} for r in map(json.loads, metrics.read_text().splitlines())]
    steps_seconds = sum(r["seconds"] for r in records)  # the steps (validation included), not the start-up
    return {
        "seconds": steps_seconds,
        "wall_seconds": wall,
        "peak_rss_bytes": peak_rss_bytes(),
        "steps": records,
        "done": result.steps_done,
        "resumed": resumed,
    }


def reload_check(checkpoint: Path, store: Path, out: Path) -> dict[str, Any]:
    """Load the exported folder's config, and ``CHECKED`` from its shard: it must equal the
    store's trained value (cast to bf16) and, after a fine-tune, differ from the checkpoint's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.tools.consolidate import open_masters
    from engine.tools.export import unit_values

    settings = AutoConfig.from_pretrained(out, local_files_only=True)
    exported, first = read_tensor(out, CHECKED), read_tensor(checkpoint, CHECKED)
    with open_masters(store) as masters:
        unit = next(u for u in masters.layout.all_units if any(s.name == CHECKED for s in u.params))
        slot = next(s for s in unit.params if s.name == CHECKED)
        stored = unit_values(masters, unit)[slot.offset : slot.offset + slot.numel].view(slot.shape)
    result = {
        "config": settings.model_type,
        "tensor": CHECKED,
        "equals_store": torch.equal(exported, stored.to(exported.dtype)),
        "changed": not torch.equal(exported, first),
        "from_pretrained": None,
    }
    if disk_usage(out) <= FROM_PRETRAINED_MAX_BYTES:
        model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype="auto")
        result["from_pretrained"] = torch.equal(model.state_dict()[CHECKED], exported)
    return result


def read_tensor(folder: Path, name: str) -> Any:
    """One tensor of a Hugging Face folder, read from the shard its index names."""
    from safetensors import safe_open

    from engine.run.pretrained import INDEX_FILE, SINGLE_FILE

    index = folder / INDEX_FILE
    shard = json.loads(index.read_text())["weight_map"][name] if index.is_file() else SINGLE_FILE
    with safe_open(folder / shard, framework="pt") as weights:
        return weights.get_tensor(name)


def export_phase(store: Path, out: Path, checkpoint: Path) -> dict[str, Any]:
    """Export the store as a Hugging Face folder in bf16, then reload it (``reload_check``)."""
    from engine.tools.export import export

    start = time.perf_counter()
    export(store, out, dtype="bf16", max_shard_size="2GB")
    timing = {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes()}
    return timing | {"reload": reload_check(checkpoint, store, out)}


def in_process(phase: str, *paths: Path, options: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run one phase in a fresh process: its peak RSS is the phase's own."""
    command = [sys.executable, "-m", "benchmarks.pretrained", "--phase", phase, *options, *map(str, paths)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the {phase} phase failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(phase: str, timing: dict[str, float], read: int, written: int, raw: dict[str, float | bool]) -> dict:
    """A phase's throughput, and the same bytes' time at raw disk speed over its own."""
    at_raw = read / (float(raw["read"]) * 1e9) + written / (float(raw["write"]) * 1e9)
    return {
        "phase": phase,
        "read GB": read / 1e9,
        "written GB": written / 1e9,
        "seconds": timing["seconds"],
        "GB/s": (read + written) / 1e9 / timing["seconds"],
        "raw time / time": at_raw / timing["seconds"],
        "peak RSS GiB": timing["peak_rss_bytes"] / GIB,
    }


def run(params: float, work: Path, steps: int, eval_batches: int, moe: bool = False) -> dict[str, Any]:
    checkpoint, store, out = work / "checkpoint", work / "store", work / "exported"
    count = save_checkpoint(params, checkpoint, moe)
    raw = raw_disk_gbps(work, 1 * GIB if params >= 5e8 else 64 * MIB, threads=4)
    imported = in_process("import", checkpoint, store)
    rows = [row("import", imported, disk_usage(checkpoint), disk_usage(store), raw)]
    result: dict[str, Any] = {"params": count, "moe": moe, "raw_disk_gbps": raw}
    if steps:
        options = ("--finetune-steps", str(steps), "--eval-batches", str(eval_batches))
        paths = (checkpoint, store, byte_tokens(work / "tokens"), work / "metrics.jsonl")
        tuned = in_process("finetune", *paths, options=options)
        records = tuned["steps"]
        read, written = (sum(r[key] for r in records) for key in ("bytes_read", "bytes_written"))
        rows.append(row("finetune", tuned, read, written, raw))
        result["finetune"] = finetune_summary(tuned, steps)
    exported = in_process("export", store, out, checkpoint)
    rows.append(row("export", exported, 4 * count, disk_usage(out), raw))
    result["reload"] = exported.pop("reload")
    return result | {"rows": rows}


def finetune_summary(tuned: dict[str, Any], steps: int) -> dict[str, Any]:
    """What the issue asks of the fine-tune: every step's seconds, the validation loss at the
    first and last step (falling?), peak RSS and bytes moved."""
    records = tuned["steps"]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "steps": steps,
        "steps_done": tuned["done"],
        "resumed_the_import": tuned["resumed"],
        "seconds_per_step": [r["seconds"] for r in records],
        "loss": [r["loss"] for r in records],
        "val_loss": val,
        "val_loss_first": val[0],
        "val_loss_last": val[-1],
        "val_loss_fell": val[-1] < val[0],
        "wall_seconds": tuned["wall_seconds"],
        "peak_rss_bytes": tuned["peak_rss_bytes"],
        "bytes_read": sum(r["bytes_read"] for r in records),
        "bytes_written": sum(r["bytes_written"] for r in records),
    }


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9, help="parameters of the checkpoint (default 1e9)")
    parser.add_argument("--dir", type=Path, default=None, help="work folder on the disk to measure (default: tmp)")
    parser.add_argument(
        "--finetune-steps", type=int, help="fine-tune steps between import and export (default 0; --quick: 3)"
    )
    parser.add_argument("--moe", action="store_true", help="a Mixtral-style mixture of experts, not a Llama")
    parser.add_argument("--eval-batches", type=int, default=2, help="micro-batches per validation loss (default 2)")
    parser.add_argument("--phase", choices=["import", "finetune", "export"], help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(run_phase(args)))
        return
    setup_logging(args.verbose)
    params = 2e7 if args.quick else args.params
    steps = args.finetune_steps if args.finetune_steps is not None else (3 if args.quick else 0)
    with tempfile.TemporaryDirectory(prefix="bench-pretrained-", dir=args.dir) as work:
        result = run(params, Path(work), steps, args.eval_batches, args.moe)
    what = "import, fine-tune and export" if steps else "import and export"
    kind = "mixture-of-experts " if args.moe else ""
    print_table(f"{what} of a {result['params'] / 1e9:.2f}B-parameter bf16 {kind}checkpoint", result["rows"])
    if steps:
        tuned = result["finetune"]
        print(
            f"fine-tune: {tuned['steps_done']} steps, validation loss {tuned['val_loss_first']:.4f} -> "
            f"{tuned['val_loss_last']:.4f}; exported and reloaded: {result['reload']}"
        )
    save_json(args.out, "pretrained", result)


def run_phase(args: argparse.Namespace) -> dict[str, Any]:
    """The phase ``--phase`` names, in this process."""
    if args.phase == "finetune":
        folder, store, tokens, metrics = args.paths
        return finetune_phase(folder, store, tokens, metrics, args.finetune_steps, args.eval_batches)
    return (import_phase if args.phase == "import" else export_phase)(*args.paths)


if __name__ == "__main__":
    main()
