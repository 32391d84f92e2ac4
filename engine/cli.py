"""``python -m engine <command>`` (also installed as ``offload-engine``).

- ``train [--config run.toml] [--key value ...]``: any config key can be overridden as
  ``--section.key value`` or, when the name is unique, ``--key value`` (``--steps 3``);
  continues from the store at ``offload.nvme_path`` when it holds a committed step, or from
  its checkpoint TAG with ``--from-checkpoint TAG``; ``--plan auto`` first sets ``zero.stage``,
  ``offload.optimizer`` and ``offload.param`` to the least offload that fits this machine.
- ``estimate [--config run.toml | --params N --layers L --hidden H] [--world-size W] [--json]``:
  predicted memory per tier of every stage and tier plan, and the one ``--plan auto`` would take.
- ``inspect STORE [--verify]``: what a store holds; ``--verify`` checks every chunk's CRC-32C.
- ``consolidate STORE OUT.safetensors``: full fp32 weights under the model's parameter names.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from engine.config import Config, ConfigError
from engine.divergence import DivergedError

if TYPE_CHECKING:  # torch loads only once a command needs it
    from engine.comm import Comm
    from engine.estimate import Plan

logger = logging.getLogger("engine")


def _overrides(extra: list[str]) -> list[str]:
    """``--a.b 1 --c=2`` -> ``["a.b=1", "c=2"]``."""
    out, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --key value")
        if "=" in arg:
            out.append(arg[2:])
            i += 1
        elif i + 1 < len(extra):
            out.append(f"{arg[2:]}={extra[i + 1]}")
            i += 2
        else:
            raise ConfigError(f"override {arg} has no value")
    return out


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
    from engine.estimate import (
        Machine,
        estimate_plans,
        measured_baseline_bytes,
        recommend,
        run_shape,
        why_none_fits,
    )

    estimates = estimate_plans(run_shape(config, world_size), baseline_bytes=measured_baseline_bytes())
    machine = Machine.detect(config)
    best = recommend(estimates, machine, config)
    if best is None:
        raise ConfigError(f"--plan auto: {why_none_fits(estimates, machine, config)} (every plan: python -m engine estimate)")
    logger.info(
        "--plan auto: %s (predicted peak RSS %.2f GiB per rank, store %.2f GiB)",
        best.plan,
        best.peak_rss_bytes / 2**30,
        best.disk_bytes / 2**30,
    )
    return best.plan


def _auto_plan(config: Config) -> tuple[Config, Comm | None]:
    """``--plan auto``: the config with the recommended plan, the same on every rank (rank 0's
    choice: RAM and disk measured a moment apart could tip ranks to different plans), and the
    process group it was agreed in, for the engine to join and the caller to close."""
    from engine.comm import Comm
    from engine.device import Device
    from engine.estimate import plan_of
    from engine.train import resumable

    if resumable(config):  # the store's run continues as it was planned
        logger.info("--plan auto: resuming from %s keeps its plan (%s)", config.offload.nvme_path, plan_of(config))
        return config, None
    device = Device.detect()
    comm = Comm.from_env(device.backend, device.device)
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
    return choice.apply(config), comm


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.heap import return_freed_buffers
    from engine.train import train

    return_freed_buffers()  # before any model memory: host RSS is what is live, not what was
    config = _load_config(args.config, extra)
    group = None
    if args.plan == "auto":
        config, group = _auto_plan(config)
    _set_threads()
    try:
        result = train(config, checkpoint=args.from_checkpoint)
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
    from engine.estimate import (
        Machine,
        estimate_plans,
        format_table,
        gpt_shape,
        measured_baseline_bytes,
        recommend,
        report_json,
        run_shape,
    )

    config = _load_config(args.config, extra)
    run = run_shape(config, args.world_size, gpt_shape(config, args.params, args.layers, args.hidden))
    estimates = estimate_plans(run, baseline_bytes=measured_baseline_bytes())
    machine = Machine.detect(config)
    choice = recommend(estimates, machine, config)
    print((report_json if args.json else format_table)(run, estimates, machine, choice))
    return 0


def _inspect(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.inspect import format_report, inspect_store

    report = inspect_store(args.store, verify=args.verify)
    print(format_report(report))
    return 1 if report["verify"] and report["verify"]["failures"] else 0


def _consolidate(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.consolidate import consolidate

    count = consolidate(args.store, args.out, generation=args.generation)
    logger.info("wrote %d tensors to %s", count, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train the built-in model (any config key: --section.key value)")
    train.add_argument("--config", help="a .toml or .json config file")
    train.add_argument(
        "--from-checkpoint", metavar="TAG", help="resume from this checkpoint of the store (e.g. step-100)"
    )
    train.add_argument(
        "--plan", choices=["auto"], help="auto: set the stage and tiers to the least offload that fits this machine"
    )
    estimate = commands.add_parser(
        "estimate", help="memory per tier of every stage and tier plan (any config key: --section.key value)"
    )
    estimate.add_argument("--config", help="a .toml or .json config file")
    estimate.add_argument("--params", type=float, default=0, help="a model of about this many parameters")
    estimate.add_argument("--layers", type=int, help="transformer blocks (with --hidden, or to hold fixed with --params)")
    estimate.add_argument("--hidden", type=int, help="d_model (with --layers, or to hold fixed with --params)")
    estimate.add_argument("--world-size", type=int, default=1, help="ranks on this node (default 1)")
    estimate.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect = commands.add_parser("inspect", help="what a store holds")
    inspect.add_argument("store")
    inspect.add_argument("--verify", action="store_true", help="read every chunk and check its CRC-32C")
    consolidate = commands.add_parser("consolidate", help="full fp32 weights to a .safetensors file")
    consolidate.add_argument("store")
    consolidate.add_argument("out")
    consolidate.add_argument("--generation", type=int, help="default: the committed one")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("train", "estimate"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=args.log_level.upper() if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        handlers = {"train": _train, "estimate": _estimate, "inspect": _inspect, "consolidate": _consolidate}
        return handlers[args.command](args, extra)
    except ConfigError as err:
        logger.error("config error: %s", err)
        return 2
    except (OSError, ValueError, DivergedError) as err:  # damaged stores, diverged steps: the message names the fix
        logger.error("%s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
