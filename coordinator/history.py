"""A bounded history of job samples: what ``GET /v1/history`` serves and the dashboard plots.

Pure, like :mod:`coordinator.membership`: :func:`take_sample` turns what the sampler
(:mod:`coordinator.sampler`) read at one instant into a :class:`Sample`, and :class:`History` keeps the
newest ``capacity`` of them and answers them as columns. A value nobody reported is ``None``, never 0;
counters become rates against the previous sample. See docs/dashboard.md, *What it shows*.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .tables import TableTotals, mean_hit_rate

SAMPLE_INTERVAL_S = 1.0
"""Seconds between two samples."""

JOB_SERIES = ("loss", "accuracy", "auc", "log_loss", "records_per_s", "lag", "staleness_max", "staleness_mean",
              "freshness_p50_s", "freshness_p99_s", "version", "versions_per_s",
              "table_rows", "table_bytes", "table_admitted_per_s", "table_dropped_per_s",
              "table_expired_per_s", "table_evicted_per_s", "row_cache_hit_rate")
"""Job-wide series of a :class:`Sample`, in the order :meth:`History.columns` lists them."""

MEMBER_SERIES = ("loss", "accuracy", "auc", "log_loss", "records_per_s")
"""Per-member series of a :class:`MemberSample`."""

TABLE_SERIES = ("rows", "bytes", "admitted_per_s", "dropped_per_s", "expired_per_s", "evicted_per_s")
"""Per-table series of a :class:`TableSample`."""


@dataclass(frozen=True)
class MemberSample:
    """One member's stats at a sample, from its last heartbeat."""

    loss: float | None = None
    """Training loss (the trainer's moving average over recent batches)."""
    accuracy: float | None = None
    """Held-out accuracy of its last evaluation (None for regression or before the first one)."""
    auc: float | None = None
    """Held-out AUC of its last evaluation (a binary model only)."""
    log_loss: float | None = None
    """Held-out log loss of its last evaluation (a binary model only)."""
    records_per_s: float | None = None
    """Records it trained on per second, over its last heartbeat interval."""


@dataclass(frozen=True)
class TableSample:
    """One embedding table at a sample: its totals over the shard groups, and their rates."""

    totals: TableTotals
    """Rows, bytes and the counters, summed over the groups."""
    admitted_per_s: float | None = None
    """Rows admitted per second since the previous sample (None: no previous sample, or the
    counter went back)."""
    dropped_per_s: float | None = None
    """Gradient rows of unadmitted IDs dropped per second, likewise."""
    expired_per_s: float | None = None
    """Rows expired per second, likewise."""
    evicted_per_s: float | None = None
    """Rows evicted per second, likewise."""

    @property
    def rows(self) -> int:
        """Rows held."""
        return self.totals.rows

    @property
    def bytes(self) -> int:
        """Redis memory of its rows (``MEMORY USAGE`` estimate)."""
        return self.totals.bytes


@dataclass(frozen=True)
class Sample:
    """The job at one instant."""

    t_ms: int
    """When it was taken, ms since the epoch."""
    loss: float | None = None
    """Mean of the members' training losses."""
    accuracy: float | None = None
    """Mean of the members' held-out accuracies."""
    auc: float | None = None
    """Mean of the members' held-out AUCs (a binary model)."""
    log_loss: float | None = None
    """Mean of the members' held-out log losses (a binary model)."""
    records_per_s: float | None = None
    """Sum of the members' records/s."""
    lag: int | None = None
    """Records on the topic not yet committed, over every partition (None without Kafka)."""
    staleness_max: float | None = None
    """Largest staleness (clocks) a live member observed at its last clock wait."""
    staleness_mean: float | None = None
    """Mean of the same."""
    freshness_p50_s: float | None = None
    """Median seconds from a record's produce to the first version holding its gradient,
    over the freshness samples reported since the previous sample."""
    freshness_p99_s: float | None = None
    """99th percentile of the same."""
    version: int | None = None
    """The model version: the sum of the shard groups' versions (``coordinator.status.model_version``;
    it grows with every write of any group)."""
    versions_per_s: float | None = None
    """Versions published per second since the previous sample."""
    table_rows: int | None = None
    """Rows of every embedding table (None for a dense model)."""
    table_bytes: int | None = None
    """Redis memory of every table's rows (``MEMORY USAGE`` estimate)."""
    table_admitted_per_s: float | None = None
    """Rows admitted per second, over every table that has a rate at this sample."""
    table_dropped_per_s: float | None = None
    """Gradient rows of unadmitted IDs dropped per second, likewise."""
    table_expired_per_s: float | None = None
    """Rows expired per second, likewise."""
    table_evicted_per_s: float | None = None
    """Rows evicted per second, likewise."""
    row_cache_hit_rate: float | None = None
    """Mean of the live members' row cache hit rates over their last heartbeat window."""
    members: Mapping[str, MemberSample] = field(default_factory=dict)
    """Per live member."""
    tables: Mapping[str, TableSample] = field(default_factory=dict)
    """Per embedding table, in the model's order (empty for a dense model)."""


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values`` with linear interpolation between ranks
    (numpy's default); None when there are none.

    Raises:
        ValueError: ``q`` is outside 0..1.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be within 0..1, got {q!r}")
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _number(stats: Mapping[str, Any], name: str) -> float | None:
    value = stats.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _sum(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _rate(counter: str, now: TableTotals, before: TableSample | None, seconds: float) -> float | None:
    """``counter``'s growth per second from ``before`` to ``now``; None without ``before``, time
    passed or growth (a counter that went back: a checkpoint restored, the model made anew)."""
    if before is None or seconds <= 0:
        return None
    grown = getattr(now, counter) - getattr(before.totals, counter)
    return grown / seconds if grown >= 0 else None


def table_samples(totals: Mapping[str, TableTotals], t_ms: int,
                  previous: Sample | None) -> dict[str, TableSample]:
    """Each table's :class:`TableSample` at ``t_ms``: ``totals`` with the rates of its counters
    against ``previous`` (None where there is no previous sample of the table, no time passed, or
    the counter went back)."""
    seconds = (t_ms - previous.t_ms) / 1000 if previous is not None else 0.0
    out = {}
    for name, now in totals.items():
        before = previous.tables.get(name) if previous is not None else None
        out[name] = TableSample(totals=now, admitted_per_s=_rate("admitted", now, before, seconds),
                                dropped_per_s=_rate("dropped", now, before, seconds),
                                expired_per_s=_rate("expired", now, before, seconds),
                                evicted_per_s=_rate("evicted", now, before, seconds))
    return out


def take_sample(t_ms: int, member_stats: Mapping[str, Mapping[str, Any]], *, lag: int | None,
                staleness: Mapping[str, int], version: int | None, freshness_s: Sequence[float],
                previous: Sample | None, tables: Mapping[str, TableTotals] | None = None) -> Sample:
    """The :class:`Sample` of the job at ``t_ms``.

    Args:
        t_ms: now, ms since the epoch.
        member_stats: live member id -> the stats of its last heartbeat.
        lag: total lag of the topic, None when Kafka did not answer.
        staleness: member id -> staleness at its last clock wait (``JobKeys.staleness``);
            only live members count. When no live member has an entry, the members'
            reported ``staleness`` stats are used instead.
        version: the model version (the sum of the groups' versions), None before the model exists.
        freshness_s: freshness samples of the heartbeats since ``previous``.
        previous: the sample before, for versions/s and the tables' rates (None for the first).
        tables: each embedding table's totals over the groups, in the model's order (None or
            empty for a dense model).
    """
    members = {m: MemberSample(loss=_number(s, "loss"), accuracy=_number(s, "accuracy"), auc=_number(s, "auc"),
                               log_loss=_number(s, "log_loss"), records_per_s=_number(s, "records_per_s"))
               for m, s in member_stats.items()}
    observed = [float(v) for m, v in staleness.items() if m in member_stats]
    if not observed:
        observed = [v for v in (_number(s, "staleness") for s in member_stats.values()) if v is not None]
    rates = [m.records_per_s for m in members.values() if m.records_per_s is not None]
    per_s = None
    if (previous is not None and previous.version is not None and version is not None
            and t_ms > previous.t_ms and version >= previous.version):
        per_s = (version - previous.version) / ((t_ms - previous.t_ms) / 1000)
    per_table = table_samples(tables or {}, t_ms, previous)
    ts = list(per_table.values())
    return Sample(
        t_ms=t_ms,
        loss=_mean(m.loss for m in members.values()),
        accuracy=_mean(m.accuracy for m in members.values()),
        auc=_mean(m.auc for m in members.values()),
        log_loss=_mean(m.log_loss for m in members.values()),
        records_per_s=sum(rates) if rates else None,
        lag=lag,
        staleness_max=max(observed) if observed else None,
        staleness_mean=_mean(observed),
        freshness_p50_s=quantile(freshness_s, 0.5),
        freshness_p99_s=quantile(freshness_s, 0.99),
        version=version,
        versions_per_s=per_s,
        table_rows=sum(t.rows for t in ts) if ts else None,
        table_bytes=sum(t.bytes for t in ts) if ts else None,
        table_admitted_per_s=_sum(t.admitted_per_s for t in ts),
        table_dropped_per_s=_sum(t.dropped_per_s for t in ts),
        table_expired_per_s=_sum(t.expired_per_s for t in ts),
        table_evicted_per_s=_sum(t.evicted_per_s for t in ts),
        row_cache_hit_rate=mean_hit_rate(member_stats),
        members=members,
        tables=per_table,
    )


class History:
    """The newest ``capacity`` samples, oldest first.

    Args:
        capacity: samples kept; adding one more drops the oldest.

    Raises:
        ValueError: ``capacity`` is below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity must be >= 1, got {capacity!r}")
        self._samples: deque[Sample] = deque(maxlen=capacity)

    @property
    def capacity(self) -> int:
        """Samples kept at most."""
        assert self._samples.maxlen is not None
        return self._samples.maxlen

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def last(self) -> Sample | None:
        """The newest sample, None while there is none."""
        return self._samples[-1] if self._samples else None

    def add(self, sample: Sample) -> None:
        """Append ``sample`` (dropping the oldest when full).

        Raises:
            ValueError: ``sample`` is not newer than the last one (the time axis only
                moves forward, so ``since_ms`` reads never miss or repeat a sample).
        """
        last = self.last
        if last is not None and sample.t_ms <= last.t_ms:
            raise ValueError(f"sample at {sample.t_ms} ms is not newer than the last one "
                             f"({last.t_ms} ms)")
        self._samples.append(sample)

    def columns(self, since_ms: int | None = None) -> dict[str, Any]:
        """The samples newer than ``since_ms`` (all when None) as JSON columns:

        ``{"interval_s", "capacity", "t_ms": [...], "job": {series: [...]},
        "members": {member_id: {series: [...]}}, "tables": {table: {series: [...]}}}`` — every
        column as long as ``t_ms``; a member absent at a sample (not yet joined, or gone), or a
        table absent at a sample (before the model existed), has ``None`` there. Members are
        those present in at least one returned sample, tables likewise (in the model's order).
        """
        picked = [s for s in self._samples if since_ms is None or s.t_ms > since_ms]
        ids = sorted({m for s in picked for m in s.members})
        names = list(dict.fromkeys(t for s in picked for t in s.tables))
        empty = MemberSample()
        return {
            "interval_s": SAMPLE_INTERVAL_S,
            "capacity": self.capacity,
            "t_ms": [s.t_ms for s in picked],
            "job": {name: [getattr(s, name) for s in picked] for name in JOB_SERIES},
            "members": {m: {name: [getattr(s.members.get(m, empty), name) for s in picked]
                            for name in MEMBER_SERIES} for m in ids},
            "tables": {t: {name: [getattr(s.tables[t], name) if t in s.tables else None for s in picked]
                           for name in TABLE_SERIES} for t in names},
        }
