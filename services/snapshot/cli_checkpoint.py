"""``streamtrain checkpoint save|restore``: a consistent snapshot of a job to a file (and its embedding
tables to the folder ``PATH.tables``), and back."""

from __future__ import annotations

import argparse
import sys

from ..errors import ParameterPlaneError
from ..slot_types import VersionVector
from ..store import connect
from .checkpoint import ROWS_PER_PIECE, restore_checkpoint, save_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``action``, ``path`` and where."""
    parser.add_argument("action", choices=["save", "restore"], help="save a checkpoint, or restore one")
    parser.add_argument("path", help="checkpoint file")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis of the job")
    parser.add_argument("--job", default=None, help="job name (restore: default the checkpoint's)")
    parser.add_argument("--rows-per-piece", type=_positive, default=ROWS_PER_PIECE,
                        help="save: entries of an embedding table per piece file (in PATH.tables/)")
    parser.add_argument("--wait-s", type=float, default=300.0,
                        help="save: how long to wait for another save of the job's tables to end")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Do it and print the version; a refusal (no model, a bad file, a job already there) is one line
    on stderr and exit 1."""
    if args.action == "save" and not args.job:
        raise SystemExit("streamtrain checkpoint save: --job is required")
    client = connect(args.redis_url)
    try:
        if args.action == "save":
            version = save_checkpoint(client, args.job, args.path, rows_per_piece=args.rows_per_piece,
                                      wait_s=args.wait_s)
            print(f"saved version {VersionVector(version).name()} of job {args.job} to {args.path}")
        else:
            version = restore_checkpoint(client, args.path, job=args.job)
            print(f"restored version {VersionVector(version).name()} from {args.path}")
    except ParameterPlaneError as exc:
        print(f"streamtrain checkpoint {args.action}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0
