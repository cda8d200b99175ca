"""``streamtrain export``: write a job's model (a consistent version) to a safetensors file."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

import redis

from common.keys import validate_job
from common.outage import REDIS_DOWN, redis_name
from common.settings import add_arguments as add_settings
from common.settings import from_args, setting

from .errors import ParameterPlaneError
from .export import export_model, version_name
from .store import connect

_VERSION_RE = re.compile(r"[0-9]{1,18}(?:\.[0-9]{1,18})*")


@dataclass(frozen=True)
class ExportSettings:
    """Settings of ``streamtrain export``."""

    redis_url: str = setting("redis://127.0.0.1:6379/0", env="STREAMTRAIN_REDIS_URL",
                             help="Redis holding the job's model")
    job: str = setting("default", env="STREAMTRAIN_JOB", help="job whose model to export")
    out: str = setting("", env=None, help="file to write (required; safetensors, replaced atomically)")
    version: str | None = setting(None, env=None,
                                  help="model version to export (default: the current one): an integer, or "
                                       "with several shard groups each group's version joined by '.' "
                                       "(e.g. 12.7); it must still be retained in Redis")

    def __post_init__(self) -> None:
        validate_job(self.job)
        if not self.out:
            raise ValueError("--out FILE is required (where to write the .safetensors file)")
        if self.version is not None and not _VERSION_RE.fullmatch(self.version):
            raise ValueError(f"--version must be a model version: a non-negative integer, or with several "
                             f"shard groups one per group joined by '.' (e.g. 12.7), got {self.version!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of :class:`ExportSettings`."""
    add_settings(parser, ExportSettings)


def run(args: argparse.Namespace) -> int:
    """Export, print the version and the path; a bad input is one line on stderr and exit 1."""
    settings = from_args(ExportSettings, args)
    try:
        client = connect(settings.redis_url)
    except ValueError as exc:
        print(f"streamtrain export: bad --redis-url: {exc}", file=sys.stderr)
        return 1
    where = redis_name(client)
    try:
        version = export_model(client, settings.job, settings.out, settings.version)
    except ParameterPlaneError as exc:  # no model, a version not (or no longer) there, or of another form
        print(f"streamtrain export: {exc}", file=sys.stderr)
        return 1
    except redis.AuthenticationError as exc:  # a ConnectionError: before REDIS_DOWN
        print(f"streamtrain export: {where} refused the credentials: {exc}", file=sys.stderr)
        return 1
    except REDIS_DOWN as exc:
        print(f"streamtrain export: {where} is unreachable: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"streamtrain export: cannot write {settings.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"exported version {version_name(version)} of job {settings.job} to {settings.out}")
    return 0
