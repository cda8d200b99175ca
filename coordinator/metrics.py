"""Prometheus metrics of one coordinator, in their own registry (never the global one)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .membership import Action, Member, MemberDrained, MemberExpired, MemberJoined, MemberLeft, Membership, Rebalanced

FRESHNESS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
"""Buckets (seconds) of produce-to-apply freshness."""


class Metrics:
    """The coordinator's metrics; :meth:`render` gives the exposition text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.generation = Gauge("streamtrain_generation", "membership generation", registry=r)
        self.members = Gauge("streamtrain_members", "live members by state", ["state"], registry=r)
        self.joins = Counter("streamtrain_member_joins", "members registered", registry=r)
        self.departures = Counter("streamtrain_member_departures", "members gone, by reason",
                                  ["reason"], registry=r)
        self.rebalances = Counter("streamtrain_rebalances", "generation bumps", registry=r)
        self.moved = Counter("streamtrain_partitions_moved", "partitions that changed owner",
                             registry=r)
        self.reassignment_delay = Histogram(
            "streamtrain_reassignment_delay_seconds",
            "from a lease's expiry to its partitions being reassigned in Redis", registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.freshness = Histogram(
            "streamtrain_freshness_seconds",
            "produce-to-apply latency of records, as reported by trainers' heartbeats",
            registry=r, buckets=FRESHNESS_BUCKETS)
        self.records_per_s = Gauge("streamtrain_member_records_per_second",
                                   "training throughput per member", ["member"], registry=r)
        self.loss = Gauge("streamtrain_member_loss", "last reported loss per member", ["member"],
                          registry=r)
        self.lag = Gauge("streamtrain_member_lag",
                         "consumer lag (Kafka messages) per member, as its heartbeat reports it: the sum over "
                         "its partitions of the end offset minus its consumer's position", ["member"],
                         registry=r)
        self.progressive_auc = Gauge("streamtrain_member_progressive_auc",
                                     "AUC of each member's newest progressive-validation window (binary models: "
                                     "records scored on the training forward pass, before training on them)",
                                     ["member"], registry=r)
        self.heartbeats = Counter("streamtrain_heartbeats", "heartbeats accepted", registry=r)
        self.model_version = Gauge("streamtrain_model_version", "each shard group's version in the parameter "
                                   "plane, sampled every second (a serving replica's streamtrain_serve_version "
                                   "trails it)", ["group"], registry=r)

    def observe_versions(self, versions: Iterable[int]) -> None:
        """The groups' versions of the newest sample."""
        for g, v in enumerate(versions):
            self.model_version.labels(str(g)).set(v)

    def observe_actions(self, actions: Iterable[Action], now_ms: int) -> None:
        """Count the membership ``actions`` committed at ``now_ms``."""
        for a in actions:
            if isinstance(a, MemberJoined):
                self.joins.inc()
            elif isinstance(a, MemberExpired):
                self.departures.labels("expired").inc()
                self.reassignment_delay.observe(max(0, now_ms - a.lease_expires_ms) / 1000)
                self._forget(a.member_id)
            elif isinstance(a, MemberLeft):
                self.departures.labels("left").inc()
                self._forget(a.member_id)
            elif isinstance(a, MemberDrained):
                self.departures.labels("drained").inc()
            elif isinstance(a, Rebalanced):
                self.rebalances.inc()
                self.moved.inc(len(a.moved))

    def _forget(self, member_id: str) -> None:
        for gauge in (self.records_per_s, self.loss, self.lag, self.progressive_auc):
            try:
                gauge.remove(member_id)
            except KeyError:
                pass

    def observe_state(self, state: Membership) -> None:
        """Set the gauges from the membership ``state``."""
        self.generation.set(state.generation)
        counts: dict[str, int] = {"active": 0, "draining": 0}
        for m in state.members.values():
            counts[m.state.value] = counts.get(m.state.value, 0) + 1
        for k, v in counts.items():
            self.members.labels(k).set(v)

    def observe_heartbeat(self, member: Member, stats: Mapping[str, Any]) -> None:
        """Record a member's heartbeat stats (freshness samples go into the histogram)."""
        self.heartbeats.inc()
        for sample in stats.get("freshness_s", ()):
            self.freshness.observe(sample)
        if "records_per_s" in stats:
            self.records_per_s.labels(member.member_id).set(stats["records_per_s"])
        if "loss" in stats:
            self.loss.labels(member.member_id).set(stats["loss"])
        if "progressive_auc" in stats:
            self.progressive_auc.labels(member.member_id).set(stats["progressive_auc"])
        if "lag" in stats:
            self.lag.labels(member.member_id).set(stats["lag"])
        else:  # no partition fetched yet (or none left): no stale value from an earlier assignment
            try:
                self.lag.remove(member.member_id)
            except KeyError:
                pass

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
