"""``POST /v1/serving/replicas/<name>``: a serving replica's report, sent every second (``serving/replica.py``).

The coordinator keeps the last report of each replica in memory (:class:`coordinator.status.ServingReports`:
no Redis), forgets a replica not heard from for ten seconds, and shows them in ``/v1/status``'s ``serving``
and on the status page. The call takes the job token, like the trainers' calls. See docs/dashboard.md.
"""

from __future__ import annotations

import re

from aiohttp import web

from .routes import ApiError, authenticate, read_body
from .runtime import RUNTIME
from .status import SERVING, ServingReports, TooManyReplicas
from .validation import Field

__all__ = ["REPORT", "NAME", "setup_serving_route"]

_MOST_INT = (1 << 63) - 1
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
"""A replica's name (its host and port, by default)."""

REPORT = {
    "url": Field("str", required=True, max_len=2048),
    "version": Field("str", required=True, nullable=True, max_len=20000),
    "staleness_s": Field("number", required=True, nullable=True, min=0),
    "ready": Field("bool", required=True),
    "rows": Field("int", required=True, min=0, max=_MOST_INT),
    "misses": Field("int", required=True, min=0, max=_MOST_INT),
    "reloads": Field("int", required=True, min=0, max=_MOST_INT),
    "requests": Field("int", required=True, min=0, max=_MOST_INT),
    "records": Field("int", required=True, min=0, max=_MOST_INT),
    "latency_p99_ms": Field("number", required=True, nullable=True, min=0),
    "served_auc": Field("number", required=True, nullable=True, min=0, max=1),
    "labelled": Field("int", required=True, min=0, max=_MOST_INT),
}
"""Body of ``POST /v1/serving/replicas/<name>`` (``serving.replica.Replica.report``): the replica's URL, the
version it serves (null before its first state), seconds since it last read the feed to its head, whether it
is ready, rows held, rows read through, states reloaded, requests and records answered since it started,
the p99 of its request times over the last report interval (ms; null without requests), the AUC of the
labelled records it answered and how many."""


async def report(request: web.Request) -> web.Response:
    """Keep a serving replica's report (204)."""
    authenticate(request, request.app[RUNTIME].settings.job_token, "job")
    name = request.match_info["name"]
    if not NAME.fullmatch(name):
        raise ApiError(400, "invalid_name", f"a replica's name is 1-128 characters of A-Z a-z 0-9 _ . : -, "
                                            f"got {name[:140]!r}")
    body = await read_body(request, REPORT)
    try:
        request.app[SERVING].observe(name, body)
    except TooManyReplicas as exc:
        raise ApiError(429, "too_many_replicas", str(exc)) from None
    return web.Response(status=204)


def setup_serving_route(app: web.Application) -> None:
    """Add the route, and the replicas' reports it keeps, to ``app``."""
    app[SERVING] = ServingReports()
    app.router.add_post("/v1/serving/replicas/{name}", report)
