"""Rows fetched ahead: the rows of the next batches read while this one computes.

The trainer decodes batches ahead of compute (``--prefetch``), so their IDs are known steps before they
are used. With ``--row-prefetch D``, a step at clock ``c`` hands the next ``D`` batches to
:class:`RowsAhead`, which on a thread of its own reads their rows (deduplicated across the batches and
against what the row cache will still serve validly, :func:`wanted_ahead`) while the step computes. The
next step merges them into the row cache before its lookup (:meth:`RowsAhead.take`); the cache then
serves a row fetched ahead only as its table's bound allows a pulled one (docs/embeddings.md, *Rows
fetched ahead*): under ASP its staleness counts from ``c``, under BSP/SSP its ``covers`` is the lowest
applied clock read before the read. The thread never touches the cache (it is not thread-safe): it
returns the rows with their clocks and group versions, and the step's thread merges them; a clear of
the cache (a resync, an outage) drops a fetch made before it.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import redis

from datastream import Batch
from services.consistency import read_clocks
from services.tables import TableSpec, group_of_ids
from services.tables.store import pull_rows

from .rowcache import RowCache, TableBound
from .tables import sort_pairs

logger = logging.getLogger(__name__)

__all__ = ["Ahead", "AheadRows", "RowsAhead", "ahead_depth", "wanted_ahead"]


@dataclass(frozen=True)
class AheadRows:
    """One table's rows read ahead."""

    ids: np.ndarray
    """Unique IDs, sorted (int64)."""
    values: np.ndarray
    """``[len(ids), dim]`` float32."""
    as_of: np.ndarray
    """int64: the version of its group each row was read as of."""


@dataclass(frozen=True)
class Ahead:
    """A finished fetch ahead."""

    tables: dict[str, AheadRows]
    clock: int
    """The trainer's clock when it was fetched (an ASP row's staleness counts from it)."""
    covers: int
    """The lowest applied clock among the participating live members, read before the rows (BSP/SSP)."""
    epoch: int
    """The row cache's epoch (``RowCache.epoch``) when it started: merged only if it is still the same."""
    wire_bytes: int
    """Bytes the read took from Redis."""

    @property
    def rows(self) -> int:
        """Rows fetched."""
        return sum(t.ids.size for t in self.tables.values())


def ahead_depth(bound: TableBound, depth: int) -> int:
    """How many of the next batches a fetch ahead at clock ``c`` can serve: rows read during step ``c``
    serve at ``c + k`` only for ``k <= S`` under ASP (their staleness counts from ``c``), and under BSP
    and SSP likewise (they cover at most ``c - 1``, this trainer's step ``c`` not pushed yet, and step
    ``c + k`` needs ``c + k - S - 1``): ``min(depth, S)``, 0 under BSP."""
    return 0 if bound.mode == "bsp" else min(depth, bound.staleness)


def wanted_ahead(tables: Mapping[str, TableSpec], batches: Sequence[Batch], cache: RowCache, *, clock: int,
                 bound: TableBound, first: int = 1) -> dict[str, np.ndarray]:
    """The IDs to fetch ahead for ``batches`` (the ``k``-th used at ``clock + k``, ``k`` from ``first``):
    per table, the unique IDs of every feature of every batch, less those the cache will still serve at
    their last use. Tables with none are left out."""
    parts = [(i, k, col.values) for i, spec in enumerate(tables.values()) for k, b in enumerate(batches, start=first)
             for f in spec.features if (col := b.ids.get(f)) is not None and col.values.size]
    if not parts:
        return {}
    sizes = [v.size for _, _, v in parts]
    ids = np.concatenate([v for _, _, v in parts]).astype(np.int64, copy=False)
    number = np.repeat(np.array([i for i, _, _ in parts], dtype=np.int64), sizes)
    order, starts = sort_pairs(number, ids)  # one sort for every table and batch
    runs = np.flatnonzero(starts)
    last = np.maximum.reduceat(np.repeat(np.array([k for _, k, _ in parts], dtype=np.int64), sizes)[order], runs)
    ids, number = ids[order][runs], number[order][runs]  # each table's unique IDs, with their last batch
    bounds = np.searchsorted(number, np.arange(len(tables) + 1))
    names = [name for i, name in enumerate(tables) if bounds[i + 1] > bounds[i]]
    have = {name: ids[bounds[i]:bounds[i + 1]] for i, name in enumerate(tables) if bounds[i + 1] > bounds[i]}
    at = {name: clock + last[bounds[i]:bounds[i + 1]] for i, name in enumerate(tables) if bounds[i + 1] > bounds[i]}
    held = cache.holds_all(have, at, bound=bound)
    out = {name: have[name][~held[name]] for name in names}
    return {name: v for name, v in out.items() if v.size}


class RowsAhead:
    """One fetch ahead at a time, on its own thread, for a trainer of job ``job``.

    Its Redis client is the trainer's: redis-py hands each thread a connection of its own from the
    client's pool (as the dense pull ahead, ``trainers.prefetch``, does)."""

    def __init__(self, client: redis.Redis, job: str, tables: Mapping[str, TableSpec], groups: int,
                 cache: RowCache, depth: int) -> None:
        self._client = client
        self._job = job
        self._tables = dict(tables)
        self._groups = groups
        self._cache = cache
        self.depth = depth
        """Most batches ahead fetched for (``--row-prefetch``)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rows-ahead")
        self._running: concurrent.futures.Future[Ahead] | None = None
        self._covered: list[Batch] = []
        """The batches the fetches so far looked at (of the window before this step's): their rows are
        cached or fetched already, unless a fetch was dropped (then none are counted)."""
        self.started = 0
        """Fetches ahead started."""
        self.merged = 0
        """Fetches ahead merged into the cache."""
        self.rows = 0
        """Rows fetched ahead and merged."""

    def start(self, batches: Sequence[Batch], *, clock: int, bound: TableBound, covers: int,
              member_id: str) -> bool:
        """Begin fetching the rows of ``batches`` (the next ones, in order; at most :func:`ahead_depth`
        of them are looked at) for a step at ``clock``; ``covers``: what the step's wait observed.
        Reads the cache (on the caller's thread), never writes it. False when nothing is wanted or a
        fetch is still in flight (left to finish)."""
        if self._running is not None:
            return False
        window = [b for b in batches[:ahead_depth(bound, self.depth)] if len(b)]
        done = 0  # the window's first batches were in the last one: only the batches after them are new
        while done < len(window) and any(window[done] is b for b in self._covered):
            done += 1
        self._covered = window
        new = window[done:]
        wanted = wanted_ahead(self._tables, new, self._cache, clock=clock, bound=bound, first=done + 1) if new else {}
        if not wanted:
            return False
        self._running = self._pool.submit(self._fetch, wanted, clock, bound, covers, member_id, self._cache.epoch)
        self.started += 1
        return True

    def _fetch(self, wanted: dict[str, np.ndarray], clock: int, bound: TableBound, covers: int, member_id: str,
               epoch: int) -> Ahead:
        if bound.mode != "asp":  # the clocks before the read: what the rows cover at least
            low = read_clocks(self._client, self._job, member_id).low
            covers = low if low is not None else -1
        owners = {name: group_of_ids(ids, self._groups) for name, ids in wanted.items()}
        pulled = pull_rows(self._client, self._job, self._tables, self._groups, wanted, owners=owners)
        versions = np.zeros(self._groups, dtype=np.int64)
        for g, v in pulled.group_versions.items():
            versions[g] = v
        tables = {name: AheadRows(got.ids, got.values, versions[owners[name]]) for name, got in pulled.tables.items()}
        return Ahead(tables, clock, covers, epoch, pulled.wire_bytes)

    def take(self) -> Ahead | None:
        """Wait for the fetch ahead in flight, if any, and merge its rows into the cache (on the caller's
        thread, before its lookup); returns it, or None when there was none, it failed (the step reads
        what it needs itself, and meets the same fault) or the cache was cleared since it started."""
        running, self._running = self._running, None
        if running is None:
            return None
        try:
            ahead = running.result()
        except Exception as exc:  # noqa: BLE001 - the step's own pull meets the same fault and handles it
            logger.debug("rows fetched ahead dropped: %r", exc)
            self._covered = []
            return None
        if ahead.epoch != self._cache.epoch:  # a resync or an outage since: nothing it read is trusted
            self._covered = []
            return None
        return ahead

    def merge(self, ahead: Ahead, clock: int) -> None:
        """Put ``ahead``'s rows into the cache at the step at ``clock`` (never over a newer read)."""
        self._cache.insert_all({name: (got.ids, got.values, got.as_of) for name, got in ahead.tables.items()},
                               clock=ahead.clock, covers=ahead.covers, used=clock)
        self.merged += 1
        self.rows += ahead.rows

    def close(self) -> None:
        """Let the fetch in flight finish (a clock read and one pull) and stop the thread."""
        self._running = None
        self._pool.shutdown(wait=True)
