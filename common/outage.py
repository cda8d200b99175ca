"""Riding out an outage of a dependency (Redis, Kafka) instead of dying of it.

A service wraps its calls to a dependency in an :class:`Outage`: the first
failure logs one line naming what is unreachable, each later one returns how
long to back off, the first success after it logs one line saying how long it
lasted, and an outage longer than the limit raises :class:`DependencyUnavailable`
naming the dependency, so the service exits with an error that says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import redis

from .redis_client import is_cluster_url, parse_cluster_url, redis_where

T = TypeVar("T")

__all__ = ["Outage", "DependencyUnavailable", "REDIS_DOWN", "DEFAULT_LIMIT_S", "redis_name", "url_name",
           "wait_connected"]

DEFAULT_LIMIT_S = 60.0
"""How long a service waits for a dependency by default before giving up."""

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
              redis.exceptions.SlotNotCoveredError)
"""What redis-py raises when Redis cannot be reached or is still loading its data
(``BusyLoadingError`` is a ``ConnectionError``; so is ``common.redis_client.ClusterUnreachable``,
no node of a Redis Cluster answering), or a Redis Cluster does not serve a slot
(``CLUSTERDOWN``: a master is failing over; a slot no node serves in the client's map yet: a
cluster forming or failing over)."""


class DependencyUnavailable(RuntimeError):
    """A dependency stayed unreachable for longer than the service's limit."""


class Outage:
    """The state of one dependency's outage, as one service sees it.

    Args:
        what: the dependency, as the log and the error name it (``"Redis at 127.0.0.1:6379"``).
        limit_s: the longest outage ridden out.
        logger: where the start and the end of an outage are logged.
    """

    def __init__(self, what: str, limit_s: float = DEFAULT_LIMIT_S, logger: logging.Logger | None = None) -> None:
        if limit_s <= 0:
            raise ValueError(f"outage limit must be > 0 s, got {limit_s!r}")
        self.what = what
        self.limit_s = limit_s
        self.logger = logger or logging.getLogger(__name__)
        self.started: float | None = None
        """When the outage in progress began (monotonic), None when there is none."""
        self._attempts = 0

    @property
    def ongoing(self) -> bool:
        """True between the first failure and the next success."""
        return self.started is not None

    def failed(self, exc: BaseException) -> float:
        """Record a failed attempt: the seconds to wait before the next one (50 ms doubling to 1 s).

        Raises:
            DependencyUnavailable: the outage has lasted ``limit_s``, or the dependency refused the
                credentials (chained to ``exc``).
        """
        if isinstance(exc, redis.AuthenticationError):  # wrong credentials: waiting will not help
            raise DependencyUnavailable(f"{self.what} refused the credentials: {exc}") from exc
        now = time.monotonic()
        if self.started is None:
            self.started, self._attempts = now, 0
            self.logger.warning("%s unreachable (%s); waiting up to %.0f s for it", self.what, exc, self.limit_s)
        self._attempts += 1
        lasted = now - self.started
        if lasted >= self.limit_s:
            raise DependencyUnavailable(f"{self.what} unreachable for {lasted:.1f} s (limit {self.limit_s:.0f} s): "
                                        f"{exc}") from exc
        return min(0.05 * 2 ** min(self._attempts - 1, 5), 1.0)

    def recovered(self) -> None:
        """Record a success: logs the end of the outage in progress, if any."""
        if self.started is not None:
            self.logger.warning("%s reachable again after %.1f s", self.what, time.monotonic() - self.started)
            self.started = None


def redis_name(client: redis.Redis | redis.RedisCluster) -> str:
    """``Redis at host:port`` for a client, ``Redis Cluster at host:port,...`` for a cluster
    client (never its password)."""
    kind = "Redis Cluster" if hasattr(client, "nodes_manager") else "Redis"
    return f"{kind} at {redis_where(client)}"


def url_name(url: str) -> str:
    """:func:`redis_name` of the client ``url`` would make (never its password)."""
    if is_cluster_url(url):
        nodes = ",".join(f"{h}:{p}" for h, p in parse_cluster_url(url).nodes)
        return f"Redis Cluster at {nodes}"
    parts = urlsplit(url)
    return f"Redis at {parts.netloc.rpartition('@')[2] or parts.path}"


def wait_connected(connect: Callable[[], T], outage: Outage) -> T:
    """``connect()``, waiting out :data:`REDIS_DOWN` as ``outage`` (its log lines and limit).

    A single server's client connects at its first command, but a Redis Cluster's asks a node for
    the slot map when it is made: a service started while the whole cluster is down waits here, as
    it waits at its first command for a server that does not answer.

    Raises:
        DependencyUnavailable: Redis stayed unreachable for ``outage.limit_s``.
    """
    while True:
        try:
            client = connect()
        except REDIS_DOWN as exc:
            time.sleep(outage.failed(exc))
            continue
        outage.recovered()
        return client
