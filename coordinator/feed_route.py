"""``GET /v1/model/updates`` (the feed of row changes) and ``GET /v1/embeddings/<table>`` (rows by ID):
what a serving system needs of the embedding tables, beside ``GET /v1/model``'s dense part.

The feed answers the changes since a feed position as safetensors (``services.tables.feed``); the lookup
answers rows as they are now, as JSON. Both take the job or admin token and run on a thread of their own
(not ``/v1/model``'s, so a large export does not hold the feed up), importing the parameter plane on the
first request only. See docs/serving.md, *Following the tables row by row* and *Looking rows up*.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import redis
from aiohttp import web

from services.slot_types import VersionVector

from .model_route import ModelExport, authorise_model_reader, plane_refusals, reader_context
from .routes import ApiError
from .runtime import SETTINGS

logger = logging.getLogger(__name__)

__all__ = ["setup_feed_routes", "get_updates", "get_rows", "FEED_READER", "MOST_LIMIT", "MOST_IDS"]

FEED_READER = web.AppKey("feed_reader", ModelExport)
"""The app's reader of the feed and the rows: a synchronous client and one thread of its own."""
MOST_LIMIT = 10000
"""Largest ``?limit=`` (entries per group)."""
MOST_IDS = 4000
"""Most IDs one lookup asks (8000 characters of ``?ids=``, the OpenAPI file's ``maxLength``)."""
_MAX_QUERY_CHARS = 8000
_ID = re.compile(r"-?[0-9]{1,18}|[0-9]{19}")


def _query(request: web.Request, allowed: frozenset[str], where: str) -> dict[str, str]:
    """Each parameter of ``allowed`` given (once, at most 8000 characters); 400 ``invalid_query`` for an
    unknown or repeated one."""
    unknown = sorted(set(request.query) - allowed)
    if unknown:
        raise ApiError(400, "invalid_query", f"unknown query parameter {unknown[0]!r}: {where} takes only "
                                             f"{', '.join(repr(a) for a in sorted(allowed))}")
    out = {}
    for name in allowed:
        values = request.query.getall(name, [])
        if len(values) > 1:
            raise ApiError(400, "invalid_query", f"{name} must be given once, got {len(values)}")
        if values:
            if len(values[0]) > _MAX_QUERY_CHARS:
                raise ApiError(400, "invalid_query", f"{name}: at most {_MAX_QUERY_CHARS} characters, "
                                                     f"got {len(values[0])}")
            out[name] = values[0]
    return out


@plane_refusals
def _updates(client: redis.Redis, job: str, since_text: str, limit: int, with_dense: bool
             ) -> tuple[bytes, str, str, str, int, bool]:
    """(body, position reached, heads, versions, entries, dense changed) of the changes since ``since_text``
    (the dense tensors in the body when they changed and ``with_dense``)."""
    from services.slots import read_meta
    from services.snapshot.export import ExportError, snapshot
    from services.tables.feed import (
        FeedAheadError,
        changes_to_safetensors,
        feed_heads,
        read_changes,
    )
    meta = read_meta(client, job)
    try:
        since = VersionVector.parse(since_text, meta.groups, kind="position")
    except ValueError as exc:  # a position's form, of a job with another number of groups
        heads = feed_heads(client, job, meta.groups)
        raise FeedAheadError(f"job {job} has no feed position {since_text!r}: {exc}", head=heads) from None
    changes = read_changes(client, job, meta.tables, since, limit=limit)
    dense = dense_version = None
    if changes.dense and with_dense:  # as of the rows' versions: one state, rows and dense alike
        try:
            dense_version, tensors = snapshot(client, job, changes.version)
        except ExportError:  # no longer retained (a restore in between): the newest, named as such
            dense_version, tensors = snapshot(client, job)
        dense = {name: t.numpy() for name, t in tensors.items()}
    body = changes_to_safetensors(changes, job=job, dense=dense, dense_version=dense_version)
    position, head, version = (VersionVector(v).name() for v in (changes.position, changes.head, changes.version))
    return body, position, head, version, int(changes.applied_ms.size), changes.dense


async def get_updates(request: web.Request) -> web.Response:
    """The changes since ``?since=`` as safetensors, with the position reached."""
    settings = request.app[SETTINGS]
    authorise_model_reader(request)
    from_query = _query(request, frozenset({"since", "limit", "dense"}), "/v1/model/updates")
    since = from_query.get("since")
    if since is None:
        raise ApiError(400, "invalid_query", "since is required: the feed position the copy holds ('0' per shard "
                                             "group, joined by '.': from the start)")
    if not VersionVector.is_name(since):
        raise ApiError(400, "invalid_query", f"since must be a feed position (non-negative integers of at most 18 "
                                             f"digits joined by '.', one per shard group), got {since[:100]!r}")
    from services.tables.feed import FEED_LIMIT
    limit = FEED_LIMIT
    if "limit" in from_query:
        raw = from_query["limit"]
        if not re.fullmatch(r"[0-9]{1,9}", raw) or not 1 <= int(raw) <= MOST_LIMIT:
            raise ApiError(400, "invalid_query", f"limit must be an integer from 1 to {MOST_LIMIT} (entries per "
                                                 f"shard group), got {raw[:100]!r}")
        limit = int(raw)
    with_dense = from_query.get("dense", "1")
    if with_dense not in ("0", "1"):
        raise ApiError(400, "invalid_query", f"dense must be 1 (the dense tensors when they changed, the default) "
                                             f"or 0 (never: follow them with /v1/model), got {with_dense[:100]!r}")
    body, position, head, version, entries, dense = await request.app[FEED_READER].call(
        _updates, settings.job, since, limit, with_dense == "1")
    logger.debug("feed job=%s since=%s position=%s head=%s entries=%d bytes=%d", settings.job, since, position, head,
                 entries, len(body))
    return web.Response(body=body, content_type="application/octet-stream", headers={
        "X-Feed-Position": position, "X-Feed-Head": head, "X-Model-Version": version,
        "X-Dense-Changed": "1" if dense else "0", "Cache-Control": "no-store"})


@plane_refusals
def _rows(client: redis.Redis, job: str, table: str, ids: list[int]) -> dict[str, Any]:
    import numpy as np

    from services.slots import read_meta
    from services.tables.store import pull_rows
    meta = read_meta(client, job)
    specs = {t.name: t for t in meta.tables}
    if table not in specs:
        raise ApiError(404, "unknown_table", f"job {job} has no embedding table {table!r} "
                                             f"(tables: {', '.join(sorted(specs)) or 'none'})")
    wanted = np.array(ids, dtype=np.uint64).view(np.int64)
    pull = pull_rows(client, job, {table: specs[table]}, meta.groups, {table: wanted})
    got = pull.tables[table]
    return {"table": table, "dim": specs[table].dim, "ids": got.ids.tolist(), "values": got.values.tolist(),
            "stored": got.present.tolist(), "versions": got.versions.tolist(),
            "group_versions": {str(g): v for g, v in sorted(pull.group_versions.items())}}


async def get_rows(request: web.Request) -> web.Response:
    """Rows of a table by ID, as they are now (JSON)."""
    settings = request.app[SETTINGS]
    authorise_model_reader(request)
    table = request.match_info["table"]
    raw = _query(request, frozenset({"ids"}), f"/v1/embeddings/{table}").get("ids")
    if raw is None:
        raise ApiError(400, "invalid_query", "ids is required: the IDs to look up, comma-separated (ids=1,2,3)")
    parts = raw.split(",")
    bad = next((p for p in parts if not _ID.fullmatch(p)), None)
    if bad is not None:
        raise ApiError(400, "invalid_query", f"ids must be 64-bit integers joined by ',' (up to 19 digits; "
                                             f"negative ones up to 18), got {bad[:40]!r}")
    if len(parts) > MOST_IDS:
        raise ApiError(400, "invalid_query", f"at most {MOST_IDS} ids per lookup, got {len(parts)}")
    ids = [int(p) % (1 << 64) for p in parts]  # as 64-bit words: 2**63 and above are the negative int64 IDs
    return web.json_response(await request.app[FEED_READER].call(_rows, settings.job, table, ids),
                             headers={"Cache-Control": "no-store"})


def setup_feed_routes(app: web.Application) -> None:
    """Add ``GET /v1/model/updates`` and ``GET /v1/embeddings/{table}`` (and their thread) to ``app``."""
    app.router.add_get("/v1/model/updates", get_updates)
    app.router.add_get("/v1/embeddings/{table}", get_rows)
    app.cleanup_ctx.append(reader_context(FEED_READER, "coordinator-feed"))
