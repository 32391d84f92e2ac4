"""Import and export of a pretrained checkpoint against the disk's own bandwidth.

A randomly initialised Llama of about ``--params`` parameters is saved in bf16 shards, as
``save_pretrained`` writes a downloaded model. Then, each in its own process so that its peak
RSS is its own: the engine imports it into a stage-3 store with parameters and optimizer state
on nvme (every unit read from the checkpoint and written to the store), and ``export`` writes the
store back as a Hugging Face folder. Each phase's bytes read and written per second are set
against raw O_DIRECT disk bandwidth measured in the same run.

    python -m benchmarks.pretrained --params 1e9 --dir /path/on/nvme
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
from engine.runtime.sizes import GIB, MIB

VOCAB = 32_000


def llama_config(params: float) -> Any:
    """A Llama whose width follows its size and whose depth makes up ``params``."""
    from transformers import LlamaConfig

    hidden = 2048 if params >= 5e8 else 256
    layers = max(1, round((params - 2 * VOCAB * hidden) / (12 * hidden * hidden)))
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=512,
    )


def save_checkpoint(params: float, folder: Path) -> int:
    """Save a random model of about ``params`` parameters in bf16 shards; its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(params)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="500MB")
    return sum(p.numel() for p in model.parameters())


def import_phase(folder: Path, store: Path) -> dict[str, float]:
    """Import the checkpoint into a new stage-3 store, everything on nvme."""
    from engine.config import Config
    from engine.engine import Engine
    from engine.run.pretrained import pretrained_model, record_source

    model, init = pretrained_model(str(folder), seq_len=128)
    overrides = ["stage=3", "offload.param=nvme", "offload.optimizer=nvme", "compute_dtype=bf16"]
    config = Config.from_dict({}, [*overrides, f"nvme_path={store}"])  # buffer_mb "auto": sized for the root
    start = time.perf_counter()
    engine = Engine(model, config, init_unit=init)
    engine.close()
    seconds = time.perf_counter() - start
    record_source(folder, store, init.dtype)
    return {"seconds": seconds, "peak_rss_bytes": peak_rss_bytes()}


def export_phase(store: Path, out: Path) -> dict[str, float]:
    """Export the store as a Hugging Face folder in bf16."""
    from engine.tools.export import export

    start = time.perf_counter()
    export(store, out, dtype="bf16", max_shard_size="2GB")
    return {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes()}


def peak_rss_bytes() -> int:
    """This process's own resident high-water mark. Not ``ru_maxrss``, which ``execve`` keeps
    from the parent (here the process that built the whole checkpoint model)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def in_process(phase: str, *paths: Path) -> dict[str, float]:
    """Run one phase in a fresh process: its peak RSS is the phase's own."""
    command = [sys.executable, "-m", "benchmarks.pretrained", "--phase", phase, *map(str, paths)]
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


def run(params: float, work: Path) -> dict[str, Any]:
    checkpoint, store, out = work / "checkpoint", work / "store", work / "exported"
    count = save_checkpoint(params, checkpoint)
    raw = raw_disk_gbps(work, 1 * GIB if params >= 5e8 else 64 * MIB, threads=4)
    imported = in_process("import", checkpoint, store)
    exported = in_process("export", store, out)
    rows = [
        row("import", imported, disk_usage(checkpoint), disk_usage(store), raw),
        row("export", exported, 4 * count, disk_usage(out), raw),
    ]
    return {"params": count, "raw_disk_gbps": raw, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9, help="parameters of the checkpoint (default 1e9)")
    parser.add_argument("--dir", type=Path, default=None, help="work folder on the disk to measure (default: tmp)")
    parser.add_argument("--phase", choices=["import", "export"], help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        phase = import_phase if args.phase == "import" else export_phase
        print(json.dumps(phase(*args.paths)))
        return
    setup_logging(args.verbose)
    params = 2e7 if args.quick else args.params
    with tempfile.TemporaryDirectory(prefix="bench-pretrained-", dir=args.dir) as work:
        result = run(params, Path(work))
    print_table(f"import and export of a {result['params'] / 1e9:.2f}B-parameter bf16 checkpoint", result["rows"])
    save_json(args.out, "pretrained", result)


if __name__ == "__main__":
    main()
