"""The ``streamtrain`` command: one subcommand per service.

Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when
chosen, so ``streamtrain --help`` stays fast and a service pulls in only what it
uses (torch is not imported by the coordinator).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from common.outage import DependencyUnavailable
from common.settings import SettingsError

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("streamtrain.up", "bring everything up locally and train from a stream"),
    "ps": ("services.server.cli", "run a parameter server applying a job's update log"),
    "checkpoint": ("services.snapshot.cli_checkpoint", "save or restore a job's parameter-plane checkpoint"),
    "export": ("services.snapshot.cli_export", "write a job's model (one consistent version) to a safetensors file"),
    "produce": ("datastream.cli", "stream a source into a training topic as shards"),
    "join": ("datastream.join.cli", "label impressions with their delayed feedback for a training topic, exactly once"),
    "produce-events": ("datastream.events_cli",
                       "write impressions and delayed clicks (with their ground truth) for streamtrain join"),
    "trainer": ("trainers.cli", "run a trainer: consume partitions, compute and push gradients"),
    "coordinator": ("coordinator.cli", "run the coordinator: membership, leases, assignment, status"),
    "status": ("coordinator.status_cli", "print the status of a running coordinator"),
    "serve": ("serving.cli", "serve a job's model: follow its feed, answer predictions (Open Inference Protocol)"),
}
"""Subcommand -> (module, one-line description)."""


def load_command(name: str) -> ModuleType:
    """Import the module of subcommand ``name``.

    Raises:
        KeyError: ``name`` is not a streamtrain subcommand.
    """
    module, _ = COMMANDS[name]
    return importlib.import_module(module)


def build_parser(name: str) -> argparse.ArgumentParser:
    """The full argument parser of subcommand ``name``."""
    parser = argparse.ArgumentParser(prog=f"streamtrain {name}", description=COMMANDS[name][1],
                                     allow_abbrev=False)  # a misspelt flag is an error, not a guess
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level")
    load_command(name).add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamtrain`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(
        prog="streamtrain",
        description="Distributed training from Kafka streams with a Redis parameter server.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<12} {v[1]}" for k, v in COMMANDS.items()))
    top.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND",
                     help="one of: " + ", ".join(sorted(COMMANDS)))
    top.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ns = top.parse_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    parser = build_parser(ns.command)
    args = parser.parse_args(argv[1:])
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "DEBUG":
        logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python is chatty at INFO
    try:
        return int(load_command(ns.command).run(args) or 0)
    except SettingsError as exc:
        parser.error(str(exc))
    except DependencyUnavailable as exc:  # an outage longer than the service's limit: say what, not a traceback
        logging.getLogger(f"streamtrain.{ns.command}").error("giving up: %s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
