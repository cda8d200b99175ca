"""``streamtrain export``: write a job's model (a consistent version) to a safetensors file, and with
``--tables-dir`` its embedding tables in pieces (``services.snapshot.table_export``)."""

from __future__ import annotations

import argparse
import sys

import redis

from common.outage import REDIS_DOWN, redis_name
from common.settings import add_arguments as add_settings
from common.settings import from_args

from ..errors import ParameterPlaneError
from ..settings import ExportSettings
from ..slot_types import VersionVector
from ..store import connect
from .export import export_model
from .table_export import export_tables


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
    tables = None
    target = settings.out
    try:
        version = export_model(client, settings.job, settings.out, settings.version)
        if settings.tables_dir is not None:
            target = settings.tables_dir
            tables = export_tables(client, settings.job, settings.tables_dir, rows_per_piece=settings.rows_per_piece)
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
        print(f"streamtrain export: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"exported version {VersionVector(version).name()} of job {settings.job} to {settings.out}")
    if tables is not None:
        print(f"exported {tables.rows} row(s) of {tables.tables} embedding table(s) of job {settings.job} to "
              f"{settings.tables_dir} in {tables.pieces} piece(s)")
    return 0
