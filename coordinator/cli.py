"""``streamtrain coordinator``: run the coordinator service until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from common.settings import SettingsError, from_args
from common.settings import add_arguments as add_settings
from common.urls import redact_url

from .app import create_app
from .runtime import RUNTIME
from .settings import CoordinatorSettings

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of :class:`CoordinatorSettings`."""
    add_settings(parser, CoordinatorSettings)


def run(args: argparse.Namespace) -> int:
    """Serve the coordinator API on ``--host``/``--port``.

    Raises:
        SettingsError: a setting is invalid or a token is missing.
    """
    try:
        settings = from_args(CoordinatorSettings, args)
        app = create_app(settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    logger.info("coordinator of job %s on http://%s:%d (redis %s, kafka %s, lease %d ms)",
                settings.job, settings.host, settings.port, redact_url(settings.redis_url),
                settings.kafka_bootstrap, settings.lease_ms)
    web.run_app(app, host=settings.host, port=settings.port, print=None,
                access_log=logging.getLogger("coordinator.access"),
                access_log_format='%a "%r" %s %b %Tfs')
    runtime = app.get(RUNTIME)
    return 1 if runtime is not None and runtime.failure is not None else 0
