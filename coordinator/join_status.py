"""The joiners' last reports (``POST /v1/join/joiners/<name>``, :mod:`coordinator.join_route`), kept in memory
and shown in ``/v1/status``'s ``join`` and on the status page. See docs/dashboard.md, *Joiner*."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .status import FORGET_AFTER_S

__all__ = ["JOIN", "MOST_JOINERS", "SUMMED", "JoinReports", "TooManyJoiners"]

MOST_JOINERS = 1024
"""Joiners remembered at once: a report of a new one beyond them is refused (429), so what the coordinator
keeps is bounded however many names callers make up (each is forgotten after
:data:`coordinator.status.FORGET_AFTER_S` of silence, as a serving replica is)."""

SUMMED = ("joined", "positives", "negatives", "negatives_dropped", "decided_early", "pending", "early_feedback",
          "transactions")
"""The reports' counts that ``/v1/status``'s ``join`` sums over the joiners (each joiner's cover the partitions
it owns, so their sum covers every partition owned)."""


class TooManyJoiners(Exception):
    """:data:`MOST_JOINERS` joiners are known already and a report names another."""


@dataclass
class _Joiner:
    report: dict[str, Any]
    at: float
    """``clock()`` when the report arrived."""
    joined_per_s: float | None = None
    """From this report's and the previous one's ``joined`` (None after the first report, or when the count
    went down: the joiner restarted afresh, or gave partitions away)."""


def _sum_counts(maps: list[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for counts in maps:
        for reason, n in counts.items():
            out[reason] = out.get(reason, 0) + n
    return dict(sorted(out.items()))


@dataclass
class JoinReports:
    """The last report of each joiner, in memory only: a restarted coordinator knows the joiners again within
    a report interval (a second)."""

    clock: Callable[[], float] = time.monotonic
    joiners: dict[str, _Joiner] = field(default_factory=dict)

    def _forget(self, now: float) -> None:
        for name in [n for n, j in self.joiners.items() if now - j.at > FORGET_AFTER_S]:
            del self.joiners[name]

    def observe(self, name: str, report: Mapping[str, Any]) -> None:
        """Keep ``report`` (validated: :data:`coordinator.join_route.REPORT`) as ``name``'s last.

        Raises:
            TooManyJoiners: ``name`` is new and :data:`MOST_JOINERS` joiners are known already.
        """
        now = self.clock()
        self._forget(now)
        before = self.joiners.get(name)
        if before is None and len(self.joiners) >= MOST_JOINERS:
            raise TooManyJoiners(f"{MOST_JOINERS} joiners report already; a joiner is forgotten "
                                 f"{FORGET_AFTER_S:g} s after its last report")
        rate = None
        if before is not None and now > before.at and report["joined"] >= before.report["joined"]:
            rate = (report["joined"] - before.report["joined"]) / (now - before.at)
        self.joiners[name] = _Joiner(dict(report), now, rate)

    def view(self) -> dict[str, Any]:
        """``/v1/status``'s ``join``: each joiner's last report with its ``name``, ``age_s`` (seconds since it
        arrived) and ``joined_per_s``, by name; over the joiners: the partitions they own (sorted, each once),
        the sums of :data:`SUMMED`, ``late`` and ``dead_letters`` summed by reason, the largest
        ``watermark_lag_s`` (null while none has a watermark) and the summed ``joined_per_s`` (null while
        no joiner has reported twice)."""
        now = self.clock()
        self._forget(now)
        reports = [j.report for j in self.joiners.values()]
        rates = [j.joined_per_s for j in self.joiners.values() if j.joined_per_s is not None]
        lags = [r["watermark_lag_s"] for r in reports if r["watermark_lag_s"] is not None]
        return {
            "joiners": [{"name": name, **j.report, "joined_per_s": j.joined_per_s, "age_s": round(now - j.at, 3)}
                        for name, j in sorted(self.joiners.items())],
            "partitions": sorted({p for r in reports for p in r["partitions"]}),
            **{key: sum(r[key] for r in reports) for key in SUMMED},
            "late": _sum_counts([r["late"] for r in reports]),
            "dead_letters": _sum_counts([r["dead_letters"] for r in reports]),
            "watermark_lag_s": max(lags) if lags else None,
            "joined_per_s": sum(rates) if rates else None,
        }


JOIN = web.AppKey("join_reports", JoinReports)
"""The app's :class:`JoinReports`."""
