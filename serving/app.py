"""The replica's HTTP interface: the Open Inference Protocol (KServe v2, REST) and ``POST /v1/predict``.

Health routes (``/v2/health/*``, ``/v2/models/<job>/ready``) take no token; the model routes take the
serving token (the job token unless ``--serve-token``). Errors are the protocol's ``{"error": ...}`` with a
``code``; bad input is a 400 naming the problem. See docs/serving.md, *The protocol*.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import generate_latest
from safetensors.numpy import save as save_safetensors

from .protocol import ProtocolError, error_body, infer_response, model_metadata, parse_infer, parse_records
from .replica import PlaneUnavailable, Replica
from .settings import ServeSettings

logger = logging.getLogger(__name__)

__all__ = ["create_app", "REPLICA", "MOST_BODY_BYTES"]

REPLICA = web.AppKey("replica", Replica)
MOST_BODY_BYTES = 64 << 20
"""Largest request body."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, code: str, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, "code": code, **extra}, status=status)


def _authorise(request: web.Request) -> None:
    s = request.app[REPLICA].settings
    token = s.serve_token or s.job_token
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise _HttpError(401, "unauthorized", "missing bearer token (Authorization: Bearer <the serving token>)")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise _HttpError(401, "unauthorized", "wrong serving token")


class _HttpError(Exception):
    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra


def _job(request: web.Request) -> Replica:
    replica = request.app[REPLICA]
    name = request.match_info.get("model", replica.settings.job)
    if name != replica.settings.job:
        raise _HttpError(404, "unknown_model",
                         f"this replica serves model {replica.settings.job!r}, not {name[:100]!r}")
    return replica


def _serving(replica: Replica) -> None:
    if replica.state is None:
        raise _HttpError(503, "not_ready", replica.failure or "the replica is loading its first state")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    route = request.match_info.route.name or "other"
    started = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except _HttpError as exc:
        status = exc.status
        return _error(exc.status, exc.code, str(exc), **exc.extra)
    except ProtocolError as exc:
        status = 400
        return web.json_response(error_body(exc), status=400)
    except PlaneUnavailable as exc:
        status = 503
        return _error(503, "redis_unavailable", str(exc))
    except web.HTTPException as exc:
        status = exc.status
        if exc.status == 413:
            return _error(413, "too_large", f"the body is over {MOST_BODY_BYTES} bytes")
        raise
    finally:
        if route in ("infer", "infer_version", "predict"):
            replica = request.app[REPLICA]
            took = time.perf_counter() - started
            replica.metrics.requests.labels(route, str(status)).inc()
            replica.metrics.latency.labels(route).observe(took)
            replica.observe_request(took)


async def live(request: web.Request) -> web.Response:
    """``GET /v2/health/live``: the process answers."""
    return web.json_response({"live": True})


def _ready_body(replica: Replica) -> dict[str, Any]:
    state = replica.state
    stale = replica.staleness_s
    return {"ready": replica.ready, "model_version": state.version if state else None,
            "staleness_s": None if stale is None else round(stale, 3),
            "max_staleness_s": replica.settings.max_staleness_s, "error": replica.failure or replica.last_error}


async def ready(request: web.Request) -> web.Response:
    """``GET /v2/health/ready`` (and ``/v2/models/<job>/ready``): 200 while ready, 503 otherwise."""
    replica = _job(request)
    return web.json_response(_ready_body(replica), status=200 if replica.ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    """``GET /v2``: the server's name and extensions."""
    return web.json_response({"name": "streamtrain", "version": "1", "extensions": ["binary_tensor_data"]})


async def metadata(request: web.Request) -> web.Response:
    """``GET /v2/models/<job>``: inputs, outputs, the served version."""
    _authorise(request)
    replica = _job(request)
    state = replica.state
    return web.json_response(model_metadata(replica.signature, versions=[state.version] if state else []))


async def _infer(request: web.Request, pinned: str | None) -> web.Response:
    _authorise(request)
    replica = _job(request)
    _serving(replica)
    body = await request.read()
    batch, ask = parse_infer(body, replica.signature,
                             header_length=request.headers.get("Inference-Header-Content-Length"))
    state = replica.state
    if pinned is not None and state is not None and pinned != state.version:
        raise _HttpError(404, "version_unavailable", f"this replica serves version {state.version}, not "
                                                     f"{pinned[:100]!r}", current=state.version)
    got = await replica.predict(batch)
    if pinned is not None and got.version != pinned:
        raise _HttpError(404, "version_unavailable", f"the served version moved to {got.version} while "
                                                     f"answering; ask {got.version} or no version",
                         current=got.version)
    answer, headers = infer_response(replica.signature, ask, got.outputs, model_version=got.version,
                                     parameters={"misses": got.misses,
                                                 "staleness_s": round(replica.staleness_s or 0.0, 3)})
    return web.Response(body=answer, headers=headers)


async def infer(request: web.Request) -> web.Response:
    """``POST /v2/models/<job>/infer``: scores of the request's records."""
    return await _infer(request, None)


async def infer_version(request: web.Request) -> web.Response:
    """``POST /v2/models/<job>/versions/<version>/infer``: only from that version (404 otherwise)."""
    return await _infer(request, request.match_info["version"])


async def predict(request: web.Request) -> web.Response:
    """``POST /v1/predict``: the training topic's JSON records in, one result per record out."""
    _authorise(request)
    replica = request.app[REPLICA]
    _serving(replica)
    batch = parse_records(await request.read(), replica.signature)
    got = await replica.predict(batch)
    if batch.labels is not None:
        replica.observe_labels(batch.labels, got.outputs)
    columns = {name: values.tolist() for name, values in got.outputs.items()}
    rows = [{name: col[i] for name, col in columns.items()} for i in range(batch.n)]
    return web.json_response({"model_version": got.version, "predictions": rows, "misses": got.misses})


async def status(request: web.Request) -> web.Response:
    """``GET /v1/replica``: what the replica serves (version, position, rows, staleness, counters)."""
    _authorise(request)
    replica = request.app[REPLICA]
    state = replica.state
    body = _ready_body(replica)
    if state is not None:
        raw = sum(s.rows * (8 + s.dim * 4) for s in state.tables.values())
        body.update({
            "feed_position": state.position, "dense_version": state.dense_version, "rows": state.rows,
            "loaded_from": state.source, "loaded_rows": sum(state.loaded.values()),
            "tables": {name: {"rows": s.rows, "dim": s.dim, "max_rows": s.max_rows, "evictions": s.evictions}
                       for name, s in state.tables.items()},
            "row_bytes": state.nbytes, "bytes_per_raw_row": (state.nbytes / raw) if raw else None,
            "misses": state.misses})
    body.update({"job": replica.settings.job, "model": replica.settings.model, "reloads": replica.reloads,
                 "requests": replica.requests, "records": replica.records, "labelled": replica.scores.seen,
                 "served_auc": await replica.served_auc(), **await replica.served_calibration()})
    return web.json_response(body)


async def state_dump(request: web.Request) -> web.Response:
    """``GET /v1/replica/state``: every row held and the dense tensors, as safetensors (for checks)."""
    _authorise(request)
    replica = request.app[REPLICA]
    _serving(replica)
    state = replica.state
    assert state is not None
    tensors: dict[str, np.ndarray] = {}
    for name, store in state.tables.items():
        ids, values, versions = store.items()
        tensors.update({f"{name}.ids": ids, f"{name}.values": values, f"{name}.versions": versions})
    for key, tensor in state.module.state_dict().items():
        tensors[f"dense.{key}"] = tensor.detach().numpy().copy()
    body = save_safetensors(tensors, metadata={"streamtrain.version": state.version,
                                               "streamtrain.feed.position": state.position,
                                               "streamtrain.dense_version": state.dense_version})
    return web.Response(body=body, content_type="application/octet-stream")


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus exposition."""
    replica = request.app[REPLICA]
    replica.publish()  # the gauges as of this scrape
    return web.Response(body=generate_latest(replica.metrics.registry),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_app(settings: ServeSettings, *, replica: Replica | None = None) -> web.Application:
    """The replica's application (starts following on startup, stops on cleanup).

    Raises:
        ValueError: no token to authorise the model routes with, or the model spec is unusable.
    """
    if not (settings.serve_token or settings.job_token):
        raise ValueError("the replica needs a token for its model routes: set --job-token "
                         "(STREAMTRAIN_JOB_TOKEN) or --serve-token (STREAMTRAIN_SERVE_TOKEN)")
    app = web.Application(middlewares=[_errors], client_max_size=MOST_BODY_BYTES)
    app[REPLICA] = replica if replica is not None else Replica(settings)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await app[REPLICA].start()
        try:
            yield
        finally:
            await app[REPLICA].close()

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    r.add_get("/v2", server_metadata, name="server")
    r.add_get("/v2/health/live", live, name="live")
    r.add_get("/v2/health/ready", ready, name="ready")
    r.add_get("/v2/models/{model}", metadata, name="metadata")
    r.add_get("/v2/models/{model}/ready", ready, name="model_ready")
    r.add_post("/v2/models/{model}/infer", infer, name="infer")
    r.add_post("/v2/models/{model}/versions/{version}/infer", infer_version, name="infer_version")
    r.add_post("/v1/predict", predict, name="predict")
    r.add_get("/v1/replica", status, name="status")
    r.add_get("/v1/replica/state", state_dump, name="state")
    r.add_get("/metrics", metrics, name="metrics")
    return app
