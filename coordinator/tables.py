"""The job's embedding tables as the coordinator shows them: rows, bytes and the servers' counters.

Each table's figures are sums over the shard groups: ``HLEN`` of its rows hash, Redis's sampled
``MEMORY USAGE`` estimate and the groups' counters, the names from the model's meta. The views are pure;
:class:`TableReader`, the thin I/O shell the sampler and ``/v1/status`` share, reads every group in one
pipeline. See docs/dashboard.md, *Embedding tables*.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from common.keys import JobKeys
from services.slot_types import MetaHead

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from redis.asyncio.client import Pipeline

logger = logging.getLogger(__name__)

__all__ = ["COUNTERS", "BYTES_SAMPLES", "TableTotals", "TableReader", "table_names", "table_totals",
           "tables_view", "mean_hit_rate"]

COUNTERS = ("admitted", "dropped", "expired", "evicted")
"""The counters of a table in each group's ``table_stats`` (``<table>:<counter>``), in the order shown."""

BYTES_SAMPLES = 5
"""Fields ``MEMORY USAGE`` samples per rows hash to estimate its bytes."""


@dataclass(frozen=True)
class TableTotals:
    """One embedding table, summed over the shard groups."""

    rows: int = 0
    """Rows held (admitted and not yet expired or evicted)."""
    bytes: int = 0
    """Redis memory of the rows hashes (``MEMORY USAGE`` estimate, :data:`BYTES_SAMPLES` fields sampled)."""
    admitted: int = 0
    """Rows born so far (an ID reached the table's ``admit_after``)."""
    dropped: int = 0
    """Gradient rows of IDs not admitted yet, dropped and counted."""
    expired: int = 0
    """Rows removed after going unwritten for the table's ``expire_after_s``."""
    evicted: int = 0
    """Rows evicted beyond the table's ``max_rows``."""


def table_names(raw_meta: bytes | str | None) -> tuple[str, ...]:
    """The names of the model's embedding tables, in declaration order, from its stored meta JSON
    (``JobKeys.meta``); empty for a dense model, before the model exists (``None``), or for a meta
    that is not the JSON object expected (logged)."""
    if raw_meta is None:
        return ()
    try:
        return MetaHead.parse(raw_meta).tables
    except ValueError as exc:
        logger.warning("model meta unreadable, no tables shown: %r", exc)
        return ()


def _int(value: Any) -> int:
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def table_totals(replies: Sequence[Any], groups: int, names: Sequence[str]) -> dict[str, TableTotals]:
    """Each table's :class:`TableTotals` from the replies of :meth:`TableReader.queue` (per group:
    ``HGETALL table_stats``, then ``HLEN`` and ``MEMORY USAGE`` of each table's rows hash), in the
    order of ``names``. A missing key counts 0 (a group that holds no row yet).

    Raises:
        ValueError: ``replies`` is not as long as the reads queued for ``groups`` and ``names``.
    """
    per_group = 1 + 2 * len(names)
    if len(replies) != groups * per_group:
        raise ValueError(f"expected {groups * per_group} replies for {groups} groups and {len(names)} tables, "
                         f"got {len(replies)}")
    sums = {name: dict.fromkeys(("rows", "bytes", *COUNTERS), 0) for name in names}
    for g in range(groups):
        stats, *sizes = replies[g * per_group:(g + 1) * per_group]
        counters = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in (stats or {}).items()}
        for i, name in enumerate(names):
            s = sums[name]
            s["rows"] += _int(sizes[2 * i])
            s["bytes"] += _int(sizes[2 * i + 1])
            for c in COUNTERS:
                s[c] += _int(counters.get(f"{name}:{c}"))
    return {name: TableTotals(**s) for name, s in sums.items()}


def mean_hit_rate(member_stats: Mapping[str, Mapping[str, Any]]) -> float | None:
    """The mean of the ``row_cache_hit_rate`` the live members' last heartbeats report (each trainer's
    hits over lookups of its row cache over its last heartbeat window); None when none reports one
    (a dense model, or no lookup in the window)."""
    rates = [v for s in member_stats.values()
             if isinstance(v := s.get("row_cache_hit_rate"), (int, float)) and not isinstance(v, bool)
             and math.isfinite(v)]
    return sum(rates) / len(rates) if rates else None


def tables_view(totals: Mapping[str, TableTotals], member_stats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """JSON of ``/v1/status``'s ``tables``: ``row_cache_hit_rate`` (:func:`mean_hit_rate`) and
    ``per_table``, a list in the model's order of ``{"name", "rows", "bytes", "admitted", "dropped",
    "expired", "evicted"}`` (empty for a dense model)."""
    return {"row_cache_hit_rate": mean_hit_rate(member_stats),
            "per_table": [{"name": name, **asdict(t)} for name, t in totals.items()]}


class TableReader:
    """Reads the tables of one job: the names from the model's meta (read until the model exists,
    then kept while it does), and :class:`TableTotals` per table.

    Args:
        keys: the job's keys.
    """

    def __init__(self, keys: JobKeys) -> None:
        self._keys = keys
        self._names: tuple[str, ...] | None = None

    async def names(self, redis: aioredis.Redis, *, model_exists: bool) -> tuple[str, ...]:
        """The model's table names: read from its meta the first time the model exists (a
        ``GET`` of the meta, which is written once, last, when the model is made), then kept;
        forgotten when ``model_exists`` is False (the job's model was removed)."""
        if not model_exists:
            self._names = None
            return ()
        if self._names is None:
            raw = await redis.get(self._keys.meta)
            if raw is None:
                return ()  # the groups exist, the meta comes last: read it again next time
            self._names = table_names(raw)
        return self._names

    def queue(self, pipe: Pipeline, groups: int, names: Sequence[str]) -> None:
        """Queue on ``pipe`` (non-transactional: the groups are in their own slots) the reads of
        ``groups`` shard groups that :func:`table_totals` sums."""
        for g in range(groups):
            gk = self._keys.group(g)
            pipe.hgetall(gk.table_stats)
            for name in names:
                pipe.hlen(gk.table_rows(name))
                pipe.memory_usage(gk.table_rows(name), samples=BYTES_SAMPLES)

    async def read(self, redis: aioredis.Redis, groups: int, *, model_exists: bool) -> dict[str, TableTotals]:
        """Each table's :class:`TableTotals` over ``groups`` shard groups (its model's count,
        ``coordinator.state.Store.groups``), in one pipelined round trip; empty for a dense model
        or before the model exists."""
        names = await self.names(redis, model_exists=model_exists)
        if not names:
            return {}
        pipe = redis.pipeline(transaction=False)
        self.queue(pipe, groups, names)
        return table_totals(await pipe.execute(), groups, names)
