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


_MIX = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(29)


class _Index:
    """Where each cached (table, ID) is: an open-addressing hash table (linear probing) from the pair to
    its slot, probed for every pair of a call at once, one numpy round per probe step (no Python work
    per ID or per table). Each table has a region of its own (twice its capacity: short probes), so a
    call's probes for one table stay in a small part of memory; each position holds its slot and ID
    side by side (one cache line a probe). A slot's table is ``slot // capacity``."""

    def __init__(self, ids: np.ndarray, capacity: int) -> None:
        region = 8
        while region < 2 * capacity:  # at most half full with every slot held
            region *= 2
        self.region = region
        self.ids = ids
        self.capacity = capacity
        tables = ids.size // capacity
        self.at = np.full((tables * region, 2), -1, dtype=np.int64)
        """Per position: the slot held there (-1 empty, -2 a removed pair: probes go on past it) and its ID."""
        self.slot_at = self.at[:, 0]
        """The slots column of :attr:`at` (a view: a 1-D gather is several times faster than a 2-D one)."""
        self.pos = np.full(ids.size, -1, dtype=np.int64)
        """Each slot's position in :attr:`at` (-1: the slot holds nothing)."""
        self.live = 0
        self.filled = np.zeros(tables, dtype=np.int64)
        """Positions not empty per table's region: held or removed."""

    def _home(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        x = (ids.astype(np.uint64) ^ (tables.astype(np.uint64) * _MIX)) * _MIX
        x ^= x >> _SHIFT
        return (x & np.uint64(self.region - 1)).astype(np.int64)

    def find(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The slot of each (table, ID) pair, -1 where it is not held."""
        out = np.full(ids.size, -1, dtype=np.int64)
        if not self.live:
            return out
        base, h = tables * self.region, self._home(tables, ids)
        e = np.take(self.at, base + h, axis=0)  # both columns of a position at once
        s = e[:, 0]
        same = (e[:, 1] == ids) & (s >= 0)  # a held slot of another table is in another region
        out[same] = s[same]
        todo = np.flatnonzero((s != -1) & ~same)  # the rest probe on
        base, h = base[todo], (h[todo] + 1) & (self.region - 1)
        while todo.size:
            e = np.take(self.at, base + h, axis=0)
            s = e[:, 0]
            same = (e[:, 1] == ids[todo]) & (s >= 0)  # a held slot of another table is in another region
            out[todo[same]] = s[same]
            go = (s != -1) & ~same
            todo, base, h = todo[go], base[go], (h[go] + 1) & (self.region - 1)
        return out

    def add(self, tables: np.ndarray, ids: np.ndarray, slots: np.ndarray) -> None:
        """Hold the pairs (none held yet, no two alike) in ``slots``."""
        count = np.bincount(tables, minlength=self.filled.size)
        for t in np.flatnonzero(self.filled + count > 3 * self.region // 4):  # too many removed: place anew
            lo = int(t) * self.capacity
            held = lo + np.flatnonzero(self.pos[lo:lo + self.capacity] >= 0)
            self.at[t * self.region:(t + 1) * self.region] = -1
            self.pos[held] = -1
            self.live -= held.size
            self.filled[t] = 0
            self._place(np.full(held.size, t, dtype=np.int64), self.ids[held], held)
        self._place(tables, ids, slots)

    def _place(self, tables: np.ndarray, ids: np.ndarray, slots: np.ndarray) -> None:
        todo, base, h = np.arange(ids.size), tables * self.region, self._home(tables, ids)
        self.live += ids.size
        while todo.size:
            p = base + h
            was = self.slot_at[p]
            free = np.flatnonzero(was < 0)
            pf, sf = p[free], slots[todo[free]]
            self.slot_at[pf] = sf  # pairs probing one free position: the last one written takes it
            won = self.slot_at[pf] == sf
            win, pw = free[won], pf[won]
            empty = was[win] == -1
            self.filled += np.bincount(tables[todo[win]][empty], minlength=self.filled.size)
            self.at[:, 1][pw] = ids[todo[win]]
            self.pos[sf[won]] = pw
            go = np.ones(todo.size, dtype=bool)
            go[win] = False
            todo, base, h = todo[go], base[go], (h[go] + 1) & (self.region - 1)

    def remove(self, slots: np.ndarray) -> None:
        """Forget the pairs held in ``slots``."""
        self.slot_at[self.pos[slots]] = -2
        self.pos[slots] = -1
        self.live -= slots.size

    def clear(self) -> None:
        self.at[:] = -1
        self.pos[:] = -1
        self.live = 0
        self.filled[:] = 0


class RowCache:
    """Rows of ``tables``, at most ``capacity`` rows per table.

    Every table's rows are in one set of arrays indexed by slot (table ``i`` owns slots ``i * capacity``
    up to ``(i + 1) * capacity``; tables of one dimension share one values array), found through one
    :class:`_Index` of (table, ID) pairs: a call for all of a step's tables is one set of numpy calls,
    not one per table. Each table has its own free slots and its own least-recently-used eviction."""

    def __init__(self, tables: Mapping[str, TableSpec], capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"row cache capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        names = sorted(tables, key=lambda name: tables[name].dim) if capacity else []  # by dim: kinds contiguous
        self._number = {name: i for i, name in enumerate(names)}
        n = len(names) * capacity
        # filled at once (np.zeros' pages would be taken as rows arrive): the cache's memory is all
        # the trainer's from its start, whatever the tables hold
        self._ids = np.full(n, 0, dtype=np.int64)
        self._covers = np.full(n, 0, dtype=np.int64)
        self._clock = np.full(n, 0, dtype=np.int64)
        self._as_of = np.full(n, -1, dtype=np.int64)
        """The group version each row was read as of (-1: not known)."""
        self._used = np.full(n, -1, dtype=np.int64)
        self._kinds: list[tuple[int, np.ndarray]] = []
        """Per dimension: its first slot and its tables' values (rows from that slot on)."""
        kind_of = []
        for i, name in enumerate(names):
            dim = tables[name].dim
            if not self._kinds or self._kinds[-1][1].shape[1] != dim:
                count = sum(1 for other in names if tables[other].dim == dim)
                self._kinds.append((i * capacity, np.full((count * capacity, dim), 0.0, dtype=np.float32)))
            kind_of.append(len(self._kinds) - 1)
        self._kind_of = kind_of
        self._free = np.tile(np.arange(capacity - 1, -1, -1, dtype=np.int64), (len(names), 1))
        """Each table's free slots (its own numbering, 0 up to ``capacity``), taken from the end."""
        self._nfree = np.full(len(names), capacity, dtype=np.int64)
        self._index = _Index(self._ids, max(capacity, 1))
        self._hits = self._misses = 0
        self.epoch = 0
        """Bumped by every :meth:`clear`: rows fetched ahead under an earlier epoch are dropped, not merged."""

    def _pairs(self, ids: Mapping[str, np.ndarray]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """The cached tables of ``ids`` in slot order, and their pairs concatenated: (names, table number
        of each, IDs, where each table's part starts and ends)."""
        names = sorted((name for name in ids if name in self._number), key=self._number.__getitem__)
        parts = [np.asarray(ids[name], dtype=np.int64) for name in names]
        bounds = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum([p.size for p in parts], out=bounds[1:])
        tables = np.repeat(np.array([self._number[name] for name in names], dtype=np.int64), np.diff(bounds))
        flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return names, tables, flat, bounds

    def _by_kind(self, names: list[str]) -> list[tuple[int, int, int]]:
        """``names`` (in slot order) in runs of one kind: (kind, first name's position, end)."""
        runs: list[tuple[int, int, int]] = []
        for i, name in enumerate(names):
            k = self._kind_of[self._number[name]]
            if runs and runs[-1][0] == k:
                runs[-1] = (k, runs[-1][1], i + 1)
            else:
                runs.append((k, i, i + 1))
        return runs

    def _fresh(self, slots: np.ndarray, when: np.ndarray | np.int64, bound: TableBound,
               required: np.ndarray | np.int64) -> np.ndarray:
        """Which held ``slots`` serve at the clocks ``when`` under ``bound`` (``required``: the applied
        clock BSP/SSP need covered)."""
        if bound.mode == "asp":
            return self._clock[slots] >= when - bound.staleness
        return self._covers[slots] >= required

    def holds_all(self, ids: Mapping[str, np.ndarray], at: Mapping[str, np.ndarray], *,
                  bound: TableBound) -> dict[str, np.ndarray]:
        """Per table, which of ``ids`` the cache could serve at the clocks ``at`` (one per ID) under
        ``bound``, as :meth:`lookup_all` would; counts nothing and changes nothing (what rows to fetch
        ahead)."""
        out = {name: np.zeros(np.size(v), dtype=bool) for name, v in ids.items() if name not in self._number}
        names, tables, flat, bounds = self._pairs(ids)
        when = np.concatenate([np.asarray(at[name], dtype=np.int64) for name in names]) if names else flat
        slots = self._index.find(tables, flat)
        hit = slots >= 0
        when = when[hit]
        hit[hit] = self._fresh(slots[hit], when, bound, when - (0 if bound.mode == "bsp" else bound.staleness) - 1)
        for i, name in enumerate(names):
            out[name] = hit[bounds[i]:bounds[i + 1]]
        return out

    def holds(self, table: str, ids: np.ndarray, *, at: np.ndarray, bound: TableBound) -> np.ndarray:
        """:meth:`holds_all` for one table."""
        return self.holds_all({table: ids}, {table: at}, bound=bound)[table]

    def lookup_all(self, ids: Mapping[str, np.ndarray], *, clock: int, bound: TableBound,
                   required: int | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per table, which of ``ids`` (unique per table) the cache may serve at ``clock``, and its rows.

        ``required``: under BSP/SSP, the applied clock the rows must cover (``c - S - 1``).

        Returns:
            table -> (bool mask of hits, ``[len(ids), dim]`` float32 rows: the cached row where it hits,
            anything elsewhere, for the caller to fill; ``[len(ids), 0]`` for a table the cache does
            not hold). The rows of one kind of table (one dimension) are views of one array.
        """
        out = {}
        for name, v in ids.items():
            if name not in self._number:
                self._misses += np.size(v)
                out[name] = (np.zeros(np.size(v), dtype=bool), np.empty((np.size(v), 0), dtype=np.float32))
        names, tables, flat, bounds = self._pairs(ids)
        slots = self._index.find(tables, flat)
        hit = slots >= 0
        hit[hit] = self._fresh(slots[hit], np.int64(clock), bound, np.int64(clock if required is None else required))
        s = slots[hit]
        self._used[s] = clock
        self._hits += int(s.size)
        self._misses += flat.size - int(s.size)
        for k, a, b in self._by_kind(names):  # one gather per kind of table (one dimension)
            first, values = self._kinds[k]
            got = np.take(values, np.where(hit[bounds[a]:bounds[b]], slots[bounds[a]:bounds[b]], first) - first, axis=0)
            for i in range(a, b):
                out[names[i]] = (hit[bounds[i]:bounds[i + 1]], got[bounds[i] - bounds[a]:bounds[i + 1] - bounds[a]])
        return out

    def lookup(self, table: str, ids: np.ndarray, *, clock: int, bound: TableBound,
               required: int | None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`lookup_all` for one table, with the values of its hits only (``[hits, dim]``)."""
        hit, rows = self.lookup_all({table: ids}, clock=clock, bound=bound, required=required)[table]
        return hit, rows[hit]

    def insert_all(self, rows: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]], *, clock: int,
                   covers: int, used: int | None = None) -> None:
        """Keep the rows of each table, ``rows``: table -> (IDs unique in it, ``[ids, dim]`` values, the
        group version each row was read as of or None), pulled at ``clock`` after a wait that observed
        ``covers``.

        With the versions, an older read never replaces a newer one: a row held as of a later version
        stays, and a row replaced by a read at least as new keeps the larger of the two reads' clocks
        and covers (the newer read holds all the older one did). ``used``: the step the rows count as
        used at (rows fetched ahead are merged at a later step than they were read at; default
        ``clock``). A table gets at most ``capacity`` rows: when full, its least recently used rows not
        used at this step go (a quarter of it at once); more new rows in one step than it can take:
        the first ones are kept.
        """
        used = clock if used is None else used
        names, tables, flat, bounds = self._pairs({name: r[0] for name, r in rows.items() if len(r[0])})
        if not flat.size:
            return
        values = [np.asarray(rows[name][1], dtype=np.float32) for name in names]
        as_of = np.concatenate([np.full(rows[name][0].size, -1, dtype=np.int64) if rows[name][2] is None
                                else np.asarray(rows[name][2], dtype=np.int64) for name in names])
        slots = self._index.find(tables, flat)
        held = slots >= 0
        clocks = np.full(flat.size, clock, dtype=np.int64)
        covered = np.full(flat.size, covers, dtype=np.int64)
        keep = np.ones(flat.size, dtype=bool)
        versioned = held & np.repeat(np.array([rows[name][2] is not None for name in names]), np.diff(bounds))
        if versioned.any():
            h = slots[versioned]
            keep[versioned] = ~(self._as_of[h] > as_of[versioned])  # a newer read held: this one is dropped
            clocks[versioned] = np.maximum(clocks[versioned], self._clock[h])
            covered[versioned] = np.maximum(covered[versioned], self._covers[h])
        new = ~held
        per_table = np.diff(np.concatenate(([0], np.cumsum(new)))[bounds])
        number = np.array([self._number[name] for name in names], dtype=np.int64)
        for i in np.flatnonzero(per_table > self._nfree[number]):
            part = slots[bounds[i]:bounds[i + 1]]
            self._evict(int(number[i]), int(per_table[i]), used, part[keep[bounds[i]:bounds[i + 1]] & (part >= 0)])
        # each table's new rows take its free slots from the end, the first ones first, while there are
        rank = np.cumsum(new) - 1 - np.repeat(np.concatenate(([0], np.cumsum(per_table)[:-1])), np.diff(bounds))
        take = np.minimum(per_table, self._nfree[number])
        ok_new = new & (rank < np.repeat(take, np.diff(bounds)))
        start = np.repeat(self._nfree[number] - take, np.diff(bounds))
        t_new = tables[ok_new]
        fresh = self._free[t_new, start[ok_new] + rank[ok_new]] + t_new * self.capacity
        self._nfree[number] -= take
        slots[ok_new] = fresh
        self._index.add(t_new, flat[ok_new], fresh)
        ok = keep & (held | ok_new)
        s = slots[ok]
        self._ids[s] = flat[ok]
        self._covers[s] = covered[ok]
        self._clock[s] = clocks[ok]
        self._as_of[s] = as_of[ok]
        self._used[s] = np.maximum(self._used[s], used)
        for k, a, b in self._by_kind(names):  # one write per kind of table (one dimension)
            first, kind = self._kinds[k]
            part = ok[bounds[a]:bounds[b]]
            rows_of = np.dtype((np.void, kind.itemsize * kind.shape[1]))  # a row as one item: a 1-D scatter
            given = np.ascontiguousarray((np.concatenate(values[a:b]) if b - a > 1 else values[a])[part])
            np.put(kind.view(rows_of).ravel(), slots[bounds[a]:bounds[b]][part] - first, given.view(rows_of).ravel())

    def insert(self, table: str, ids: np.ndarray, values: np.ndarray, *, clock: int, covers: int,
               as_of: np.ndarray | None = None, used: int | None = None) -> None:
        """:meth:`insert_all` for one table."""
        self.insert_all({table: (ids, values, as_of)}, clock=clock, covers=covers, used=used)

    def _evict(self, table: int, need: int, step: int, keep: np.ndarray) -> None:
        """Free at least ``need`` slots of table ``table`` if it can: its least recently used rows, none
        used at ``step`` and none of ``keep`` (rows this insert replaces)."""
        lo = table * self.capacity
        used = self._used[lo:lo + self.capacity].copy()
        used[keep - lo] = -1
        live = np.flatnonzero((used >= 0) & (used < step))  # never a row of this step
        nfree = int(self._nfree[table])
        count = min(max(need - nfree, self.capacity // 4), live.size)
        if count <= 0:
            return
        oldest = live[np.argpartition(used[live], count - 1)[:count]] if count < live.size else live
        self._index.remove(oldest + lo)
        self._used[oldest + lo] = -1
        self._free[table, nfree:nfree + oldest.size] = oldest
        self._nfree[table] += oldest.size

    def clear(self) -> None:
        """Forget every row (after an outage, or a resync: nothing cached is trusted)."""
        self._index.clear()
        self._used[:] = -1
        self._free[:] = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
        self._nfree[:] = self.capacity
        self.epoch += 1

    def stats(self) -> CacheStats:
        """Hits and misses so far, and the rows held."""
        return CacheStats(self._hits, self._misses, self._index.live)
