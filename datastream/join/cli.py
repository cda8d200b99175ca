"""``streamtrain join``: label impressions with their delayed feedback and write them to the training topic,
exactly once. Runs until SIGTERM or Ctrl-C, then commits what it joined and prints its counts::

    joined 10000 impressions (3801 positive, 6199 negative, 0 dropped); late: outside_window 12; ...
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import threading
from typing import Any

from common import settings as cfg
from common.metrics_server import MetricsServer

from ..settings import JoinSettings
from .metrics import Reporter, join_registry
from .service import Joiner, JoinError

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``streamtrain join``."""
    cfg.add_arguments(parser, JoinSettings)


def run(args: argparse.Namespace) -> int:
    """Join until stopped; exit 0, or 1 when the join cannot go on (the error says why)."""
    s = cfg.from_args(JoinSettings, args)
    # kafka-python warns whenever a rebalance callback (a restore) or a transaction's commit holds its
    # event loop over 100 ms, which the join does by design
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack on stderr
    try:
        joiner = Joiner(s, stop=stop)
    except JoinError as exc:
        logger.error("%s", exc)
        return 1
    metrics = MetricsServer(join_registry(joiner.stats), s.metrics_port) if s.metrics_port else None
    reporter = None
    if s.coordinator_url:
        url = f"http://{s.instance_id}:{metrics.port}/metrics" if metrics else ""
        reporter = Reporter(s.coordinator_url, s.job_token, s.instance_id, joiner.stats, url=url)
    try:
        joiner.run()
    except JoinError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        if reporter is not None:
            reporter.close()
        if metrics is not None:
            metrics.close()
    report = joiner.stats().report()
    late = ", ".join(f"{k} {v}" for k, v in sorted(report["late"].items())) or "none"
    dead = ", ".join(f"{k} {v}" for k, v in sorted(report["dead_letters"].items())) or "none"
    print(f"joined {report['joined']} impressions ({report['positives']} positive, {report['negatives']} negative, "
          f"{report['negatives_dropped']} dropped) on partitions {report['partitions']}; late: {late}; "
          f"dead letters: {dead}; {report['pending']} pending", flush=True)
    return 0
