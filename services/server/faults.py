"""TESTING ONLY: the fault injection of ``streamtrain ps --fault`` (SIGKILL around a write), with
which ``tests/test_services_server.py`` kills a real server where exactly-once must hold."""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["kill_if_due"]

logger = logging.getLogger(__name__)


def kill_if_due(fault: str, fault_at: int, where: str, applied: int, n: int) -> None:
    """SIGKILL this process when the injected ``fault`` is ``where`` and the write of the next ``n``
    updates, after ``applied`` before them, includes update number ``fault_at`` (1-based)."""
    if fault == where and applied < fault_at <= applied + n:
        logger.warning("ps: injected fault %s at update %d: SIGKILL", where, fault_at)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
