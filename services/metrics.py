"""Prometheus metrics of one parameter server, in its own registry, and the HTTP endpoint that
serves a registry (``--metrics-port``), shared with the trainers.

A server exports what only it sees: its group's versions, the updates it applied or refused, the time
of a write batch, freshness at the commit, and its embedding tables. See docs/metrics.md,
*Parameter server* and *Who exports what, and why*.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.keys import JobKeys
from common.metrics_server import MetricsServer
from common.redis_client import connect

from .push.updates import unapplied_updates
from .slots import GroupSlot

if TYPE_CHECKING:
    from .server.apply import Outcome
    from .tables.apply import TableWrites

logger = logging.getLogger(__name__)

__all__ = ["APPLY_BUCKETS", "FRESHNESS_BUCKETS", "MeteredServer", "MeteredSettings", "MetricsServer", "ServerMetrics"]

FRESHNESS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
"""Buckets (seconds) of produce-to-model freshness (the coordinator's histogram uses the same)."""
APPLY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
"""Buckets (seconds) of one write batch."""


class MeteredSettings(Protocol):
    """The settings :class:`ServerMetrics` reads (``services.settings.ServerSettings`` has them)."""

    @property
    def redis_url(self) -> str:
        """Redis of the job (the backlog gauge reads it)."""

    @property
    def job(self) -> str:
        """The job."""

    @property
    def group(self) -> int:
        """The server's shard group (the ``group`` label)."""


class MeteredServer(Protocol):
    """What :class:`ServerMetrics` reads of a parameter server, so this module needs no import
    of ``services.server.service`` (whose ``ParameterServer`` is one)."""

    @property
    def settings(self) -> MeteredSettings:
        """Its settings."""

    @property
    def version(self) -> int:
        """Newest version of its shard group it loaded or published (read at scrape time)."""

    @property
    def table_names(self) -> Sequence[str]:
        """The model's embedding tables (empty before the model is loaded, or for a dense model)."""


class _Backlog(Collector):
    """``streamtrain_unapplied_updates``, read from Redis at scrape time (no sample while Redis is
    not answering: a scrape never waits out an outage)."""

    def __init__(self, server: MeteredServer) -> None:
        self._server = server
        self._client: redis.Redis | None = None

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("streamtrain_unapplied_updates",
                                   "pushed updates not yet applied by every shard group (job-wide)")
        try:
            if self._client is None:  # its own client, with timeouts shorter than a scrape's
                self._client = connect(self._server.settings.redis_url, socket_timeout=1.0,
                                       socket_connect_timeout=1.0)
            count = unapplied_updates(self._client, self._server.settings.job)
        except Exception as exc:  # noqa: BLE001 - a scrape reports what it can
            logger.debug("unapplied count unavailable: %s", exc)
        else:
            family.add_metric([], count)
        yield family

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _Tables(Collector):
    """``streamtrain_table_rows`` and ``streamtrain_table_bytes`` of the group's part of each embedding
    table, read from Redis at scrape time (HLEN, and Redis's own MEMORY USAGE estimate of the rows
    hash from a sample of its fields); no sample while Redis is not answering."""

    def __init__(self, server: MeteredServer) -> None:
        self._server = server
        self._client: redis.Redis | None = None

    def collect(self) -> Iterable[GaugeMetricFamily]:
        rows = GaugeMetricFamily("streamtrain_table_rows", "rows of an embedding table this shard group holds",
                                 labels=["group", "table"])
        size = GaugeMetricFamily("streamtrain_table_bytes", "Redis memory of the rows of an embedding table this "
                                 "shard group holds (Redis's MEMORY USAGE estimate)", labels=["group", "table"])
        names = list(self._server.table_names)
        if names:
            settings = self._server.settings
            try:
                if self._client is None:
                    self._client = connect(settings.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
                gk = JobKeys(settings.job).group(settings.group)
                sizes = GroupSlot(self._client, gk, (), 0, names).table_sizes(samples=64)
            except Exception as exc:  # noqa: BLE001 - a scrape reports what it can
                logger.debug("table sizes unavailable: %s", exc)
            else:
                for name, (n, nbytes) in sizes.items():
                    labels = [str(settings.group), name]
                    rows.add_metric(labels, n)
                    size.add_metric(labels, nbytes)
        yield rows
        yield size

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class ServerMetrics:
    """The metrics of one parameter server (:class:`MeteredServer`); the server calls
    :meth:`observe_write` after each committed write."""

    def __init__(self, server: MeteredServer) -> None:
        self.registry = CollectorRegistry()
        r, group = self.registry, str(server.settings.group)
        self.group_version = Gauge("streamtrain_group_version",
                                   "newest version of its shard group this server loaded or published (the "
                                   "model version is the sum over groups), by shard group", ["group"],
                                   registry=r).labels(group)
        self.group_version.set_function(lambda: server.version)
        self._applied = Counter("streamtrain_updates_applied", "updates applied to the model, by shard group",
                                ["group"], registry=r).labels(group)
        self._rejected = Counter("streamtrain_updates_rejected",
                                 "updates refused at apply time (recorded as rejected), by shard group",
                                 ["group"], registry=r).labels(group)
        self._versions = Counter("streamtrain_versions_published",
                                 "group versions this server published (writes that changed a shard, each "
                                 "bumping the group's version and so the model version once), by shard group",
                                 ["group"],
                                 registry=r).labels(group)
        self._apply_seconds = Histogram(
            "streamtrain_apply_seconds",
            "one write batch: from its updates read to its atomic write committed (decode, optimizer "
            "steps, write), by shard group", ["group"], registry=r, buckets=APPLY_BUCKETS).labels(group)
        self._freshness = Histogram(
            "streamtrain_freshness_seconds",
            "from the oldest produce time of an update's records to the group version holding its "
            "gradient (this group's part) being visible", ["group"], registry=r,
            buckets=FRESHNESS_BUCKETS).labels(group)
        self._backlog = _Backlog(server)
        r.register(self._backlog)
        self._tables = _Tables(server)
        r.register(self._tables)
        rows = {kind: Counter(f"streamtrain_table_rows_{kind}", f"rows of an embedding table {what}, by shard group",
                              ["group", "table"], registry=r)
                for kind, what in (("admitted", "born (their ID admitted)"),
                                   ("dropped", "whose gradient was dropped because their ID was not admitted yet"),
                                   ("expired", "removed after going unwritten for the table's expiry time"),
                                   ("evicted", "evicted, least recently written first, beyond the table's row cap"))}
        self._table_rows = rows
        self._group = group

    def observe_write(self, outcomes: Sequence[Outcome], seconds: float, published: bool,
                      tables: Sequence[TableWrites] = ()) -> None:
        """Count one committed write of ``outcomes`` that took ``seconds`` (``published``: it
        changed a shard or a row, so it bumped the group's version; ``tables``: what it wrote to
        the embedding tables)."""
        for t in tables:
            self.table_rows("admitted", t.table, t.admitted)
            self.table_rows("dropped", t.table, t.dropped)
        published = published or any(t.row_ids.size for t in tables)
        now_ms = time.time() * 1000
        applied = [o for o in outcomes if o.status == "applied"]
        self._applied.inc(len(applied))
        self._rejected.inc(len(outcomes) - len(applied))
        if published:
            self._versions.inc()
        self._apply_seconds.observe(seconds)
        for o in applied:
            if o.update.produced_ts_ms:
                self._freshness.observe(max(0.0, now_ms - o.update.produced_ts_ms) / 1000)

    def table_rows(self, kind: str, table: str, count: int) -> None:
        """Count ``count`` rows of ``table`` ``admitted``, ``dropped``, ``expired`` or ``evicted``."""
        if count:
            self._table_rows[kind].labels(self._group, table).inc(count)

    def close(self) -> None:
        """Release the Redis clients of the gauges read at scrape time (a later scrape opens them again)."""
        self._backlog.close()
        self._tables.close()
