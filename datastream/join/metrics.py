"""The joiner's Prometheus metrics (its own registry, read from :meth:`Joiner.stats` at scrape time) and its
report to the coordinator (``POST /v1/join/joiners/<name>``, every second). See docs/metrics.md."""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .service import JoinStats

__all__ = ["JoinCollector", "Reporter", "join_registry"]

logger = logging.getLogger(__name__)

_COUNTERS = {
    "joined": "impressions labelled (positives and negatives, written or dropped by --negative-rate)",
    "positives": "impressions labelled positive (feedback within the window)",
    "negatives": "impressions labelled negative (the watermark passed the window, or decided early)",
    "negatives_dropped": "negatives not written (--negative-rate)",
    "decided_early": "impressions decided negative early because --max-pending was reached",
}


class JoinCollector(Collector):
    """The joiner's series, from its stats as of its last commit."""

    def __init__(self, read: Callable[[], JoinStats]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        s = self._read()
        c = s.counters
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"streamtrain_join_{name}", doc, value=c.get(name, 0))
        late = CounterMetricFamily("streamtrain_join_late", "feedback that arrived too late, by reason",
                                   labels=["reason"])
        dead = CounterMetricFamily("streamtrain_join_dead_letters", "input events dead-lettered, by reason",
                                   labels=["reason"])
        ignored = CounterMetricFamily("streamtrain_join_feedback_ignored",
                                      "feedback not joined: another label, or a repeat for a positive",
                                      labels=["kind"])
        for key, value in sorted(c.items()):
            if key.startswith("late."):
                late.add_metric([key[5:]], value)
            elif key.startswith("dead."):
                dead.add_metric([key[5:]], value)
        ignored.add_metric(["other_label"], c.get("ignored", 0))
        ignored.add_metric(["repeat"], c.get("repeat", 0))
        yield late
        yield dead
        yield ignored
        yield CounterMetricFamily("streamtrain_join_transactions", "transactions committed by this process",
                                  value=s.transactions)
        yield GaugeMetricFamily("streamtrain_join_pending", "impressions waiting for their label", value=s.pending)
        yield GaugeMetricFamily("streamtrain_join_early_feedback", "feedback held for impressions not yet seen",
                                value=s.early_feedback)
        yield GaugeMetricFamily("streamtrain_join_partitions", "partitions of each input this joiner owns",
                                value=len(s.partitions))
        lag = s.report()["watermark_lag_s"]
        if lag is not None:
            yield GaugeMetricFamily("streamtrain_join_watermark_lag_seconds",
                                    "wall clock minus the lowest watermark of its partitions", value=lag)


def join_registry(read: Callable[[], JoinStats]) -> CollectorRegistry:
    """A registry of the joiner's series."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(JoinCollector(read))
    return registry


class Reporter:
    """Posts the joiner's stats to the coordinator every ``every_s`` on a daemon thread; a failed post is
    logged once per outage and retried on the next tick (a coordinator's absence never stops the join)."""

    def __init__(self, coordinator_url: str, token: str, name: str, read: Callable[[], JoinStats], *,
                 url: str = "", every_s: float = 1.0) -> None:
        self._target = f"{coordinator_url.rstrip('/')}/v1/join/joiners/{name}"
        self._token, self._read, self._url, self._every = token, read, url, every_s
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._loop, name="join-report", daemon=True)
        self._thread.start()

    def post(self) -> None:
        """Send one report now.

        Raises:
            OSError: the coordinator could not be reached or refused it.
        """
        body = json.dumps({"url": self._url, **self._read().report()}).encode()
        req = urllib.request.Request(self._target, data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self._token}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            resp.read()

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.post()
                self._failing = False
            except (OSError, urllib.error.URLError) as exc:
                if not self._failing:
                    logger.warning("cannot report to %s: %s", self._target, exc)
                self._failing = True

    def close(self) -> None:
        """Stop reporting."""
        self._stop.set()
        self._thread.join(6.0)
