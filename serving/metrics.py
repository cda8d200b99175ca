"""Prometheus metrics of one serving replica, in their own registry (``GET /metrics`` on its port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ServeMetrics"]

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Buckets (seconds) of a request's time in the replica."""
FRESHNESS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 30)
"""Buckets (seconds) of an apply's time from Redis to the served state."""


class ServeMetrics:
    """The replica's metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("streamtrain_serve_requests", "prediction requests answered, by route and status",
                                ["route", "code"], registry=r)
        self.records = Counter("streamtrain_serve_records", "records scored", registry=r)
        self.latency = Histogram("streamtrain_serve_request_seconds", "time of a prediction request in the replica",
                                 ["route"], registry=r, buckets=LATENCY_BUCKETS)
        self.version = Gauge("streamtrain_serve_version", "the served version of each shard group", ["group"],
                             registry=r)
        self.staleness = Gauge("streamtrain_serve_staleness_seconds",
                               "seconds since the replica last read the feed up to its head", registry=r)
        self.freshness = Histogram("streamtrain_serve_freshness_seconds",
                                   "from an entry's apply in Redis to the served state that holds it", registry=r,
                                   buckets=FRESHNESS_BUCKETS)
        self.rows = Gauge("streamtrain_serve_rows", "rows held, by table", ["table"], registry=r)
        self.row_bytes = Gauge("streamtrain_serve_row_bytes", "bytes the row stores hold allocated", registry=r)
        self.misses = Counter("streamtrain_serve_misses", "rows read from the parameter plane on a request "
                                                          "(--max-rows)", registry=r)
        self.reloads = Counter("streamtrain_serve_reloads", "states loaded anew, by reason (start, feed_gone)",
                               ["reason"], registry=r)
        self.feed_errors = Counter("streamtrain_serve_feed_errors", "reads of the feed that failed, by kind",
                                   ["kind"], registry=r)
        self.ready = Gauge("streamtrain_serve_ready", "1 while GET /v2/health/ready answers ready", registry=r)
