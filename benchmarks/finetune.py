"""A chat fine-tune whose training state exceeds RAM, end to end: phases and steps against the disk's bandwidth.

- write: a Llama of about ``--params`` parameters (Llama-3-8B's width: hidden 4096, intermediate
  14336, 32 heads, 8 key/value heads; the depth makes up ``--params``; the vocabulary is the
  ChatML tokenizer of ``benchmarks.chat``), random bf16 weights saved shard by shard under the
  names and shapes ``save_pretrained`` writes, the model never whole in memory;
- import: the checkpoint streamed into a stage-3 store unit by unit (``model.hf``'s path);
- fine-tune: ``python -m engine train`` on generated chat records, everything on nvme, the loss
  on the assistant's replies, packed, in the compute dtype the machine runs fastest (bf16 or
  fp32), activations recomputed, clipped at 1.0, int8 moments, bf16 masters and spilled
  gradients, each unit updated in the next forward
  (``--no-defer-update``: after backward), a validation loss every ``--stop-after`` steps; stopped by SIGTERM once
  step ``--stop-after`` is recorded (the step in flight finishes and commits), then resumed
  from the store to ``--steps``;
- export: ``python -m engine export`` (bf16, the checkpoint's layout), its first shard read back
  and compared with the store's values;
- generate: ``python -m engine generate``, ``--tokens`` tokens after a ChatML prompt.

Every phase but the write runs in a process of its own: its seconds, the bytes it read and
wrote (the kernel's count for that process), GB/s and the same bytes' time at raw O_DIRECT disk
speed (measured in the same run) over its own (the import's also less its process's start-up,
which streams nothing), its peak RSS; and each step's seconds against
its bound, the larger of its bytes (the engine's count) at raw disk speed and its compute alone
(``benchmarks.compute_only``, in the run's dtype). Before anything is written, each phase's
disk use is planned (the store as the engine estimates it, ``engine.tools.estimate``;
checkpoint and export at 2 B/param) and a plan over the free space refused: the checkpoint is
deleted once imported (the store keeps the model's config and tokenizer, and every later run
resumes from it), the export once checked. The work folder's size is sampled throughout; its
peak is reported beside the plan's. The training processes' peak RSS is reported beside the
engine's estimate of it (``engine.tools.estimate``, the baseline measured with the model's code
loaded), with the phase the estimate puts it in and the largest unit, which sizes every buffer
a unit is staged through.

``--moe``: a Mixtral-style mixture of experts (8 experts, 2 a token), 10.5B parameters by
default, from its config with random weights and no checkpoint (initialised in a process of its
own by ``Engine(model, config, init_unit=...)``, as the Python API builds any model; the fine-tune
then resumes that store), each layer's experts a unit of their own inside the layer's unit.

    python -m benchmarks.finetune --dir /path/on/nvme
    python -m benchmarks.finetune --params 3e9 --steps 6 --stop-after 3 --dir /path/on/nvme
    python -m benchmarks.finetune --moe --dir /path/on/nvme
    python -m benchmarks.finetune --quick [--moe]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bandwidth import drop_page_cache, raw_disk_gbps
from benchmarks.chat import save_chat_tokenizer, write_chat_jsonl
from benchmarks.compute_only import hf_compute_seconds, run_dtype
from benchmarks.giant import POLL_S, TreeRSS, step_rows, steps_recorded, with_mixed_bound
from benchmarks.llama_checkpoint import meta_of, model_config, random_values, write_checkpoint
from benchmarks.phase_plot import phase_rows, phase_steps
from benchmarks.pretrained import CHECKED, read_tensor, row
from benchmarks.report import base_parser, print_table, save_json, setup_logging
from benchmarks.runs import REPO_ROOT, DiskPeak, disk_usage
from benchmarks.sft import TOKENIZER_VOCAB, AnonymousPeak
from engine.run.pretrained import SOURCE_FOLDER, Pretrained, meta_model
from engine.runtime.rss import peak_rss_bytes
from engine.runtime.sizes import GIB, MIB

GB = 1e9
MOE_UNITS = '["MixtralDecoderLayer", "MixtralExperts"]'
LLAMA_UNITS = '["LlamaDecoderLayer", "Linear"]'
"""Each projection a unit of its own inside its layer's: every buffer the engine sizes by the
largest unit (staging, gathered parameters, gradient shards) shrinks from a layer (218M
parameters at 8B) to the largest projection (59M), which takes the peak RSS from 8.1 GiB to
3.1 GiB by ``engine.tools.estimate``."""
SLACK_BYTES, MARGIN = 64 * MIB, 1.03
"""The plan's allowance for small files (config, tokenizer, records, logs), and its factor for
the store's metadata and padding beyond the estimate (1% here at 20M parameters)."""
PROMPT = [{"role": "system", "content": "You continue lines of Shakespeare."}]
PROMPT += [{"role": "user", "content": "To be, or not to be, that is the question:"}]
PLAN_SECTIONS = ("zero.", "offload.", "store.", "precision.", "optim.")
"""The keys ``generate`` takes from the run: the store's layout and forms."""
PLAN = {"zero.stage": 3, "offload.param": "nvme", "offload.optimizer": "nvme", "store.mode": "in-place"}
FORMS = {"optim.state_dtype": "int8", "optim.master_dtype": "bf16", "offload.grad_spill_dtype": "bf16"}
TRAINING = {"optim.grad_clip": 1.0, "optim.lr": 1e-4, "optim.warmup_steps": 0}
TRAINING |= {"data.train_on": "completion", "data.pack": "true", "data.val_fraction": 0.1}
TRAINING |= {"train.eval_batches": 1, "train.log_every": 1, "zero.activation_checkpointing": "true"}
"""The run: everything on nvme, compact state forms (the bf16 masters cast to the machine's
compute dtype, ``auto``), clipped, the loss on the assistant's replies, packed, activations
recomputed (as TRL's and axolotl's ``gradient_checkpointing`` at this size: kept, a 7.9B
Llama's 36 layers hold about 2 GiB of them at 256 tokens)."""
UNWRITTEN = ("model.hf", "data.source")
"""The keys the plan leaves out: it is made before their files are written."""


def run_settings(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The ``python -m engine train`` settings of both runs (and of the import)."""
    paths = {"offload.nvme_path": work / "store", "model.hf": work / "model", "data.source": work / "chat.jsonl"}
    data = {"data.seq_len": args.seq_len, "data.micro_batch": args.micro_batch, "train.eval_every": args.stop_after}
    data |= {"zero.prefetch_mb": args.prefetch_mb, "optim.defer_update": str(args.defer_update).lower()}
    steps_and_metrics = {"train.steps": args.steps, "train.metrics": work / "metrics.jsonl"}
    settings = PLAN | FORMS | TRAINING | paths | data | steps_and_metrics
    return settings | {"zero.unit_classes": MOE_UNITS if args.moe else LLAMA_UNITS}


def cli_args(settings: dict[str, Any], keep: tuple[str, ...] = ("",)) -> list[str]:
    """``--section.key value`` (in kebab-case) of the settings whose keys start with one of ``keep``."""
    chosen = [(key, value) for key, value in settings.items() if key.startswith(keep)]
    return [part for key, value in chosen for part in (f"--{key.replace('_', '-')}", str(value))]


def config_of(arguments: list[str]) -> Any:
    """The config ``python -m engine train`` reads from ``cli_args``."""
    from engine.config import Config

    pairs = zip(arguments[::2], arguments[1::2], strict=True)
    return Config.from_dict({}, [f"{key[2:].replace('-', '_')}={value}" for key, value in pairs])


def planned_config(settings: dict[str, Any]) -> Any:
    """The runs' config, the paths not yet written left out."""
    return config_of(cli_args({k: v for k, v in settings.items() if k not in UNWRITTEN}))


def planned_run(model: Any, settings: dict[str, Any]) -> tuple[Any, Any]:
    """The runs' config (``planned_config``) and ``engine.tools.estimate``'s shape of them."""
    from engine.tools.estimate import run_shape

    config = planned_config(settings)
    return config, run_shape(config, 1, model=model)


def estimated_peak(folder: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """What ``engine.tools.estimate`` predicts for the fine-tune's processes (their baseline
    measured with the model's code and tokenizer loaded): the peak RSS and its phase, and the
    largest unit, which sizes every buffer a unit is staged through."""
    from engine.tools.estimate import estimate, measured_baseline_bytes, plan_of

    config, run = planned_run(meta_model(str(folder)), settings)
    predicted = estimate(run, plan_of(config), baseline_bytes=measured_baseline_bytes(str(folder)))
    largest = max(u.numel for u in run.layout.all_units)
    return {"peak_rss_bytes": predicted.peak_rss_bytes, "phase": predicted.peak_phase, "largest_unit": largest}


def disk_plan(model: Any, settings: dict[str, Any], probe: int, moe: bool) -> list[dict[str, Any]]:
    """The bytes on disk in each phase: the store as the engine estimates it (its spilled
    gradients only while training), checkpoint and export at 2 B/param, the I/O settings' probe
    (``offload.tuning``, which the engine's first run on a disk makes), with ``MARGIN`` and
    ``SLACK_BYTES``."""
    from engine.tools.estimate import plan_of, scratch_bytes, store_bytes
    from offload.tuning import PROBE_BYTES

    config, run = planned_run(model, settings)
    store, scratch = store_bytes(run, plan_of(config)), scratch_bytes(run, plan_of(config))
    weights = 2 * sum(p.numel() for p in model.parameters())
    checkpoint = 0 if moe else weights
    phases = [("raw disk probe", probe, "its file, once measured")]
    phases += [] if moe else [("write checkpoint", checkpoint, "")]
    # The engine's own first run on a disk measures it for its I/O settings, before it writes the store.
    phases += [("I/O settings probe", checkpoint + PROBE_BYTES, "its files, once measured (a disk's first run)")]
    phases += [
        ("initialise" if moe else "import", checkpoint + store - scratch, "" if moe else "the checkpoint"),
        ("fine-tune", store, "the spilled gradients"),
        ("export", store - scratch + weights, "the export, once checked"),
        ("generate", store - scratch, "everything"),
    ]
    return [{"phase": p, "on disk GB": (MARGIN * b + SLACK_BYTES) / GB, "then deleted": d} for p, b, d in phases]


def run_process(command: list[str], log: Path, stdout: Path | None = None, stop: tuple | None = None) -> dict:
    """Run ``command`` to its end, refused in one line with its log's tail if it fails: its
    seconds, peak RSS (its process tree, polled), bytes read and written (the kernel's count,
    ``wait4``); with ``stop = (metrics, step)``, SIGTERM once the metrics file records that step."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": path}  # `benchmarks` is a folder of the repo
    with open(log, "a") as err, open(stdout or log, "a") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err, env=env)
    rss, sent = TreeRSS(proc.pid), None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        records = steps_recorded(stop[0]) if stop and sent is None else []
        if stop and records and records[-1]["step"] >= stop[1]:
            proc.send_signal(signal.SIGTERM)
            sent = "SIGTERM"
        time.sleep(POLL_S)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, for its rusage
    if proc.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"{shlex.join(command[1:4])} failed (exit code {proc.returncode}):\n{tail}")
    timing = {"seconds": time.perf_counter() - start, "signal": sent, "peak_rss_bytes": rss.stop()}
    return timing | {"read": usage.ru_inblock * 512, "written": usage.ru_oublock * 512}


class RandomInit(Pretrained):
    """The ``init_unit`` of a model started from its config: ``random_values`` of each parameter
    (a ``Pretrained`` to the train loop, which asks for one, with no checkpoint to read)."""

    dtype = "bf16"  # type: ignore[assignment]  # the dtype the store records, for export

    def __init__(self) -> None:
        pass

    def __call__(self, params: dict[str, Any]) -> None:
        for name, param in params.items():
            param.detach().copy_(random_values(name, tuple(param.shape), param.dtype))


def from_config(folder: str, seq_len: int) -> tuple[Any, Any]:
    """In place of ``engine.run.pretrained.pretrained_model``: the meta model of ``folder``'s
    config.json, its ``init_unit`` random."""
    return meta_model(folder), RandomInit()


def import_phase(arguments: list[str], moe: bool) -> dict[str, Any]:
    """The engine built from ``model.hf`` into a new store (a mixture of experts from its config,
    random), as ``train``'s first start builds it; the store records the folder. Its start-up:
    the process's seconds until the build starts (Python, torch, transformers' model code, the
    meta model), which move none of the checkpoint's bytes."""
    import psutil

    from engine.engine import Engine
    from engine.run.pretrained import pretrained_model, record_source
    from engine.runtime.heap import tune_heap

    tune_heap()  # as python -m engine train: host RSS is what is live
    config = config_of(arguments)
    folder, store = Path(config.model.hf), Path(config.offload.store_path)
    model, init = from_config(str(folder), 0) if moe else pretrained_model(str(folder), config.data.seq_len)
    start_up = time.time() - psutil.Process().create_time()
    Engine(model, config, init_unit=init).close()
    record_source(folder, store, init.dtype)
    return {"peak_rss_bytes": peak_rss_bytes(), "start_up_s": start_up}


def in_process(arguments: list[str], log: Path, moe: bool) -> dict[str, Any]:
    """``import_phase`` in a fresh process: ``run_process``'s numbers, with the peak RSS the
    kernel recorded for it (its high-water mark, not polled)."""
    command = [sys.executable, "-m", "benchmarks.finetune", "--phase", "import", *(["--moe"] if moe else [])]
    result = run_process([*command, *arguments], log, stdout=log.with_suffix(".out"))
    return result | json.loads(log.with_suffix(".out").read_text().splitlines()[-1])


def export_check(store: Path, out: Path, initial: Any) -> dict[str, Any]:
    """The export's first shard read back: each tensor the store holds under its name equal to
    the store's value (cast to bf16); ``CHECKED`` changed from ``initial`` (the checkpoint's)."""
    from safetensors import safe_open

    from engine.run.pretrained import checkpoint_files
    from engine.tools.consolidate import open_masters
    from engine.tools.export import unit_values

    first = checkpoint_files(out)[0]
    equal, compared = True, []
    with safe_open(first, framework="pt") as shard, open_masters(store) as masters:
        slots = {s.name: (u, s) for u in masters.layout.all_units for s in u.params}
        names = [n for n in shard.keys() if n in slots]  # noqa: SIM118 (safe_open is not a mapping)
        for unit in {id(slots[n][0]): slots[n][0] for n in names}.values():
            values = unit_values(masters, unit)
            for slot in (s for s in unit.params if s.name in names):
                stored = values[slot.offset : slot.offset + slot.numel].view(slot.shape)
                exported = shard.get_tensor(slot.name)
                equal &= torch.equal(exported, stored.to(exported.dtype))
                compared.append(slot.name)
    changed = None if initial is None else not torch.equal(read_tensor(out, CHECKED), initial)
    return {"shard": first.name, "tensors": len(compared), "equals_store": equal and bool(compared), "changed": changed}


def generate_phase(work: Path, settings: dict[str, Any], tokens: int) -> dict[str, Any]:
    """``python -m engine generate`` from the store (its model and tokenizer recorded there)
    after a ChatML prompt; the text it adds."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(settings["offload.nvme_path"]) / SOURCE_FOLDER)
    prompt = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    command = [sys.executable, "-m", "engine", "generate", "--prompt", prompt, "--tokens", str(tokens)]
    command += cli_args(settings, PLAN_SECTIONS)
    log, out = work / "generate.log", work / "generate.out"
    result = run_process(command, log, stdout=out)
    return result | {"text": out.read_text().removeprefix(prompt).removesuffix("\n")}


def fine_tune(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run stopped by SIGTERM after ``--stop-after`` steps, then resumed to ``--steps``."""
    from offload import read_committed

    settings = run_settings(work, args)
    metrics, log = settings["train.metrics"], work / "train.log"
    command = [sys.executable, "-m", "engine", "train", *cli_args(settings)]  # resumes the import's store
    first = run_process(command, log, stop=(metrics, args.stop_after))
    if first["signal"] is None:
        raise SystemExit(f"the run ended before step {args.stop_after} could be seen: lower --stop-after")
    committed = (read_committed(settings["offload.nvme_path"]) or {}).get("step")
    stopped_at = len(steps_recorded(metrics))
    if committed is not None and committed >= args.steps:
        raise SystemExit(f"SIGTERM came after the last step ({committed}) committed, so nothing resumed: raise --steps")
    resumed = run_process(command, log)
    records = steps_recorded(metrics)
    return {"first": first, "resumed": resumed, "records": records, "stopped_at": stopped_at, "committed": committed}


def prepare(work: Path, args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]], int, int]:
    """The model's config and the disk plan, refused in one line if it does not fit the free space."""
    settings = model_config(args.params, TOKENIZER_VOCAB, args.moe, positions=max(512, args.seq_len))
    model = meta_of(settings)
    plan = disk_plan(model, run_settings(work, args), args.probe_bytes, args.moe)
    free = shutil.disk_usage(work).free
    count = sum(p.numel() for p in model.parameters())
    what = f"{count / 1e9:.2f}B-parameter {'mixture of experts' if args.moe else 'Llama'}"
    print_table(f"disk plan of the {what} in {work} ({free / GB:.1f} GB free)", plan)
    peak = max(plan, key=lambda p: p["on disk GB"])
    if peak["on disk GB"] * GB > free:
        raise SystemExit(
            f"the run needs {peak['on disk GB']:.1f} GB at its peak ({peak['phase']}) but {work} has "
            f"{free / GB:.1f} GB free: pass --dir on a larger disk, or a smaller --params"
        )
    return settings, plan, free, count


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    settings, plan, free, count = prepare(work, args)
    disk = DiskPeak(work, 0.1 if args.quick else 5.0)  # a walk of the store costs 0.05 CPU-s at 3B
    raw = raw_disk_gbps(work, args.probe_bytes, threads=4, reps=1 if args.quick else 3)
    compute = compute_bound(settings, run_settings(work, args), args)
    folder, rows, initial = work / "model", [], None
    folder.mkdir()
    save_chat_tokenizer(folder, vocab_size=TOKENIZER_VOCAB)
    write_chat_jsonl(work / "chat.jsonl", args.records)
    if args.moe:
        settings.save_pretrained(folder)
    else:
        start = time.perf_counter()
        with AnonymousPeak() as anonymous:
            params = write_checkpoint(settings, folder)
        written = {"seconds": time.perf_counter() - start, "peak_rss_bytes": anonymous.peak}
        rows.append(row("write checkpoint", written, 0, 2 * params, raw))
        initial = read_tensor(folder, CHECKED)
        drop_page_cache()  # the import reads the checkpoint from disk, as a downloaded one
    runs = run_settings(work, args)
    estimated = estimated_peak(folder, runs)
    train_args = cli_args(runs)
    imported = in_process(train_args, work / "import.log", args.moe)
    rows.append(phase_row("initialise" if args.moe else "import", imported, raw))
    rows[-1] |= {"start-up s": imported["start_up_s"], "raw time / streamed time": streamed(rows[-1], imported)}
    shutil.rmtree(folder)  # the store keeps the config and tokenizer: every later run reads them there
    tuned = fine_tune(work, args)
    bound = {"read_gbps": raw["read"], "write_gbps": raw["write"]} | compute
    bound = with_mixed_bound(bound, tuned["records"], work, args.quick)
    rows += [phase_row("fine-tune (stopped)", tuned["first"], raw), phase_row("resumed", tuned["resumed"], raw)]
    store_bytes = disk_usage(work / "store")
    out, log = work / "exported", work / "export.log"
    command = [sys.executable, "-m", "engine", "export", str(work / "store"), str(out)]
    rows.append(phase_row("export", run_process(command, log), raw))
    check = export_check(work / "store", out, initial)
    export_bytes = disk_usage(out)
    shutil.rmtree(out)
    generated = generate_phase(work, run_settings(work, args), args.tokens)
    rows.append(phase_row("generate", generated, raw))
    sizes = {"free": free, "planned_peak": max(p["on disk GB"] for p in plan) * GB, "measured_peak": disk.stop()}
    sizes |= {"store_after_fine_tune": store_bytes, "export": export_bytes}
    result = {"rows": rows, "plan": plan, "disk": sizes, "raw": raw, "bound": bound, "tuned": tuned, "check": check}
    return result | {"gen": generated, "params": count, "estimated": estimated}


def compute_bound(hf_config: Any, settings: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """The compute-only floor of a training step (activations recomputed, as the run does) and
    of a validation's forward, in the dtype the run computes in (``benchmarks.compute_only``)."""
    dtype = run_dtype(planned_config(settings))
    tokens = torch.Size((args.micro_batch, args.seq_len))
    seconds = hf_compute_seconds(hf_config, tokens, dtype, ("recompute", "forward"), reps=1 if args.quick else 3)
    step_s, eval_s = seconds["recompute"], seconds["forward"]
    print(f"compute-only in {str(dtype).removeprefix('torch.')}: a step {step_s:.2f} s, a validation {eval_s:.2f} s")
    return {"compute_s": step_s, "eval_s": eval_s}


def phase_row(phase: str, result: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    return row(phase, result, result["read"], result["written"], raw)


def streamed(done: dict[str, Any], result: dict[str, Any]) -> float:
    """A phase's bytes' time at raw disk speed over its seconds less its start-up."""
    return done["raw time / time"] * done["seconds"] / (done["seconds"] - result["start_up_s"])


def summary(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The verdicts: stopped and resumed where it was stopped, finished, exported as stored,
    text generated, the disk within its plan."""
    tuned, check, disk, estimated = result["tuned"], result["check"], result["disk"], result["estimated"]
    records = tuned["records"]
    training = [r["peak RSS GiB"] for r in result["rows"] if r["phase"] in ("fine-tune (stopped)", "resumed")]
    steps = [r["step"] for r in records]
    return {
        "stopped_by": tuned["first"]["signal"],
        "committed_at_stop": tuned["committed"],
        "resumed_from": steps[tuned["stopped_at"]] - 1 if len(steps) > tuned["stopped_at"] else None,
        "steps_done": steps[-1] if steps else 0,
        "steps_in_order": steps == list(range(1, args.steps + 1)),
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
        "export_equals_store": check["equals_store"],
        "export_tensors_checked": check["tensors"],
        "export_changed": check["changed"],
        "generated": result["gen"]["text"],
        "planned_peak_GB": disk["planned_peak"] / GB,
        "measured_peak_GB": disk["measured_peak"] / GB,
        "within_plan": disk["measured_peak"] <= disk["planned_peak"],
        "training_peak_RSS_GiB": max(training),
        "estimated_peak_RSS_GiB": estimated["peak_rss_bytes"] / GIB,
        "estimated_peak_at": estimated["phase"],
        "largest_unit_M": estimated["largest_unit"] / 1e6,
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, help="parameters (default 8e9; --moe 1.05e10; --quick 2e7)")
    parser.add_argument("--steps", type=int, help="optimizer steps in all (default 4; --quick 3)")
    parser.add_argument(
        "--stop-after",
        type=int,
        help="steps recorded before SIGTERM; the step in flight then commits (default 2; --quick 1)",
    )
    parser.add_argument("--dir", type=Path, help="work folder on the disk to measure (default: a temporary one)")
    parser.add_argument("--moe", action="store_true", help="a Mixtral-style mixture of experts from its config")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens a sequence (default 256)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences a step (default 1)")
    parser.add_argument(
        "--prefetch-mb", default="auto", help="zero.prefetch_mb (default auto: two of the largest unit)"
    )
    parser.add_argument(
        "--defer-update",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="optim.defer_update: each unit updated in the next forward, just before it runs (default on)",
    )
    parser.add_argument("--records", type=int, help="chat records generated (default 400; --quick 60)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens generate samples (default 8)")
    parser.add_argument("--phase", choices=["import"], help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args(argv)
    if extra and args.phase is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.params = args.params or (2e7 if args.quick else 1.05e10 if args.moe else 8e9)
    args.steps, args.records = args.steps or (3 if args.quick else 4), args.records or (60 if args.quick else 400)
    args.stop_after = args.stop_after or (1 if args.quick else 2)
    args.probe_bytes = 64 * MIB if args.quick else GIB
    if not 1 <= args.stop_after <= args.steps - 2:  # the step in flight at SIGTERM commits: one more must be left
        parser.error(f"--stop-after must be in [1, --steps - 2] = [1, {args.steps - 2}] (or raise --steps)")
    return args, extra


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, extra = parse_args(argv)
    if args.phase == "import":
        print(json.dumps(import_phase(extra, args.moe)))
        return {}
    setup_logging(args.verbose)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-finetune-", dir=args.dir) as work:
        result = run(Path(work), args)
    raw = result["raw"]
    against = f"raw disk: write {raw['write']:.2f}, read {raw['read']:.2f} GB/s"
    print_table(f"phases ({against}; bytes: the kernel's count for the phase's process)", result["rows"])
    tuned = result["tuned"]
    runs = ["first"] * tuned["stopped_at"] + ["resumed"] * (len(tuned["records"]) - tuned["stopped_at"])
    steps = step_rows(tuned["records"], runs, result["bound"])
    title = "steps (bound: the larger of the compute-only step and the step's bytes read and written at raw disk "
    title += "speed, one after the other; mixed bound: the bytes at the disk's speed reading and writing at once; "
    title += "a validation counts in the step after it, its forward in that step's compute-only floor)"
    print_table(title, steps)
    phases = phase_steps(tuned["records"], runs)
    print_table("each step's phases", phase_rows(phases))
    verdicts = summary(result, args)
    print_table("summary", [verdicts])
    payload = {"params": result["params"], "moe": args.moe, "rows": result["rows"], "steps": steps, "phases": phases}
    payload |= {
        "disk_plan": result["plan"],
        "disk": result["disk"],
        "summary": verdicts,
        "raw_disk_gbps": raw,
        "bound": result["bound"],
    }
    save_json(args.out, "finetune-moe" if args.moe else "finetune", payload)
    return payload


if __name__ == "__main__":
    main()
