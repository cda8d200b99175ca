"""The embedding-table part of a server: check an update's gradient rows for this group, step the
rows a batch touches (the math is :mod:`services.tables.apply`'s), and take a step of each bounded
table's sweep (``docs/embeddings.md``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import numpy as np
import redis

from ..errors import BadGradientError
from ..metrics import ServerMetrics
from ..protocol import Update
from ..settings import ServerSettings
from ..store import ModelMeta
from ..tables import RowGrads, TableSpec, decode_row_grads, group_of_ids
from ..tables.apply import RowBatch, TableWrites, kinds
from ..tables.store import load_rows, sweep_rows

__all__ = ["validate_rows", "row_steps", "sweep_tables"]

logger = logging.getLogger(__name__)


def validate_rows(meta: ModelMeta, update: Update, *, group: int, groups: int, max_bytes: int) -> dict[str, RowGrads]:
    """The gradient rows of group ``group``'s rows in ``update``, checked: tables the model has (the
    header's list, which every group checks alike), IDs this group owns.

    Raises:
        BadGradientError, PayloadError: naming what is wrong.
    """
    tables = {t.name: t for t in meta.tables}
    unknown = [t for t in update.tables if t not in tables]
    if unknown:
        raise BadGradientError(f"update from {update.member_id}: gradient rows of table(s) {unknown}, which "
                               f"the model does not have (tables: {sorted(tables)})")
    blob = update.rows.get(group)
    if blob is None:
        return {}
    parts = decode_row_grads(blob, tables, max_bytes=max_bytes,
                             what=f"gradient rows of update {update.log_id} for group {group}")
    out = {}
    for p in parts:
        if p.table not in update.tables:
            raise BadGradientError(f"update {update.log_id}: gradient rows of table {p.table!r}, which its "
                                   f"header does not name")
        foreign = group_of_ids(p.ids, groups) != group
        if foreign.any():
            raise BadGradientError(f"update {update.log_id}: {int(foreign.sum())} gradient row(s) of table "
                                   f"{p.table!r} sent to group {group}, which does not own them")
        out[p.table] = p
    return out


def row_steps(client: redis.Redis, job: str, group: int, meta: ModelMeta, table_steps: Mapping[str, int],
              version: int, updates: Sequence[tuple[Update, Mapping[str, RowGrads]]]) -> list[TableWrites]:
    """Apply the gradient rows of ``updates`` (accepted, in log order) to group ``group``'s rows, at
    group version ``version``: load every row they touch in one round trip, step each update in
    turn (admission included), and return what to write (``services.tables.apply``: tables of one
    kind in one batch). ``table_steps``: each table's step count before them."""
    if not updates:
        return []
    specs = {t.name: t for t in meta.tables}
    named = sorted({t for u, _ in updates for t in u.tables})
    wanted = {t: np.unique(np.concatenate([rows[t].ids for _, rows in updates if t in rows]
                                          or [np.empty(0, np.int64)])) for t in named}
    loaded = load_rows(client, job, group, specs, wanted)
    now_ms = int(time.time() * 1000)
    writes = []
    for kind in kinds([specs[t] for t in named]):
        batch = RowBatch.load(kind, loaded, table_steps)
        batch.apply([(u.tables, rows) for u, rows in updates], now_ms)
        writes += batch.writes(version + 1)
    return writes


def sweep_tables(client: redis.Redis, settings: ServerSettings, tables: Sequence[TableSpec],
                 cursors: dict[str, tuple[str, str]], metrics: ServerMetrics) -> tuple[int, int]:
    """One step of each bounded table's sweep (``services.tables.store.sweep_rows``) in the group of
    ``settings``: rows not written for the table's expiry time go, and beyond its row cap the least
    recently written are evicted. ``cursors``: table -> where its scans of the rows and seen hashes go
    on (updated). Returns (rows expired, rows evicted)."""
    expired = evicted = 0
    now_ms = int(time.time() * 1000)
    for spec in tables:
        if not spec.expire_after_s and not spec.max_rows:
            continue
        cursor, seen_cursor = cursors.get(spec.name, ("0", "0"))
        done = sweep_rows(client, settings.job, settings.group, spec, settings.groups, now_ms=now_ms,
                          cursor=cursor, seen_cursor=seen_cursor, count=settings.table_sweep_count,
                          feed_entries=settings.feed_entries)
        cursors[spec.name] = (done.cursor, done.seen_cursor)
        metrics.table_rows("expired", spec.name, done.expired)
        metrics.table_rows("evicted", spec.name, done.evicted)
        expired, evicted = expired + done.expired, evicted + done.evicted
        if done.expired or done.evicted:
            logger.debug("ps job=%s group=%d: table %s: %d row(s) expired, %d evicted, %d left", settings.job,
                         settings.group, spec.name, done.expired, done.evicted, done.rows)
    return expired, evicted
