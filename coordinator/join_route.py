"""``POST /v1/join/joiners/<name>``: a joiner's report (``streamtrain join``), sent every second.

The coordinator keeps the last report of each joiner in memory (:class:`coordinator.join_status.JoinReports`:
no Redis), forgets a joiner not heard from for ten seconds, and shows them in ``/v1/status``'s ``join`` and on
the status page, as it does the serving replicas' (:mod:`coordinator.serving_route`). The call takes the job
token. See docs/dashboard.md, *Joiner*.
"""

from __future__ import annotations

import re

from aiohttp import web

from .join_status import JOIN, JoinReports, TooManyJoiners
from .routes import ApiError, authenticate, read_body
from .runtime import RUNTIME
from .validation import Field

__all__ = ["NAME", "REASON", "REPORT", "setup_join_route"]

_MOST_INT = (1 << 63) - 1
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
"""A joiner's name (its ``--instance-id``: the host name, by default)."""
REASON = r"[a-z_]{1,64}"
"""A late or dead-letter reason's name (``outside_window``, ``bad_event``, ``non_finite`` ...)."""
MOST_REASONS = 32
"""Reasons one report may count, in ``late`` and in ``dead_letters`` each."""


def _count(*, nullable: bool = False) -> Field:
    return Field("int", required=True, min=0, max=_MOST_INT, nullable=nullable)


def _reasons() -> Field:
    return Field("counts", required=True, min=0, max=_MOST_INT, max_len=MOST_REASONS, names=REASON)


REPORT = {
    "url": Field("str", required=True, max_len=2048),
    "partitions": Field("ints", required=True, min=0, max=(1 << 31) - 1, max_len=4096),
    "joined": _count(),
    "positives": _count(),
    "negatives": _count(),
    "negatives_dropped": _count(),
    "late": _reasons(),
    "dead_letters": _reasons(),
    "decided_early": _count(),
    "pending": _count(),
    "early_feedback": _count(),
    "watermark_ms": _count(nullable=True),
    "watermark_lag_s": Field("number", required=True, nullable=True, min=0),
    "transactions": _count(),
}
"""Body of ``POST /v1/join/joiners/<name>`` (``datastream.join.service.JoinStats.report``): the joiner's metrics
URL (or ""), the input partitions it owns, impressions labelled (``joined``), positives and negatives among them,
the negatives of those dropped by ``--negative-rate`` (not written), late feedback and dead letters by reason,
impressions decided early (``--max-pending``), impressions pending and feedback held early, its watermark (ms;
null before it has one) and how far it lags the wall clock (s), and the transactions it committed. Counts are
cumulative over the partitions it owns."""


async def report(request: web.Request) -> web.Response:
    """Keep a joiner's report (204)."""
    authenticate(request, request.app[RUNTIME].settings.job_token, "job")
    name = request.match_info["name"]
    if not NAME.fullmatch(name):
        raise ApiError(400, "invalid_name", f"a joiner's name is 1-128 characters of A-Z a-z 0-9 _ . : -, "
                                            f"got {name[:140]!r}")
    body = await read_body(request, REPORT)
    try:
        request.app[JOIN].observe(name, body)
    except TooManyJoiners as exc:
        raise ApiError(429, "too_many_joiners", str(exc)) from None
    return web.Response(status=204)


def setup_join_route(app: web.Application) -> None:
    """Add the route, and the joiners' reports it keeps, to ``app``."""
    app[JOIN] = JoinReports()
    app.router.add_post("/v1/join/joiners/{name}", report)
