"""``GET /v1/model``: the job's model, one consistent version, as a safetensors file.

The bytes come from :mod:`services.snapshot.export` (the same code as ``streamtrain export``), named by
version (``X-Model-Version``, an ETag for ``If-None-Match``, ``?version=`` while Redis can rebuild it),
built on a thread of its own so that neither the event loop nor the Kafka probe waits for an export.
See docs/serving.md, *`GET /v1/model`* and *Version names*.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from aiohttp import web

from common.redis_client import connect
from services.slot_types import VersionVector

from .routes import ApiError, authenticate
from .runtime import SETTINGS

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["setup_model_route", "get_model", "etag", "MODEL_EXPORT", "ModelExport", "authorise_model_reader",
           "reader_context", "plane_refusals"]

_PARAMS = frozenset({"version"})
_MAX_VERSION_CHARS = 8000
"""Longest ``?version=`` looked at (the OpenAPI file's ``maxLength``): it fits the HTTP server's
8190-byte request line, which refuses a longer one before any handler (400, text/plain). 421 groups
of 18-digit versions, 800 of 9 digits."""


@dataclass
class ModelExport:
    """What ``GET /v1/model`` runs on: a synchronous Redis client and its own thread."""

    client: redis.Redis
    """Synchronous client of the job's Redis (used only on :attr:`executor`)."""
    executor: ThreadPoolExecutor
    """One thread: exports run one at a time, off the event loop."""

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(client, *args)`` on the export thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, self.client, *args)


MODEL_EXPORT = web.AppKey("model_export", ModelExport)
"""The app's :class:`ModelExport` (set while the app runs)."""


def etag(job: str, version: str) -> str:
    """The entity tag of ``job``'s model at the version named ``version`` (a version's content never
    changes)."""
    return f'"{job}-v{version}"'


def _matches(if_none_match: str | None, tag: str) -> bool:
    """Whether an ``If-None-Match`` header names ``tag`` (weak comparison, RFC 9110 13.1.2)."""
    if not if_none_match:
        return False
    for item in if_none_match.split(","):
        item = item.strip()
        if item == "*" or item.removeprefix("W/") == tag:
            return True
    return False


def _requested_version(request: web.Request) -> str | None:
    """``?version=V`` as given (None when absent; its form is checked once the job's number of shard
    groups is known); 400 ``invalid_query`` for an unknown parameter or a repeated one."""
    unknown = sorted(set(request.query) - _PARAMS)
    if unknown:
        raise ApiError(400, "invalid_query", f"unknown query parameter {unknown[0]!r}: /v1/model takes only "
                                             "'version' (a model version; absent: the current one)")
    values = request.query.getall("version", [])
    if not values:
        return None
    if len(values) > 1:
        raise ApiError(400, "invalid_query", f"version must be given once (one model version), "
                                             f"got {'&'.join(values)!r}")
    if len(values[0]) > _MAX_VERSION_CHARS:
        raise ApiError(400, "invalid_query", f"version must be a model version, got {len(values[0])} characters")
    return values[0]


def _json_version(version: tuple[int, ...]) -> int | str:
    """A version in an error's JSON: the integer with one group (as before groups), else its name."""
    return VersionVector(version).json()


def plane_refusals(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` with the parameter plane's refusals turned into API errors: the one translation of the
    routes that read the plane (``/v1/model`` here; the feed and the rows, :mod:`coordinator.feed_route`),
    applied on their reader threads, where the plane is imported.

    =========================  ===  =====================================
    ``NoModelError``           404  ``no_model``
    ``BadVersionError``        400  ``invalid_query``
    ``VersionNotFoundError``   404  ``version_not_found`` (``current``)
    ``VersionGoneError``       410  ``version_gone`` (``oldest``, ``current``)
    ``FeedAheadError``         404  ``position_not_found`` (``current``)
    ``FeedGoneError``          410  ``feed_gone`` (``oldest``, ``current``)
    =========================  ===  =====================================
    """
    @functools.wraps(fn)
    def call(*args: Any) -> T:
        from services.snapshot.export import BadVersionError, NoModelError, VersionGoneError, VersionNotFoundError
        from services.tables.feed import FeedAheadError, FeedGoneError
        try:
            return fn(*args)
        except NoModelError as exc:
            raise ApiError(404, "no_model", str(exc)) from None
        except BadVersionError as exc:
            raise ApiError(400, "invalid_query", str(exc)) from None
        except VersionNotFoundError as exc:
            raise ApiError(404, "version_not_found", str(exc), current=_json_version(exc.current)) from None
        except VersionGoneError as exc:
            raise ApiError(410, "version_gone", str(exc), oldest=_json_version(exc.oldest),
                                current=_json_version(exc.current)) from None
        except FeedAheadError as exc:
            raise ApiError(404, "position_not_found", str(exc), current=VersionVector(exc.head).name()) from None
        except FeedGoneError as exc:
            raise ApiError(410, "feed_gone", str(exc), oldest=VersionVector(exc.oldest).name(),
                                current=VersionVector(exc.head).name()) from None
    return call


@plane_refusals
def _resolve(client: redis.Redis, job: str, requested: str | None) -> tuple[tuple[int, ...] | None, str]:
    """The version ``requested`` names, parsed (None: the current one), and the name of the version
    it resolves to now; cheap: no shards."""
    from services.snapshot.export import BadVersionError, resolve_version, retained
    kept = retained(client, job)
    try:
        want = None if requested is None else VersionVector.parse(requested, len(kept.current), job=job)
    except BadVersionError as exc:
        if VersionVector.is_name(requested):  # a version name, of a job with another number of groups
            raise ApiError(404, "version_not_found", f"job {job} has no version {requested!r}: {exc}",
                                current=_json_version(kept.current)) from None
        raise
    return want, VersionVector(resolve_version(job, want, kept)).name()


@plane_refusals
def _export(client: redis.Redis, job: str, requested: tuple[int, ...] | None) -> tuple[str, bytes]:
    from services.snapshot.export import snapshot, to_safetensors_bytes
    version, tensors = snapshot(client, job, requested)
    return VersionVector(version).name(), to_safetensors_bytes(tensors, job=job, version=version)


async def get_model(request: web.Request) -> web.Response:
    """The job's model (current, or ``?version=N``) as safetensors, with its version and ETag."""
    settings = request.app[SETTINGS]
    authorise_model_reader(request)
    export = request.app[MODEL_EXPORT]
    job = settings.job
    requested, version = await export.call(_resolve, job, _requested_version(request))
    if _matches(request.headers.get("If-None-Match"), etag(job, version)):
        return web.Response(status=304, headers={"ETag": etag(job, version), "X-Model-Version": version,
                                                 "Cache-Control": "no-cache"})
    # the current version may have moved on since: an export of "the current one" returns the newest
    version, body = await export.call(_export, job, requested)
    logger.info("model_export job=%s version=%s bytes=%d requested=%s", job, version, len(body),
                "current" if requested is None else "pinned")
    return web.Response(body=body, content_type="application/octet-stream", headers={
        "ETag": etag(job, version), "X-Model-Version": version, "Cache-Control": "no-cache",
        "Content-Disposition": f'attachment; filename="{job}-v{version}.safetensors"'})


def authorise_model_reader(request: web.Request) -> None:
    """Let the job's token or the admin token through (the model is the job's product, not a public
    view); 401 otherwise."""
    settings = request.app[SETTINGS]
    try:
        authenticate(request, settings.job_token, "job")
    except ApiError:
        authenticate(request, settings.admin_token, "job or admin")


def reader_context(key: web.AppKey[ModelExport], thread_name: str
                   ) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context giving the app, under ``key``, a synchronous Redis client of the job and one
    thread of its own named ``thread_name`` (closed with the app)."""
    async def context(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        client = connect(settings.redis_url, socket_connect_timeout=5.0, socket_timeout=60.0)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        app[key] = ModelExport(client, executor)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)
            client.close()
    return context


def setup_model_route(app: web.Application) -> None:
    """Add ``GET /v1/model`` (and its export thread) to ``app``."""
    app.router.add_get("/v1/model", get_model)
    app.cleanup_ctx.append(reader_context(MODEL_EXPORT, "coordinator-export"))
