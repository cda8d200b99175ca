"""``streamtrain trainer``: run one trainer service until SIGTERM (then drain and leave)."""

from __future__ import annotations

import argparse
import asyncio

from common import settings as cfg

from .settings import TrainerSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of :class:`TrainerSettings`."""
    cfg.add_arguments(parser, TrainerSettings)


def run(args: argparse.Namespace) -> int:
    """Build the trainer from flags and environment and run it."""
    from services.metrics import MetricsServer  # torch is imported only when a trainer really starts

    from .service import Trainer

    settings = cfg.from_args(TrainerSettings, args)
    trainer = Trainer(settings)
    http = MetricsServer(trainer.metrics.registry, settings.metrics_port) if settings.metrics_port else None
    try:
        return asyncio.run(trainer.run())
    finally:
        if http is not None:
            http.close()
