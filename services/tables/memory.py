"""A server's memory of its group's rows (``--row-memory-rows``): the records it last loaded or wrote,
so that a load reads from Redis only the rows it does not hold (``store.load_rows``).

It is valid only while nobody else changed the group's rows: it is anchored at the group's
(version, feed head), which every write of rows moves (an apply bumps the version and appends one
feed entry; a sweep step that removes rows appends one; a restore sets the version and moves the
head). A load reads both first and drops everything when they are not where the memory expects
them; a server's own successful write and own sweep step move the expectation by exactly what they
did, so anything else between (another server, a restore, a sweep of a server that lost its group)
makes the next load start over. Records held are exactly the bytes written, so an apply computes bit
for bit what it would from Redis. Sighting records (IDs not admitted yet) are not held.
See docs/embeddings.md, *Pull, push, apply*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .rows import row_dtype
from .spec import TableSpec
from .writes import TableWrites

__all__ = ["RowMemory"]


@dataclass
class _Table:
    """One table's rows held: records in slots, found through IDs sorted."""

    ids: np.ndarray
    """int64, sorted: the IDs held."""
    slots: np.ndarray
    """int64: the slot of each of :attr:`ids`."""
    records: np.ndarray
    """``row_dtype`` records, one per slot (``capacity`` of them)."""
    used: np.ndarray
    """int64 per slot: the tick it was last loaded or written at (LRU-ish eviction)."""
    free: np.ndarray
    """int64: slots not holding a row."""


class RowMemory:
    """Up to ``rows`` rows per table of one group, valid at :attr:`at` (none: holds nothing)."""

    def __init__(self, rows: int) -> None:
        if rows < 0:
            raise ValueError(f"row memory of {rows} rows per table: 0 (off) or more")
        self.rows = rows
        """Most rows held per table (0: off)."""
        self.at: tuple[int, int] | None = None
        """(group version, feed head) the rows held are as of; None: nothing is valid."""
        self._tables: dict[str, _Table] = {}
        self._tick = 0

    @property
    def enabled(self) -> bool:
        """Whether it holds rows at all (``rows`` > 0)."""
        return self.rows > 0

    def held(self) -> int:
        """Rows held, all tables together."""
        return sum(t.ids.size for t in self._tables.values())

    def clear(self) -> None:
        """Drop everything (a conflict, an error, an outage, a reload)."""
        self._tables.clear()
        self.at = None

    def anchor(self, version: int, feed_head: int) -> bool:
        """The group's (version, feed head) as a load read them (before its rows): keep what is held
        when it is where the memory is, else drop everything and start at them. Returns whether the
        rows held are valid (False when some were dropped or none were held)."""
        if self.at == (version, feed_head):
            return True
        self._tables.clear()
        self.at = (version, feed_head)
        return False

    def lookup(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bool mask of ``ids`` held, their records in order) of ``table``."""
        t = self._tables.get(table)
        if t is None or not t.ids.size or self.at is None:
            return np.zeros(ids.size, dtype=bool), np.zeros(0)
        pos = np.minimum(np.searchsorted(t.ids, ids), t.ids.size - 1)
        hit = t.ids[pos] == ids
        slots = t.slots[pos[hit]]
        t.used[slots] = self._tick
        return hit, t.records[slots]

    def written(self, version_read: int, version: int, specs: Mapping[str, TableSpec],
                writes: Sequence[TableWrites]) -> None:
        """A write whose compare-and-set held at group version ``version_read`` succeeded, leaving the
        group at ``version`` (one feed entry more when it bumped it): hold the rows it wrote, as
        written. Drops everything when the memory is not at ``version_read``."""
        if self.at is None or self.at[0] != version_read or not self.enabled:
            self.clear()
            return
        self._tick += 1
        self.at = (version, self.at[1] + (version != version_read))
        for w in writes:
            if w.row_ids.size:
                self._put(specs[w.table], w.row_ids, np.frombuffer(w.rows, dtype=row_dtype(specs[w.table])))

    def swept(self, table: str) -> None:
        """This server's sweep step removed rows of ``table`` (and appended one feed entry): drop the
        table's rows."""
        self._tables.pop(table, None)
        if self.at is not None:
            self.at = (self.at[0], self.at[1] + 1)

    def _put(self, spec: TableSpec, ids: np.ndarray, records: np.ndarray) -> None:
        """Hold ``records`` of ``ids`` (sorted, unique), replacing what is held of them; evicts the
        least recently used quarter in one go when the table would hold more than ``rows``."""
        t = self._tables.get(spec.name)
        if t is None or t.records.dtype != records.dtype:
            t = self._tables[spec.name] = _Table(np.zeros(0, np.int64), np.zeros(0, np.int64),
                                                 np.zeros(self.rows, dtype=records.dtype),
                                                 np.zeros(self.rows, np.int64), np.arange(self.rows, dtype=np.int64))
        if ids.size > self.rows:  # more than it can hold: the last ones
            ids, records = ids[-self.rows:], records[-self.rows:]
        pos = np.minimum(np.searchsorted(t.ids, ids), max(t.ids.size - 1, 0))
        hit = (t.ids[pos] == ids) if t.ids.size else np.zeros(ids.size, dtype=bool)
        old = t.slots[pos[hit]]
        t.records[old] = records[hit]
        t.used[old] = self._tick
        new = np.flatnonzero(~hit)
        if new.size > t.free.size:
            self._evict(t, max(new.size - t.free.size, self.rows // 4), keep=old)
        slots, t.free = t.free[:new.size], t.free[new.size:]
        t.records[slots] = records[new]
        t.used[slots] = self._tick
        at = np.searchsorted(t.ids, ids[new])
        t.ids = np.insert(t.ids, at, ids[new])
        t.slots = np.insert(t.slots, at, slots)

    def _evict(self, t: _Table, n: int, keep: np.ndarray) -> None:
        """Free the ``n`` (at most all held) least recently used slots of ``t``, never one of ``keep``."""
        used = t.used[t.slots].copy()
        used[np.isin(t.slots, keep)] = np.iinfo(np.int64).max
        n = min(n, t.ids.size - keep.size)
        if n <= 0:
            return
        gone = np.zeros(t.ids.size, dtype=bool)
        gone[np.argpartition(used, n - 1)[:n]] = True
        t.free = np.concatenate([t.free, t.slots[gone]])
        t.ids, t.slots = t.ids[~gone], t.slots[~gone]
