"""``python -m engine <command>`` (also installed as ``offload-engine``).

- ``train [--config run.toml] [--key value ...]``: any config key can be overridden as
  ``--section.key value`` or, when the name is unique, ``--key value`` (``--steps 3``);
  continues from the store at ``offload.nvme_path`` when it holds a committed step, or from
  its checkpoint TAG with ``--from-checkpoint TAG``.
- ``inspect STORE [--verify]``: what a store holds; ``--verify`` checks every chunk's CRC-32C.
- ``consolidate STORE OUT.safetensors``: full fp32 weights under the model's parameter names.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.config import Config, ConfigError

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


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from engine.train import train

    config = _load_config(args.config, extra)
    _set_threads()
    result = train(config, checkpoint=args.from_checkpoint)
    if result.losses:
        logger.info(
            "done: %d steps, loss %.4f -> %.4f, %.3f s/step",
            result.steps_done,
            result.losses[0],
            result.losses[-1],
            result.seconds_per_step,
        )
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
    inspect = commands.add_parser("inspect", help="what a store holds")
    inspect.add_argument("store")
    inspect.add_argument("--verify", action="store_true", help="read every chunk and check its CRC-32C")
    consolidate = commands.add_parser("consolidate", help="full fp32 weights to a .safetensors file")
    consolidate.add_argument("store")
    consolidate.add_argument("out")
    consolidate.add_argument("--generation", type=int, help="default: the committed one")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=args.log_level.upper() if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return {"train": _train, "inspect": _inspect, "consolidate": _consolidate}[args.command](args, extra)
    except ConfigError as err:
        logger.error("config error: %s", err)
        return 2
    except (OSError, ValueError) as err:  # missing or damaged stores: the message names the fix
        logger.error("%s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
