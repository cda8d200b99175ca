"""``streamtrain serve``: run a serving replica until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

from aiohttp import web

from common.settings import SettingsError, from_args
from common.settings import add_arguments as add_settings
from common.urls import redact_url

from .app import REPLICA, create_app
from .settings import ServeSettings

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of :class:`ServeSettings`."""
    add_settings(parser, ServeSettings)


async def _serve(app: web.Application, settings: ServeSettings) -> int:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else settings.port
        logger.info("serving job %s (model %s) on http://%s:%d (coordinator %s, redis %s)", settings.job,
                    settings.model, settings.host, port, settings.coordinator_url, redact_url(settings.redis_url))
        replica = app[REPLICA]
        # a wildcard address names no host: the machine's name does (two scaled replicas differ by it)
        host = socket.gethostname() if settings.host in ("0.0.0.0", "::", "") else settings.host
        replica.address = f"{host}:{port}"
        while not stop.is_set() and replica.failure is None:
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
        return 1 if replica.failure is not None else 0
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    """Serve the replica on ``--host``/``--port``.

    Raises:
        SettingsError: a setting is invalid (a token missing, a model spec that cannot be built).
    """
    settings = from_args(ServeSettings, args)
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    return asyncio.run(_serve(app, settings))
