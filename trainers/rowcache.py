"""A trainer's bounded cache of embedding rows, with how stale each may be (pure; no I/O).

A trainer never holds a table: :class:`RowCache` keeps the most recently used rows of its batches, up to
a number fixed at start, each with the two clocks its table's bound (:class:`TableBound`) is written in:
``covers`` for BSP and SSP, this trainer's ``clock`` at the pull for ASP. Eviction and lookups are
vectorised, none per ID in Python. See docs/embeddings.md, *Consistency per part (PERSIA's hybrid)* and
*The trainer's row cache*.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from services.tables import TableSpec

__all__ = ["RowCache", "CacheStats", "TableBound"]


@dataclass(frozen=True)
class TableBound:
    """How stale a table's rows may be (its consistency part)."""

    mode: str
    """``bsp``, ``ssp`` or ``asp``."""
    staleness: int
    """``S``: the SSP bound, or under ASP the most steps a cached row is used after its pull."""

    def __post_init__(self) -> None:
        if self.mode not in ("bsp", "ssp", "asp"):
            raise ValueError(f"table consistency must be bsp, ssp or asp, got {self.mode!r}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"table staleness must be an int >= 0, got {self.staleness!r}")


@dataclass(frozen=True)
class CacheStats:
    """Lookups since the cache was made."""

    hits: int
    misses: int
    rows: int
    """Rows held now."""

    @property
    def hit_rate(self) -> float | None:
        """Hits over lookups (None before the first)."""
        total = self.hits + self.misses
        return self.hits / total if total else None


class _TableCache:
    """One table's rows: a sorted array of the cached IDs with each one's slot (found with
    ``np.searchsorted``, filled with ``np.insert``: vectorised, no Python work per ID), and arrays
    indexed by slot."""

    def __init__(self, dim: int, capacity: int) -> None:
        self.capacity = capacity
        self.keys = np.empty(0, dtype=np.int64)
        """The IDs held, sorted."""
        self.key_slot = np.empty(0, dtype=np.int64)
        """The slot of each of :attr:`keys`."""
        # filled at once (np.zeros' pages would be taken as rows arrive): the cache's memory is all
        # the trainer's from its start, whatever the tables hold
        self.ids = np.full(capacity, 0, dtype=np.int64)
        self.values = np.full((capacity, dim), 0.0, dtype=np.float32)
        self.covers = np.full(capacity, 0, dtype=np.int64)
        self.clock = np.full(capacity, 0, dtype=np.int64)
        self.as_of = np.full(capacity, -1, dtype=np.int64)
        """The group version each row was read as of (-1: not known)."""
        self.used = np.full(capacity, -1, dtype=np.int64)
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.nfree = capacity

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each of ``ids``, -1 where it is not held."""
        if not self.keys.size:
            return np.full(ids.size, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.keys, ids), self.keys.size - 1)
        return np.where(self.keys[pos] == ids, self.key_slot[pos], -1)

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Hold ``ids`` (unique, none held yet) in ``slots``."""
        if ids.size > 1 and not (ids[1:] > ids[:-1]).all():
            order = np.argsort(ids)
            ids, slots = ids[order], slots[order]
        at = np.searchsorted(self.keys, ids)
        self.keys = np.insert(self.keys, at, ids)
        self.key_slot = np.insert(self.key_slot, at, slots)

    def take(self, n: int) -> np.ndarray:
        """``n`` free slots (the caller makes sure there are)."""
        self.nfree -= n
        return self.free[self.nfree:self.nfree + n].copy()

    def evict(self, need: int, step: int) -> None:
        live = np.flatnonzero((self.used >= 0) & (self.used < step))  # never a row of this step
        count = min(max(need - self.nfree, self.capacity // 4), live.size)
        if count <= 0:
            return
        oldest = live[np.argpartition(self.used[live], count - 1)[:count]] if count < live.size else live
        gone = np.zeros(self.capacity, dtype=bool)
        gone[oldest] = True
        keep = ~gone[self.key_slot]
        self.keys, self.key_slot = self.keys[keep], self.key_slot[keep]
        self.used[oldest] = -1
        self.free[self.nfree:self.nfree + oldest.size] = oldest
        self.nfree += oldest.size

    def clear(self) -> None:
        self.keys = np.empty(0, dtype=np.int64)
        self.key_slot = np.empty(0, dtype=np.int64)
        self.used[:] = -1
        self.free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
        self.nfree = self.capacity


class RowCache:
    """Rows of ``tables``, at most ``capacity`` rows per table."""

    def __init__(self, tables: Mapping[str, TableSpec], capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"row cache capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._tables = {name: _TableCache(spec.dim, capacity) for name, spec in tables.items()} if capacity else {}
        self._hits = self._misses = 0
        self.epoch = 0
        """Bumped by every :meth:`clear`: rows fetched ahead under an earlier epoch are dropped, not merged."""

    def holds(self, table: str, ids: np.ndarray, *, at: np.ndarray, bound: TableBound) -> np.ndarray:
        """Which of ``ids`` the cache could serve at the clocks ``at`` (one per ID) under ``bound``, as
        :meth:`lookup` would; counts nothing and changes nothing (what rows to fetch ahead)."""
        t = self._tables.get(table)
        if t is None:
            return np.zeros(ids.size, dtype=bool)
        slots = t.find(ids)
        hit = slots >= 0
        s, when = slots[hit], at[hit]
        if bound.mode == "asp":
            hit[hit] = t.clock[s] >= when - bound.staleness
        else:
            hit[hit] = t.covers[s] >= when - (0 if bound.mode == "bsp" else bound.staleness) - 1
        return hit

    def lookup(self, table: str, ids: np.ndarray, *, clock: int, bound: TableBound,
               required: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``ids`` (unique) the cache may serve at ``clock``, and their values.

        ``required``: under BSP/SSP, the applied clock the rows must cover (``c - S - 1``).

        Returns:
            (bool mask of hits, ``[hits, dim]`` float32 values of the hits in ``ids`` order).
        """
        t = self._tables.get(table)
        if t is None:
            self._misses += ids.size
            return np.zeros(ids.size, dtype=bool), np.zeros((0, 0), dtype=np.float32)
        slots = t.find(ids)
        hit = slots >= 0
        s = slots[hit]
        if bound.mode == "asp":
            fresh = t.clock[s] >= clock - bound.staleness
        else:
            fresh = t.covers[s] >= (required if required is not None else clock)
        hit[hit] = fresh
        s = s[fresh]
        t.used[s] = clock
        self._hits += int(s.size)
        self._misses += ids.size - int(s.size)
        return hit, t.values[s]

    def insert(self, table: str, ids: np.ndarray, values: np.ndarray, *, clock: int, covers: int,
               as_of: np.ndarray | None = None, used: int | None = None) -> None:
        """Keep the rows of ``ids`` (unique), pulled at ``clock`` after a wait that observed ``covers``.

        ``as_of``: the group version each row was read as of (``RowPull.group_versions`` of its group).
        With it, an older read never replaces a newer one: a row held as of a later version stays, and a
        row replaced by a read at least as new keeps the larger of the two reads' clocks and covers (the
        newer read holds all the older one did). ``used``: the step the rows count as used at (rows
        fetched ahead are merged at a later step than they were read at; default ``clock``).
        """
        t = self._tables.get(table)
        if t is None or ids.size == 0:
            return
        used = clock if used is None else used
        slots = t.find(ids)
        held = slots >= 0
        clocks = np.full(ids.size, clock, dtype=np.int64)
        covered = np.full(ids.size, covers, dtype=np.int64)
        if as_of is not None and held.any():
            h = slots[held]
            older = t.as_of[h] > as_of[held]
            if older.any():  # keep the newer read held: drop these from the insert
                keep = np.ones(ids.size, dtype=bool)
                keep[np.flatnonzero(held)[older]] = False
                ids, values, as_of, slots = ids[keep], values[keep], as_of[keep], slots[keep]
                clocks, covered, held = clocks[keep], covered[keep], held[keep]
                h = slots[held]
            clocks[held] = np.maximum(clocks[held], t.clock[h])
            covered[held] = np.maximum(covered[held], t.covers[h])
        new = ~held
        need = int(new.sum())
        if need > t.nfree:
            t.evict(need, used)
        take = min(need, t.nfree)
        if take < need:  # more new rows in one step than the cache holds: keep the first ones
            keep = np.flatnonzero(new)[take:]
            new[keep] = False
            slots[keep] = -2
        fresh = t.take(take)
        slots[new] = fresh
        t.add(ids[new], fresh)
        ok = slots >= 0
        s = slots[ok]
        t.ids[s] = ids[ok]
        t.values[s] = values[ok]
        t.covers[s] = covered[ok]
        t.clock[s] = clocks[ok]
        t.as_of[s] = -1 if as_of is None else as_of[ok]
        t.used[s] = np.maximum(t.used[s], used)

    def clear(self) -> None:
        """Forget every row (after an outage, or a resync: nothing cached is trusted)."""
        for t in self._tables.values():
            t.clear()
        self.epoch += 1

    def stats(self) -> CacheStats:
        """Hits and misses so far, and the rows held."""
        return CacheStats(self._hits, self._misses, sum(t.keys.size for t in self._tables.values()))
