"""``streamtrain ps``: run one parameter server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

import torch

from common.settings import add_arguments as add_settings
from common.settings import from_args

from ..metrics import MetricsServer
from ..settings import ServerSettings
from .service import ParameterServer, ServerStatus

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of :class:`ServerSettings`."""
    add_settings(parser, ServerSettings)


def run(args: argparse.Namespace) -> int:
    """Start the server, apply updates until a signal, stop cleanly."""
    settings = from_args(ServerSettings, args)
    torch.set_num_threads(settings.torch_threads)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = ParameterServer(settings)
    http = MetricsServer(server.metrics.registry, settings.metrics_port) if settings.metrics_port else None
    try:
        server.start(timeout_s=settings.start_timeout_s)
        while not stop.wait(0.2):
            if server.status is ServerStatus.FAILED:
                return 1
    finally:
        server.close()
        if http is not None:
            http.close()
    logger.info("ps job=%s group=%d stopped after %d updates", settings.job, settings.group, server.applied)
    return 1 if server.status is ServerStatus.FAILED else 0
