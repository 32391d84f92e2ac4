"""``python -m engine <command>``, also installed as ``offload-engine``: ``docs/cli.md`` has each
command, ``<command> --help`` its flags (and for ``train``, ``estimate`` and ``generate``, every
config key, from ``engine.config_docs``).

- ``train``, ``estimate`` and ``generate`` take a config: ``--config FILE`` (TOML, JSON or YAML)
  and any key as ``--section.key value`` (``--key value`` where the key is unique); ``--seed N``
  sets ``train.seed`` and ``data.seed``; ``--print-config`` prints the result as TOML and exits.
- ``inspect``, ``consolidate``, ``gather``, ``export`` and ``plot`` read a store or a run's records.

Every flag is spelled in kebab-case (``--from-checkpoint``, ``--seq-len``); the snake_case of
the config file (``--seq_len``) and the old ``--checkpoint TAG`` still work, each with a
deprecation warning. Every error ends the command with one line on stderr naming the fix, exit
code 2 for a bad config and 1 for anything else (130 on Ctrl-C); ``--debug`` (before the
command) adds the traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config import Config, ConfigError
from engine.config_docs import SHORTHANDS
from engine.config_parse import to_toml
from engine.runtime.sizes import GIB

if TYPE_CHECKING:  # torch loads only once a command needs it
    from engine.runtime.comm import Comm
    from engine.tools.estimate import Plan

logger = logging.getLogger("engine")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
EXPLAINED = (OSError, ValueError, ImportError, FloatingPointError, RuntimeError)
"""Errors raised with a message for the user (missing paths, damaged stores, a diverged loss,
a missing package); any other type is a bug, reported with its type and the way to its traceback."""


ALIASES = {"--checkpoint": "--from-checkpoint"}
"""Old names of flags, still accepted with a deprecation warning: one flag names the checkpoint
to read on every command."""


def _respell(argv: list[str]) -> tuple[list[str], list[str]]:
    """Every flag in its one spelling, kebab-case, and a deprecation notice for each other
    spelling met (``--seq_len``, ``--checkpoint``), which still works: one convention for the
    command's own flags and the config keys, with the file's snake_case kept working."""
    out: list[str] = []
    notices: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":  # what follows is positional, whatever it looks like
            return out + argv[i:], notices
        name, equals, value = arg.partition("=")
        new = ALIASES.get(name, name.replace("_", "-")) if name.startswith("--") else name
        if new != name:
            notices.append(f"{name} is deprecated: write {new} (flags are kebab-case; the old spelling still works)")
        out.append(new + equals + value)
    return out, notices


def _overrides(extra: list[str]) -> list[str]:
    """``--a.b-c 1 --d=2`` -> ``["a.b_c=1", "d=2"]``: the flags' kebab-case as the config's keys;
    a shorthand (``--seed``) gives each key it stands for."""
    out: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --key value")
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(extra):
            name, value = arg[2:], extra[i + 1]
            i += 2
        else:
            raise ConfigError(f"override {arg} has no value")
        key = name.replace("-", "_")
        out.extend(f"{full}={value}" for full in SHORTHANDS.get(key, (key,)))
    return out


def _log_level(name: str) -> str:
    """``--log-level``'s type: a level name in any case, refused by argparse with the choices."""
    if name.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{name!r} is not a log level: use one of {', '.join(LOG_LEVELS)}")
    return name.upper()


def _positive(kind: type[int | float]) -> Callable[[str], int | float]:
    """An argparse type for a finite number > 0, so that a bad size fails before torch loads."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
            ok = math.isfinite(value) and value > 0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'} > 0")
        return value

    return parse


def _failure(err: Exception, debug: bool) -> tuple[str, int]:
    """The one line reporting ``err`` (a wrapped message hides its start from ``tail -1``) and the
    exit code: 2 for a config to fix, 1 for anything else. A type no message was written for
    is a bug: the line names the type and, unless it follows, the way to the traceback."""
    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, ConfigError):
        return f"config error: {message}", 2
    if isinstance(err, EXPLAINED) and message:
        return message, 1
    line = f"unexpected {type(err).__name__}" + (f": {message}" if message else "")
    return line + ("" if debug else " (rerun with --debug for the traceback)"), 1


def _load_config(path: str | None, extra: list[str]) -> Config:
    overrides = _overrides(extra)
    return Config.load(path, overrides) if path else Config.from_dict({}, overrides)


def _set_threads() -> None:
    """Share the cores among the ranks on this node, as torch's default does not."""
    import torch  # here, so that a bad config is reported without waiting for torch to load

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def _recommended_plan(config: Config, world_size: int) -> Plan:
    """The least offload that fits this machine, logged; ConfigError naming what is short if none."""
    from engine.tools.estimate import (
        Machine,
        estimate_plans,
        measured_baseline_bytes,
        recommend,
        run_shape,
        why_none_fits,
    )

    estimates = estimate_plans(run_shape(config, world_size), baseline_bytes=measured_baseline_bytes(config.model.hf))
    machine = Machine.detect(config)
    best = recommend(estimates, machine, config)
    if best is None:
        raise ConfigError(
            f"--plan auto: {why_none_fits(estimates, machine, config)} (every plan: python -m engine estimate)"
        )
    logger.info(
        "--plan auto: %s (predicted peak RSS %.2f GiB per rank, store %.2f GiB)",
        best.plan,
        best.peak_rss_bytes / GIB,
        best.disk_bytes / GIB,
    )
    return best.plan


def _auto_plan(config: Config, overwrite: bool) -> tuple[Config, Comm | None]:
    """``--plan auto``: the config with the recommended plan, the same on every rank (rank 0's
    choice: RAM and disk measured a moment apart could tip ranks to different plans), and the
    process group it was agreed in, for the engine to join and the caller to close."""
    from engine.run.train import resumable
    from engine.runtime.comm import Comm
    from engine.runtime.native_dtype import settle_compute_dtype
    from engine.tools.estimate import plan_of

    if resumable(config, overwrite):  # the store's run continues as it was planned
        logger.info("--plan auto: resuming from %s keeps its plan (%s)", config.offload.nvme_path, plan_of(config))
        return config, None
    comm = Comm.join()
    config = settle_compute_dtype(config, comm)  # once for the plan's estimate and the engine: one log line
    choice, error = None, None
    if comm.rank == 0:
        try:
            choice = _recommended_plan(config, comm.world_size)
        except (ConfigError, OSError, RuntimeError) as err:  # every rank must hear of it, or the others wait
            error = err
    choice, error = comm.all_gather_object((choice, error))[0]
    if error is not None:
        comm.close()
        raise error
    assert choice is not None  # rank 0 either chose or failed
    return choice.apply(config), comm


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    config = _load_config(args.config, extra)  # first: a bad config is reported before torch loads
    from engine.runtime.heap import tune_heap

    tune_heap()  # before torch allocates: host RSS is what is live, and fresh buffers come in huge pages
    from engine.run.train import train

    group = None
    if args.plan == "auto":
        config, group = _auto_plan(config, args.overwrite)
    elif config.offload.node_local and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from engine.runtime.comm import Comm

        group = Comm.join()  # the hosts agree whether to resume before the engine joins it
    _set_threads()
    try:
        result = train(config, checkpoint=args.from_checkpoint, overwrite=args.overwrite)
    finally:
        if group is not None:  # the engine joined this group without owning it
            group.close()
    if result.losses:
        logger.info(
            "done: %d steps, loss %.4f -> %.4f, %.3f s/step",
            result.steps_done,
            result.losses[0],
            result.losses[-1],
            result.seconds_per_step,
        )
    return 0


def _estimate(args: argparse.Namespace, extra: list[str]) -> int:
    config = _load_config(args.config, extra)  # first: a bad config is reported before torch loads
    from engine.tools.estimate import (
        Machine,
        estimate_plans,
        format_table,
        gpt_shape,
        measured_baseline_bytes,
        recommend,
        report_json,
        run_shape,
    )

    sized = args.params or args.layers is not None or args.hidden is not None
    if sized and config.model.hf:
        raise ConfigError(
            "--params, --layers and --hidden size a built-in GPT: leave them out to estimate the model.hf model"
        )
    gpt = gpt_shape(config, args.params, args.layers, args.hidden) if sized or not config.model.hf else None
    run = run_shape(config, args.world_size, gpt)
    estimates = estimate_plans(run, baseline_bytes=measured_baseline_bytes(config.model.hf))
    machine = Machine.detect(config)
    choice = recommend(estimates, machine, config)
    print((report_json if args.json else format_table)(run, estimates, machine, choice))
    return 0


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    config = _load_config(args.config, extra)  # first: a bad config is reported before torch loads
    from engine.run.generate import Sampling, generate

    _set_threads()
    sampling = Sampling(tokens=args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    text = generate(config, args.prompt, sampling, checkpoint=args.from_checkpoint)
    if int(os.environ.get("RANK", "0")) == 0:
        print(args.prompt + text)
    return 0


def _inspect(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.tools.inspect import format_report, inspect_store

    report = inspect_store(args.store, verify=args.verify)
    print(format_report(report))
    return 1 if report["verify"] and report["verify"]["failures"] else 0


def _consolidate(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.tools.consolidate import consolidate

    count = consolidate(args.store, args.out, generation=args.generation, checkpoint=args.from_checkpoint)
    logger.info("wrote %d tensors to %s", count, args.out)
    return 0


def _gather(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.tools.gather import gather

    step = gather(args.out, args.stores)
    logger.info(
        "%s holds step %d of the %d hosts' stores; resume from it on any number of hosts",
        args.out,
        step,
        len(args.stores),
    )
    return 0


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.tools.export import export

    files = export(
        args.store,
        args.out_dir,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        generation=args.generation,
        checkpoint=args.from_checkpoint,
        merged=args.merged,
    )
    logger.info("wrote %d weight file(s) to %s", len(files), args.out_dir)
    return 0


def _plot(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.tools.plot import plot

    logger.info("drew %s", plot(args.metrics, args.out))
    return 0


def _parser(prog: str) -> argparse.ArgumentParser:
    """The commands and their arguments (a config key is any other ``--section.key value``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level", type=_log_level, default=os.environ.get("LOG_LEVEL", "INFO"), help=", ".join(LOG_LEVELS)
    )
    parser.add_argument("--debug", action="store_true", help="log the traceback of an error with its message")
    commands = parser.add_subparsers(dest="command", required=True)
    _train_parser(commands)
    estimate = _config_command(
        commands,
        "estimate",
        "memory per tier of every stage and tier plan",
        allow_abbrev=False,  # --param (offload.param) is not --params
    )
    estimate.add_argument("--params", type=_positive(float), default=0, help="a model of about this many parameters")
    estimate.add_argument(
        "--layers", type=_positive(int), help="transformer blocks (with --hidden, or to hold fixed with --params)"
    )
    estimate.add_argument(
        "--hidden", type=_positive(int), help="d_model (with --layers, or to hold fixed with --params)"
    )
    estimate.add_argument("--world-size", type=int, default=1, help="ranks on this node (default 1)")
    estimate.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _generate_parser(commands)
    inspect = commands.add_parser("inspect", help="what a store holds")
    inspect.add_argument("store")
    inspect.add_argument("--verify", action="store_true", help="read every chunk and check its CRC-32C")
    consolidate = commands.add_parser("consolidate", help="full fp32 weights to a .safetensors file")
    consolidate.add_argument("store", nargs="+", help="the store, or every host's store of one run")
    consolidate.add_argument("out")
    _step_arguments(consolidate)
    gather = commands.add_parser("gather", help="the stores of a run's hosts made one store")
    gather.add_argument("out", help="the new store's folder")
    gather.add_argument("stores", nargs="+", help="every host's store (offload.nvme_path with {node})")
    export = commands.add_parser("export", help="a Hugging Face folder that from_pretrained loads (runs of --model.hf)")
    export.add_argument("store", nargs="+", help="the store, or every host's store of one run")
    export.add_argument("out_dir")
    export.add_argument("--max-shard-size", default="5GB", help="largest weights file, e.g. 5GB, 500MB (default 5GB)")
    export.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: the checkpoint's")
    _step_arguments(export)
    export.add_argument("--merged", action="store_true", help="a LoRA run: the base with its adapters merged in")
    plot = commands.add_parser("plot", help="a train.metrics file's loss and speed against the step, as a PNG")
    plot.add_argument("metrics", help="the JSON-lines file train.metrics names")
    plot.add_argument("--out", help="the PNG to write (default: the metrics file's name with .png)")
    return parser


class _KeysHelp(argparse.Action):
    """``-h``/``--help`` of a command that takes a config: its flags, then every config key with
    its default and summary (``engine.config_docs``, read from the source only when asked)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show this help and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from engine.config_docs import help_text, reference

        parser.epilog = help_text(reference())
        parser.print_help()
        parser.exit()


def _config_command(
    commands: argparse._SubParsersAction, name: str, summary: str, allow_abbrev: bool = True
) -> argparse.ArgumentParser:
    """A command that takes a config: ``--config``, ``--print-config`` and any config key."""
    command = commands.add_parser(
        name,
        help=f"{summary} (any config key: --section.key value)",
        description=summary,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the key list is laid out already
        allow_abbrev=allow_abbrev,
    )
    command.add_argument("-h", "--help", action=_KeysHelp)
    command.add_argument("--config", metavar="FILE", help="a config file: .toml, .json, .yaml or .yml")
    command.add_argument(
        "--print-config", action="store_true", help="print the configuration (file and flags) as TOML and exit"
    )
    return command


def _train_parser(commands: argparse._SubParsersAction) -> None:
    train = _config_command(commands, "train", "train the built-in model, or a pretrained one with --model.hf FOLDER")
    train.add_argument(
        "--from-checkpoint", metavar="TAG", help="resume from this checkpoint of the store (e.g. step-100)"
    )
    train.add_argument(
        "--plan", choices=["auto"], help="auto: set the stage and tiers to the least offload that fits this machine"
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh, replacing whatever the store at offload.nvme_path holds (its steps and checkpoints)",
    )


def _step_arguments(command: argparse.ArgumentParser) -> None:
    """Which step of the store a reader reads."""
    command.add_argument("--generation", type=int, help="default: the committed one, else the last checkpoint")
    command.add_argument("--from-checkpoint", metavar="TAG", help="a kept checkpoint (e.g. step-100), not a generation")


def _generate_parser(commands: argparse._SubParsersAction) -> None:
    generate = _config_command(commands, "generate", "sample text from a run's store, set up by the run's config")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--tokens", type=_positive(int), default=100, help="new tokens (default 100)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    generate.add_argument("--top-k", type=int, default=50, help="draw among the K most likely; 0: all (default 50)")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling: the same seed, the same text")
    generate.add_argument("--from-checkpoint", metavar="TAG", help="this checkpoint of the store, not its last step")


def _handler(command: str) -> Callable[[argparse.Namespace, list[str]], int]:
    """The function that runs ``command``, looked up when it runs (so that tests can stand in for one)."""
    handlers = {
        "train": _train,
        "estimate": _estimate,
        "generate": _generate,
        "inspect": _inspect,
        "consolidate": _consolidate,
        "gather": _gather,
        "export": _export,
        "plot": _plot,
    }
    return handlers[command]


def main(argv: list[str] | None = None, prog: str = "offload-engine") -> int:
    """Run one command; ``prog`` is how the user called it (``python -m engine`` passes its own)."""
    parser = _parser(prog)
    respelled, notices = _respell(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(respelled)
    if any(arg == "--debug" or arg.startswith("--log-level") for arg in extra):
        parser.error(f"--debug and --log-level go before the command: {prog} --debug {args.command} ...")
    if extra and args.command not in ("train", "estimate", "generate"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=args.log_level if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for notice in dict.fromkeys(notices) if rank == 0 else ():
        logger.warning("%s", notice)
    try:
        if getattr(args, "print_config", False):
            print(to_toml(_load_config(args.config, extra).to_dict()), end="")
            return 0
        return _handler(args.command)(args, extra)
    except KeyboardInterrupt:
        logger.error("interrupted", exc_info=args.debug)
        return 130
    except Exception as err:
        line, code = _failure(err, args.debug)
        logger.error("%s", line, exc_info=args.debug)
        return code


if __name__ == "__main__":
    sys.exit(main(prog="python -m engine.run.cli"))
