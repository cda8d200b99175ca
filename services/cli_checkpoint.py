"""``streamtrain checkpoint save|restore``: a consistent snapshot of a job to a file, and back."""

from __future__ import annotations

import argparse
import sys

from .checkpoint import restore_checkpoint, save_checkpoint
from .errors import ParameterPlaneError
from .export import version_name
from .store import connect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``action``, ``path`` and where."""
    parser.add_argument("action", choices=["save", "restore"], help="save a checkpoint, or restore one")
    parser.add_argument("path", help="checkpoint file")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis of the job")
    parser.add_argument("--job", default=None, help="job name (restore: default the checkpoint's)")


def run(args: argparse.Namespace) -> int:
    """Do it and print the version; a refusal (no model, a bad file, a job already there) is one line
    on stderr and exit 1."""
    if args.action == "save" and not args.job:
        raise SystemExit("streamtrain checkpoint save: --job is required")
    client = connect(args.redis_url)
    try:
        if args.action == "save":
            version = save_checkpoint(client, args.job, args.path)
            print(f"saved version {version_name(version)} of job {args.job} to {args.path}")
        else:
            version = restore_checkpoint(client, args.path, job=args.job)
            print(f"restored version {version_name(version)} from {args.path}")
    except ParameterPlaneError as exc:
        print(f"streamtrain checkpoint {args.action}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0
