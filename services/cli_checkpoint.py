"""``streamtrain checkpoint save|restore``: a consistent snapshot of a job to a file, and back."""

from __future__ import annotations

import argparse

from .checkpoint import restore_checkpoint, save_checkpoint
from .store import connect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``action``, ``path`` and where."""
    parser.add_argument("action", choices=["save", "restore"], help="save a checkpoint, or restore one")
    parser.add_argument("path", help="checkpoint file")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis of the job")
    parser.add_argument("--job", default=None, help="job name (restore: default the checkpoint's)")


def run(args: argparse.Namespace) -> int:
    """Do it and print the version."""
    client = connect(args.redis_url)
    try:
        if args.action == "save":
            if not args.job:
                raise SystemExit("streamtrain checkpoint save: --job is required")
            version = save_checkpoint(client, args.job, args.path)
            print(f"saved version {version} of job {args.job} to {args.path}")
        else:
            version = restore_checkpoint(client, args.path, job=args.job)
            print(f"restored version {version} from {args.path}")
    finally:
        client.close()
    return 0
