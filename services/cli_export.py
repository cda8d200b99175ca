"""``streamtrain export``: write a job's model (a consistent version) to a safetensors file."""

from __future__ import annotations

import argparse
import sys

import redis

from common.outage import REDIS_DOWN, redis_name
from common.settings import add_arguments as add_settings
from common.settings import from_args

from .errors import ParameterPlaneError
from .export import export_model, version_name
from .settings import ExportSettings
from .store import connect


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
