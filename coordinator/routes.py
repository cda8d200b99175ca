"""HTTP handlers of the coordinator; every error is JSON ``{"error": {"code", "message"}}``.

Trainer calls carry ``Authorization: Bearer <job token>``, admin calls the
admin token (compared with :func:`hmac.compare_digest`). Bodies are validated
strictly (:mod:`coordinator.validation`) before anything is written, so a
refused request changes nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from collections.abc import Mapping
from importlib import resources
from typing import Any, cast

from aiohttp import web

from common.outage import REDIS_DOWN

from .assign import capability_weight
from .errors import ConflictError, MemberGoneError, UnknownMemberError
from .join_status import JOIN
from .membership import Drain, Event, Heartbeat, Leave, Membership, Register
from .runtime import RUNTIME, SAMPLER, Runtime, apply_event, now_ms
from .state import FIXED_CONFIG, JobConfig
from .status import SERVING, members_view, model_version, partitions_view, read_plane, summary
from .tables import tables_view
from .validation import CONFIG_CHANGE, HEARTBEAT, REGISTER, Field, InvalidBody, parse_json

logger = logging.getLogger(__name__)

routes = web.RouteTableDef()
_HOST_RE = re.compile(r"[^A-Za-z0-9.-]+")
_EMPTY: dict[str, Field] = {}


class ApiError(Exception):
    """An HTTP error answered as JSON ``{"error": {"code", "message"}}``.

    Args:
        status: the HTTP status (4xx or 5xx).
        code: a stable machine-readable code, e.g. ``invalid_body``.
        message: what was wrong, for people.
        headers: extra response headers (``Allow`` of a 405); a 401 always
            gets ``WWW-Authenticate: Bearer``.
        fields: more members of the ``error`` object (a 410's ``oldest`` and ``current``).
    """

    def __init__(self, status: int, code: str, message: str,
                 headers: Mapping[str, str] | None = None, **fields: int | str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})
        self.fields = fields

    def response(self) -> web.Response:
        """The JSON error response."""
        headers = dict(self.headers)
        if self.status == 401:
            headers.setdefault("WWW-Authenticate", "Bearer")
        return web.json_response({"error": {"code": self.code, "message": self.message, **self.fields}},
                                 status=self.status, headers=headers or None)


_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
          410: "gone", 413: "body_too_large"}
_KEPT_HEADERS = ("Allow",)
"""Headers of aiohttp's own errors that our JSON answer keeps (RFC 9110: a 405 names the
allowed methods in ``Allow``)."""


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer every error as JSON: an over-size body is a 413 naming the limit, a 405
    keeps its ``Allow`` header, an unexpected exception is a 500 (logged)."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge:
        return ApiError(413, "body_too_large",
                        f"request body too large: the limit is "
                        f"{request.app[RUNTIME].settings.max_request_bytes} bytes").response()
    except web.HTTPException as exc:
        if exc.status_code < 400:
            raise
        kept = {name: exc.headers[name] for name in _KEPT_HEADERS if name in exc.headers}
        return ApiError(exc.status_code, _CODES.get(exc.status_code, "error"),
                        f"{exc.reason}: {request.method} {request.path}", kept).response()
    except asyncio.CancelledError:
        raise
    except REDIS_DOWN as exc:  # an outage: callers retry (the lease checker logs its start and end)
        return ApiError(503, "redis_unavailable", f"the job's Redis is unreachable ({exc}); retry").response()
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return ApiError(500, "internal", "internal error; see the coordinator log").response()


def _rt(request: web.Request) -> Runtime:
    return request.app[RUNTIME]


def authenticate(request: web.Request, token: str, kind: str) -> None:
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(401, "unauthorized", f"missing bearer {kind} token (Authorization: Bearer ...)")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "unauthorized", f"wrong {kind} token")


async def read_body(request: web.Request, schema: dict[str, Field], *, allow_empty: bool = False,
                    fixed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The request's JSON body validated against ``schema`` (:func:`coordinator.validation.parse_json`); 400
    ``invalid_body`` naming the field otherwise."""
    raw = await request.read()
    try:
        return parse_json(raw, schema, allow_empty=allow_empty, fixed=fixed)
    except InvalidBody as exc:
        raise ApiError(400, "invalid_body", str(exc)) from None


async def _apply(rt: Runtime, event: Event) -> Membership:
    try:
        state, _ = await apply_event(rt, event)
    except UnknownMemberError as exc:
        raise ApiError(404, "unknown_member", f"{exc}; register with POST /v1/members") from None
    except MemberGoneError as exc:
        raise ApiError(410, "member_gone", str(exc)) from None
    except ConflictError as exc:
        raise ApiError(503, "conflict", str(exc)) from None
    return state


def _reply(rt: Runtime, state: Membership, member_id: str, config: JobConfig) -> dict[str, Any]:
    member = state.members[member_id]
    return {"member_id": member_id, "generation": state.generation,
            "partitions": state.partitions_of(member_id),
            "state": "paused" if config.paused else member.state.value,
            "lease_ms": rt.settings.lease_ms,
            "heartbeat_interval_ms": rt.settings.heartbeat_interval_ms,
            "config": config.as_json()}


def new_member_id(hostname: str | None) -> str:
    """A fresh member id ``<hostname>-<uuid8>`` (never reused)."""
    host = _HOST_RE.sub("-", hostname or "").strip("-.")[:48] or "member"
    return f"{host}-{uuid.uuid4().hex[:8]}"


# -- trainer calls ------------------------------------------------------------

@routes.post("/v1/members")
async def register(request: web.Request) -> web.Response:
    """Register a trainer; reply with its member id, generation, partitions and config."""
    rt = _rt(request)
    authenticate(request, rt.settings.job_token, "job")
    caps = (await read_body(request, REGISTER))["capabilities"]
    weight = capability_weight(caps["device"], caps.get("threads", 1))
    member_id = new_member_id(caps.get("hostname"))
    state = await _apply(rt, Register(member_id=member_id, capabilities=caps, weight=weight,
                                      now_ms=now_ms(), lease_ms=rt.settings.lease_ms))
    return web.json_response(_reply(rt, state, member_id, await rt.store.config()), status=201)


@routes.post("/v1/members/{member_id}/heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    """Renew a member's lease, record its stats; reply with its current assignment."""
    rt = _rt(request)
    authenticate(request, rt.settings.job_token, "job")
    member_id = request.match_info["member_id"]
    stats = (await read_body(request, HEARTBEAT, allow_empty=True)).get("stats", {})
    windows = stats.pop("progressive", [])  # for the history, not the membership
    state = await _apply(rt, Heartbeat(member_id=member_id, stats=stats, now_ms=now_ms(),
                                       lease_ms=rt.settings.lease_ms))
    rt.metrics.observe_heartbeat(state.members[member_id], stats)
    request.app[SAMPLER].observe_heartbeat(stats.get("freshness_s", ()))
    request.app[SAMPLER].progressive.observe(member_id, windows)
    return web.json_response(_reply(rt, state, member_id, await rt.store.config()))


@routes.post("/v1/members/{member_id}/leave")
async def leave(request: web.Request) -> web.Response:
    """Leave gracefully (after committing): partitions move now and the generation bumps."""
    rt = _rt(request)
    authenticate(request, rt.settings.job_token, "job")
    await read_body(request, _EMPTY, allow_empty=True)
    member_id = request.match_info["member_id"]
    state = await _apply(rt, Leave(member_id=member_id, now_ms=now_ms()))
    return web.json_response({"member_id": member_id, "generation": state.generation})


# -- admin calls --------------------------------------------------------------

@routes.post("/v1/admin/members/{member_id}/drain")
async def drain(request: web.Request) -> web.Response:
    """Drain a member: its partitions move now; its heartbeats say ``draining``."""
    rt = _rt(request)
    authenticate(request, rt.settings.admin_token, "admin")
    await read_body(request, _EMPTY, allow_empty=True)
    member_id = request.match_info["member_id"]
    state = await _apply(rt, Drain(member_id=member_id, now_ms=now_ms()))
    return web.json_response({"member_id": member_id, "generation": state.generation,
                              "state": state.members[member_id].state.value})


async def _set_paused(request: web.Request, paused: bool) -> web.Response:
    rt = _rt(request)
    authenticate(request, rt.settings.admin_token, "admin")
    await read_body(request, _EMPTY, allow_empty=True)
    config = await rt.store.update_config(paused=paused)
    logger.info("job %s %s", rt.settings.job, "paused" if paused else "resumed")
    return web.json_response(config.as_json())


@routes.post("/v1/admin/pause")
async def pause(request: web.Request) -> web.Response:
    """Pause the job: heartbeats answer ``paused`` and trainers stop consuming."""
    return await _set_paused(request, True)


@routes.post("/v1/admin/resume")
async def resume(request: web.Request) -> web.Response:
    """Resume a paused job."""
    return await _set_paused(request, False)


@routes.patch("/v1/admin/config")
async def change_config(request: web.Request) -> web.Response:
    """Change the consistency model, staleness bound or learning rate, of the dense part or of the
    embedding tables (``table_*``; null: follow the dense part's again). ``ps_groups``, fixed with
    the model's layout, is refused naming the reason."""
    rt = _rt(request)
    authenticate(request, rt.settings.admin_token, "admin")
    changes = await read_body(request, CONFIG_CHANGE, fixed=FIXED_CONFIG)
    if not changes:
        raise ApiError(400, "invalid_body",
                       f"body: name at least one of {', '.join(sorted(CONFIG_CHANGE))}")
    if "lr" in changes:
        changes["lr"] = float(changes["lr"])
    config = await rt.store.update_config(**changes)
    return web.json_response(config.as_json())


# -- read-only views ----------------------------------------------------------

@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP."""
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Readiness: Redis and Kafka both reachable (503 naming the one that is not)."""
    rt = _rt(request)
    checks: dict[str, str] = {}
    try:
        async with asyncio.timeout(rt.settings.kafka_timeout_ms / 1000):  # not wait_for: common.tasks
            await rt.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["redis"] = f"unreachable: {exc!r}"
    try:
        await rt.kafka(rt.probe.ping)
        checks["kafka"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["kafka"] = f"unreachable: {exc!r}"
    ready = all(v == "ok" for v in checks.values())
    return web.json_response({"status": "ready" if ready else "not ready", "checks": checks},
                             status=200 if ready else 503)


async def _partitions(rt: Runtime, state: Membership, config: JobConfig) -> list[dict[str, Any]]:
    keys = rt.store.keys
    raw_assignment = await rt.redis.hgetall(keys.assignment)
    offsets_hash = cast("dict[bytes, bytes]", await rt.redis.hgetall(keys.offsets))
    committed = {k.decode(): int(v) for k, v in offsets_hash.items()}
    try:
        offsets = await rt.kafka(rt.probe.offsets, config.topic, config.partitions)
    except Exception as exc:  # noqa: BLE001 - status degrades without Kafka
        logger.warning("end offsets of %s unavailable: %r", config.topic, exc)
        offsets = None
    return partitions_view(state, raw_assignment, committed, offsets)


@routes.get("/v1/members")
async def members(request: web.Request) -> web.Response:
    """Live members with their capabilities, partitions, lease and last stats."""
    rt = _rt(request)
    state = await rt.store.load()
    return web.json_response({"generation": state.generation,
                              "members": members_view(state, now_ms())})


@routes.get("/v1/partitions")
async def partitions(request: web.Request) -> web.Response:
    """Every partition with owner, committed offset, end offset and lag."""
    rt = _rt(request)
    config = await rt.store.config()
    state = await rt.store.load()
    return web.json_response({"generation": state.generation,
                              "partitions": await _partitions(rt, state, config)})


@routes.get("/v1/status")
async def status(request: web.Request) -> web.Response:
    """Everything at once: config, members, partitions, versions, staleness, throughput, loss, the
    embedding tables (rows, bytes, counters, the trainers' row cache hit rate), the serving replicas
    (their last reports, :mod:`coordinator.serving_route`) and the joiners (:mod:`coordinator.join_route`)."""
    rt = _rt(request)
    keys = rt.store.keys
    config = await rt.store.config()
    state = await rt.store.load()
    parts = await _partitions(rt, state, config)
    groups = await rt.store.groups(config)
    plane = await read_plane(rt.redis, keys, groups, "clocks", "applied_clocks")
    versions, clocks, applied = plane.versions, plane.hashes["clocks"], plane.hashes["applied_clocks"]
    tables = await request.app[SAMPLER].tables.read(rt.redis, groups,
                                                    model_exists=model_version(versions) is not None)
    body = {"job": rt.settings.job, "generation": state.generation, "config": config.as_json(),
            "members": members_view(state, now_ms()), "partitions": parts,
            "lag": sum(p["lag"] for p in parts if p["lag"] is not None),
            **summary(state, config, versions, clocks, applied),
            "tables": tables_view(tables, {m.member_id: m.stats for m in state.members.values()}),
            "serving": request.app[SERVING].view(), "join": request.app[JOIN].view()}
    return web.json_response(body)


@routes.get("/v1/history")
async def history(request: web.Request) -> web.Response:
    """The job sampled once a second (loss, accuracy, records/s, lag, staleness, freshness,
    versions/s; loss, accuracy and records/s per member too) as columns, and the progressive
    validation of a binary model (per trainer and for the job, :mod:`coordinator.progressive`);
    ``?since_ms=T`` answers only the samples and points after ``T``."""
    raw = request.query.get("since_ms")
    since = None
    if raw is not None:
        # as the OpenAPI file says: 0 .. 2**63-1 in digits (int() would also take " 1_000" or "+1")
        if not re.fullmatch(r"[0-9]{1,19}", raw) or int(raw) >= 1 << 63:
            raise ApiError(400, "bad_request", f"since_ms: expected integer milliseconds since the epoch "
                                               f"(0 .. 2**63-1), got {raw!r}")
        since = int(raw)
    sampler = request.app[SAMPLER]
    return web.json_response({**sampler.history.columns(since_ms=since),
                              "progressive": sampler.progressive.columns(since_ms=since)})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition (refreshes the membership gauges first)."""
    rt = _rt(request)
    rt.metrics.observe_state(await rt.store.load())
    return web.Response(body=rt.metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@routes.get("/v1/openapi.yaml")
async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI document of this API."""
    text = resources.files(__package__).joinpath("openapi.yaml").read_text("utf-8")
    return web.Response(text=text, content_type="application/yaml")


@routes.get("/")
async def index(request: web.Request) -> web.Response:
    """The status page: live plots from ``/v1/history``, tables from ``/v1/status``."""
    text = resources.files(__package__).joinpath("static/index.html").read_text("utf-8")
    return web.Response(text=text, content_type="text/html")


_VENDORED = {"uPlot.iife.min.js": "application/javascript", "uPlot.min.css": "text/css",
             "LICENSE": "text/plain"}
"""Files in ``static/vendor`` (uPlot, vendored so the page works offline) and their types."""


@routes.get("/static/vendor/{name}")
async def vendored(request: web.Request) -> web.Response:
    """A vendored file of the status page (only those in :data:`_VENDORED`)."""
    name = request.match_info["name"]
    if name not in _VENDORED:
        raise ApiError(404, "not_found", f"no vendored file {name!r}; there are {', '.join(sorted(_VENDORED))}")
    body = resources.files(__package__).joinpath("static", "vendor", name).read_bytes()
    return web.Response(body=body, content_type=_VENDORED[name], charset="utf-8",
                        headers={"Cache-Control": "max-age=3600"})


def setup_routes(app: web.Application) -> None:
    """Add every route of the API to ``app``."""
    app.add_routes(routes)
