"""Progressive validation over the job: the trainers' windows, as series the dashboard and benchmarks read.

Pure, like :mod:`coordinator.history`: :meth:`ProgressiveHistory.observe` takes the windows a heartbeat
brought, and at each sampler tick :meth:`ProgressiveHistory.pool` turns them into one point per trainer
and one for the job (its AUC the records-weighted mean of the windows' AUCs: the coordinator never sees
the logits). See docs/online.md, *Progressive validation: does it learn online?*
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

POINT_SERIES = ("t_ms", "records", "n", "auc", "log_loss")
"""Columns of a progressive series, as :meth:`ProgressiveHistory.columns` lists them."""

MAX_MEMBERS = 32
"""Trainers whose series are kept at most (a departed trainer's series goes first, oldest last point
first), so the history stays bounded however often trainers come and go."""


@dataclass(frozen=True)
class Point:
    """One point of a progressive series: the windows closed during one sampler tick, pooled."""

    t_ms: int
    """The tick's time, ms since the epoch."""
    records: int
    """Records scored so far (a trainer's own, or the job's sum)."""
    n: int
    """Records in the windows pooled here."""
    auc: float | None
    """Records-weighted mean AUC of the windows that have one; None when none has."""
    log_loss: float
    """Records-weighted mean log loss of the windows."""


def pooled(t_ms: int, records: int, windows: Sequence[Mapping[str, Any]]) -> Point:
    """The :class:`Point` at ``t_ms`` of ``windows`` (each ``{"n", "auc", "log_loss"}``, as a
    heartbeat carries them), with ``records`` scored so far.

    Raises:
        ValueError: no windows.
    """
    if not windows:
        raise ValueError("a point pools at least one window")
    n = sum(int(w["n"]) for w in windows)
    scored = [(int(w["n"]), float(w["auc"])) for w in windows if w.get("auc") is not None]
    auc = sum(k * a for k, a in scored) / sum(k for k, _ in scored) if scored else None
    loss = sum(int(w["n"]) * float(w["log_loss"]) for w in windows) / n
    return Point(t_ms=t_ms, records=records, n=n, auc=auc, log_loss=loss)


def mean_auc(series: Mapping[str, Sequence[Any]], start: float, stop: float) -> float | None:
    """Mean AUC of ``series`` (a column dict of :meth:`ProgressiveHistory.columns`) over the records
    scored within the fraction ``start``..``stop`` of all it scored: ``(0, 0.1)`` is the run's first
    tenth, ``(0.9, 1)`` its last. A point stands for the records of its windows (the ``n`` records up
    to its ``records`` count) and weighs by how many of them fall in the span, so a point pooled over
    more than the span (a fast run's first second) still speaks for it. None when no point with an AUC
    overlaps the span.

    Raises:
        ValueError: ``start`` and ``stop`` are not fractions with ``start < stop``.
    """
    if not 0.0 <= start < stop <= 1.0:
        raise ValueError(f"span must be fractions 0 <= start < stop <= 1, got {start!r}..{stop!r}")
    records, n, auc = series.get("records") or [], series.get("n") or [], series.get("auc") or []
    if not records:
        return None
    lo, hi = start * records[-1], stop * records[-1]
    weighted = [(min(r, hi) - max(r - k, lo), a) for r, k, a in zip(records, n, auc, strict=True) if a is not None]
    picked = [(w, a) for w, a in weighted if w > 0]
    weight = sum(w for w, _ in picked)
    return sum(w * a for w, a in picked) / weight if weight else None


class ProgressiveHistory:
    """The newest ``capacity`` points of the job and of each trainer (at most :data:`MAX_MEMBERS`).

    Raises:
        ValueError: ``capacity`` is below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"progressive history capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self.job: deque[Point] = deque(maxlen=capacity)
        """The job's points, oldest first."""
        self.members: dict[str, deque[Point]] = {}
        """Each trainer's points, oldest first."""
        self.records = 0
        """Records the trainers scored in every window observed so far."""
        self._pending: dict[str, list[Mapping[str, Any]]] = {}

    def observe(self, member_id: str, windows: Sequence[Mapping[str, Any]]) -> None:
        """Keep a heartbeat's windows (``{"records", "n", "auc", "log_loss"}`` each, oldest first)
        for the next :meth:`pool`."""
        if windows:
            self._pending.setdefault(member_id, []).extend(windows)

    def pool(self, t_ms: int) -> Point | None:
        """Turn the windows observed since the previous call into one point per trainer and one for
        the job, at ``t_ms``; return the job's point (None when no window arrived)."""
        pending, self._pending = self._pending, {}
        if not pending:
            return None
        for member_id, windows in pending.items():
            self.records += sum(int(w["n"]) for w in windows)
            series = self.members.pop(member_id, None) or deque(maxlen=self.capacity)
            series.append(pooled(t_ms, int(windows[-1]["records"]), windows))
            self.members[member_id] = series  # newest last: the oldest last point is the first
        while len(self.members) > MAX_MEMBERS:
            del self.members[next(iter(self.members))]
        point = pooled(t_ms, self.records, [w for ws in pending.values() for w in ws])
        self.job.append(point)
        return point

    @staticmethod
    def _columns(points: Sequence[Point]) -> dict[str, list[Any]]:
        return {name: [getattr(p, name) for p in points] for name in POINT_SERIES}

    def columns(self, since_ms: int | None = None) -> dict[str, Any]:
        """The points newer than ``since_ms`` (all when None) as JSON columns:
        ``{"job": {t_ms, records, n, auc, log_loss}, "members": {member_id: {the same}}}``. Members
        are those with a point in the answer."""
        def newer(points: Sequence[Point]) -> list[Point]:
            return [p for p in points if since_ms is None or p.t_ms > since_ms]
        members = {m: newer(points) for m, points in self.members.items()}
        return {"job": self._columns(newer(self.job)),
                "members": {m: self._columns(points) for m, points in sorted(members.items()) if points}}
