"""The coordinator's runtime: what its handlers share, the membership write path and the lease checker.

:class:`Runtime` holds a running coordinator's settings, Redis store, Kafka probe and metrics, found on
the aiohttp application by its typed keys; :func:`apply_event` is the one way a membership event is
written (logged, counted, announced on the presence channels) and :func:`lease_checker` expires leases.
The handlers import this module and nothing here imports a handler (:mod:`coordinator.app` joins them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from aiohttp import web

from common.outage import REDIS_DOWN, DependencyUnavailable, Outage

from .kafka_probe import KafkaProbe
from .membership import (
    Action,
    CheckLeases,
    Event,
    MemberDrained,
    MemberExpired,
    MemberJoined,
    MemberLeft,
    Membership,
    Rebalanced,
    RenewLeases,
)
from .metrics import Metrics
from .sampler import Sampler
from .settings import CoordinatorSettings
from .state import Store

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["Runtime", "SETTINGS", "RUNTIME", "SAMPLER", "LEASE_CHECKER", "now_ms", "apply_event",
           "notify_generation", "log_actions", "check_leases_once", "next_check_s", "lease_checker"]


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch (leases survive a coordinator restart)."""
    return time.time_ns() // 1_000_000


@dataclass
class Runtime:
    """What the handlers share: settings, store, probe, metrics."""

    settings: CoordinatorSettings
    redis: aioredis.Redis
    store: Store
    metrics: Metrics
    probe: KafkaProbe
    executor: ThreadPoolExecutor
    failure: BaseException | None = None
    """Why the coordinator gave up (an outage longer than its limit), when it did."""
    channels: dict[str, web.WebSocketResponse] = field(default_factory=dict)
    """Open presence channels by member id (``coordinator.channel``)."""
    closing: bool = False
    """Set when the coordinator shuts down: a channel closing then is no member's death."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises this process's membership writes (the CAS still guards against other
    coordinators); without it concurrent heartbeats would mostly retry each other."""

    async def kafka(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking probe call in the Kafka thread, bounded by the Kafka timeout."""
        loop = asyncio.get_running_loop()
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that arrives as
        # the call completes, and a shutdown then waits for a task that never ends
        async with asyncio.timeout(self.settings.kafka_timeout_ms / 1000 * 3):
            return await loop.run_in_executor(self.executor, fn, *args)


SETTINGS = web.AppKey("settings", CoordinatorSettings)
"""The app's :class:`CoordinatorSettings`."""
RUNTIME = web.AppKey("runtime", Runtime)
"""The app's :class:`Runtime` (set while the app runs)."""
LEASE_CHECKER = web.AppKey("lease_checker", asyncio.Task)
"""The lease checker task."""
SAMPLER = web.AppKey("sampler", Sampler)
"""The app's :class:`~coordinator.sampler.Sampler` (its task samples the job every second; its
history feeds ``/v1/history``)."""


def log_actions(actions: list[Action]) -> None:
    """Log each membership action as one structured line (member id and generation first)."""
    for a in actions:
        if isinstance(a, MemberExpired):
            logger.warning("member_expired member_id=%s generation=%d lease_expires_ms=%d "
                           "detected_ms=%d", a.member_id, a.generation, a.lease_expires_ms,
                           a.detected_ms)
        elif isinstance(a, MemberJoined):
            logger.info("member_joined member_id=%s generation=%d", a.member_id, a.generation)
        elif isinstance(a, MemberLeft):
            logger.info("member_left member_id=%s generation=%d", a.member_id, a.generation)
        elif isinstance(a, MemberDrained):
            logger.info("member_drained member_id=%s generation=%d", a.member_id, a.generation)
        elif isinstance(a, Rebalanced):
            logger.info("rebalanced generation=%d moved=%s", a.generation,
                        ",".join(f"{p}:{src}->{dst}" for p, src, dst in a.moved) or "-")


async def apply_event(rt: Runtime, event: Event) -> tuple[Membership, list[Action]]:
    """Apply a membership event in Redis, logging its actions first, then count them."""
    async with rt.lock:
        state, actions = await rt.store.apply(event, before_commit=log_actions)
    if actions:
        rt.metrics.observe_actions(actions, now_ms())
    rt.metrics.observe_state(state)
    if any(isinstance(a, Rebalanced) for a in actions):
        await notify_generation(rt, state.generation)
    return state, actions


async def notify_generation(rt: Runtime, generation: int) -> None:
    """Tell every trainer with an open presence channel that the membership moved to
    ``generation``, so it fetches its new assignment now rather than at its next heartbeat."""
    for ws in list(rt.channels.values()):
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_json({"generation": generation})


# -- the lease checker ----------------------------------------------------------

async def check_leases_once(rt: Runtime) -> tuple[Membership, list[Action]]:
    """Remove every member whose lease has expired, reassigning its partitions (one CAS)."""
    return await apply_event(rt, CheckLeases(now_ms=now_ms()))


def next_check_s(state: Membership, interval_s: float, now: int) -> float:
    """Seconds until the next lease check: the checker period, or sooner when a lease
    runs out before that (so expiry is detected within milliseconds, not a period)."""
    soonest = min((m.lease_expires_ms for m in state.members.values()), default=None)
    if soonest is None:
        return interval_s
    return min(interval_s, max(0.001, (soonest - now + 1) / 1000))


async def lease_checker(rt: Runtime) -> None:
    """Check leases every quarter lease (or at the soonest expiry) until cancelled.

    A Redis outage is ridden out: when Redis answers again every lease starts afresh
    (no trainer could heartbeat meanwhile); one longer than ``outage_limit_s`` ends
    the coordinator with an error naming Redis. Other errors are logged and retried.
    """
    interval = rt.settings.check_interval_s
    outage = Outage(f"Redis of job {rt.settings.job}", rt.settings.outage_limit_s, logger)
    while True:
        delay = interval
        try:
            if outage.ongoing:
                await apply_event(rt, RenewLeases(now_ms=now_ms(), lease_ms=rt.settings.lease_ms))
            state, _ = await check_leases_once(rt)
            outage.recovered()
            delay = next_check_s(state, interval, now_ms())
        except asyncio.CancelledError:
            raise
        except REDIS_DOWN as exc:
            try:
                delay = outage.failed(exc)
            except DependencyUnavailable as gone:
                rt.failure = gone
                logger.error("giving up: %s", gone)
                signal.raise_signal(signal.SIGTERM)  # web.run_app stops; the CLI then exits with 1
                return
        except Exception:
            logger.exception("lease check of job %s failed; retrying in %.2fs",
                             rt.settings.job, interval)
        await asyncio.sleep(delay)
