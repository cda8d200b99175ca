"""One embedding table's rows in a serving replica, held compactly (pure; numpy only).

:class:`RowStore` keeps rows in slots: one contiguous float32 matrix ``[capacity, dim]`` of values and a
parallel uint64 array of versions (plus, for a bounded store, an int64 recency stamp per slot). IDs are
found through a sorted int64 array of the live IDs with a parallel int32 array of their slots
(``np.searchsorted``), merged on insert and masked on remove: no Python object per row, and no Python
work per row in any operation. Freed slots go on a stack and are reused before the store grows.

Memory. The store does not keep a per-slot copy of each ID: the sorted index already holds every live
ID once, and a second copy would cost 8 bytes per slot with the growth headroom on top. Slots that were
never used sit above a high-water mark, so the free stack holds only slots freed by removal or eviction.
An unbounded store grows by a factor of 1.25 only when no freed slot is left, so a table of ``n`` rows
that never lost any holds less than ``1.25 * n * (4 * dim + 8) + 12 * n`` bytes (:attr:`RowStore.nbytes`);
for ``dim >= 10`` that is under 1.5 times the ``8 + 4 * dim`` bytes of an ID and its values (dim 16:
under 102 bytes a row against 72). Slots freed by removal are reused by inserts; once fewer than half the
slots hold rows, a removal compacts the store to its rows (with the growth headroom).
"""

from __future__ import annotations

import numpy as np

__all__ = ["RowStore"]

_GROWTH = 1.25
"""Factor by which an unbounded store's slot arrays grow (not 2: the allocation stays near the rows)."""
_MIN_CAPACITY = 16
_SHRINK_BELOW = 2
"""An unbounded store whose rows fall under ``1 / _SHRINK_BELOW`` of its slots is compacted (:meth:`remove`)."""
_MAX_SLOTS = int(np.iinfo(np.int32).max)
"""Slots are int32."""


def _as_ids(ids: np.ndarray, name: str = "ids") -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int64:
        raise ValueError(f"{name} must be int64, got {arr.dtype}")
    return arr


def _as_rows(ids: np.ndarray, values: np.ndarray, versions: np.ndarray, dim: int) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    ids = _as_ids(ids)
    values = np.asarray(values)
    versions = np.asarray(versions)
    if values.dtype != np.float32:
        raise ValueError(f"values must be float32, got {values.dtype}")
    if values.shape != (len(ids), dim):
        raise ValueError(f"values must have shape ({len(ids)}, {dim}) (len(ids), dim), got {values.shape}")
    if versions.dtype != np.uint64:
        raise ValueError(f"versions must be uint64, got {versions.dtype}")
    if versions.shape != (len(ids),):
        raise ValueError(f"versions must have shape ({len(ids)},) (len(ids),), got {versions.shape}")
    return ids, values, versions


def _sorted_unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` sorted ascending and the order that sorts them.

    Raises:
        ValueError: an ID occurs more than once.
    """
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    repeats = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if len(repeats):
        raise ValueError(f"ids must be unique within one call; ID {int(sorted_ids[repeats[0]])} repeats "
                         f"({len(repeats)} repeated in all)")
    return sorted_ids, order


class RowStore:
    """One embedding table's rows: values ``[dim]`` float32 and a uint64 version per ID.

    Unbounded (``max_rows == 0``) the store holds every row of the table, so an ID absent from it has no
    row; its slot arrays grow by 1.25 as rows arrive and never shrink (except by :meth:`clear`). Bounded
    (``max_rows > 0``) it is a cache of the ``max_rows`` most recently *used* rows, where a row is used when
    :meth:`gather` returns it or :meth:`upsert` inserts it (an update of a row already held is not a use:
    a replica following the feed would otherwise keep every written row hot); inserting beyond
    ``max_rows`` evicts the least recently used rows, counted in :attr:`evictions`. Recency is a stamp per
    slot from a counter bumped once per call. A bounded store allocates its arrays once, at exactly
    ``max_rows`` slots.

    A row's version is the parameter-plane group version that last wrote it; :meth:`upsert` never lets an
    older version overwrite a newer one. Not thread-safe: one writer, or a lock around every call.
    """

    def __init__(self, dim: int, *, max_rows: int = 0) -> None:
        """An empty store of rows of ``dim`` values, holding at most ``max_rows`` (0: unbounded).

        Raises:
            ValueError: ``dim`` is not a positive int, or ``max_rows`` not an int >= 0 that fits int32 slots.
        """
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
            raise ValueError(f"dim must be an int > 0, got {dim!r}")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int | np.integer) or max_rows < 0:
            raise ValueError(f"max_rows must be an int >= 0 (0: unbounded), got {max_rows!r}")
        if max_rows > _MAX_SLOTS:
            raise ValueError(f"max_rows must be at most {_MAX_SLOTS}, got {max_rows}")
        self._dim = int(dim)
        self._max_rows = int(max_rows)
        self._values = np.empty((self._max_rows, self._dim), dtype=np.float32)
        self._versions = np.zeros(self._max_rows, dtype=np.uint64)
        self._stamps = np.zeros(self._max_rows, dtype=np.int64)  # empty when unbounded: no recency to keep
        self._keys = np.empty(0, dtype=np.int64)
        """The live IDs, ascending."""
        self._slots = np.empty(0, dtype=np.int32)
        """The slot of each of ``_keys``."""
        self._free = np.empty(0, dtype=np.int32)
        """A stack of freed slots: the first ``_nfree`` entries."""
        self._nfree = 0
        self._top = 0
        """Slots at and above this were never used."""
        self._clock = 0
        self._evictions = 0

    # -- construction in bulk --------------------------------------------------------------------------

    @classmethod
    def from_rows(cls, dim: int, ids: np.ndarray, values: np.ndarray, versions: np.ndarray, *,
                  max_rows: int = 0) -> RowStore:
        """A store holding these rows, built in one pass (no merge per batch).

        ``ids`` (int64, unique), ``values`` (float32 ``[len(ids), dim]``) and ``versions`` (uint64) as for
        :meth:`upsert`. An unbounded store is allocated at exactly ``len(ids)`` slots. A bounded one keeps
        the first ``max_rows`` rows in the order given and drops the rest (not counted as evictions); the
        rows kept count as used at the same moment.

        Raises:
            ValueError: as for the constructor and :meth:`upsert` (shapes, dtypes, a repeated ID).
        """
        store = cls(dim, max_rows=max_rows)
        ids, values, versions = _as_rows(ids, values, versions, store._dim)
        _sorted_unique(ids)
        if max_rows and len(ids) > max_rows:
            ids, values, versions = ids[:max_rows], values[:max_rows], versions[:max_rows]
        n = len(ids)
        if n > _MAX_SLOTS:
            raise ValueError(f"at most {_MAX_SLOTS} rows fit one store, got {n}")
        if not max_rows:
            store._values = np.empty((n, store._dim), dtype=np.float32)
            store._versions = np.zeros(n, dtype=np.uint64)
        store._values[:n] = values
        store._versions[:n] = versions
        order = np.argsort(ids, kind="stable")
        store._keys = ids[order]
        store._slots = order.astype(np.int32)
        store._top = n
        if max_rows:
            store._clock = 1
            store._stamps[:n] = 1
        return store

    # -- properties ------------------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        """Values per row."""
        return self._dim

    @property
    def max_rows(self) -> int:
        """The most rows held (0: unbounded)."""
        return self._max_rows

    @property
    def rows(self) -> int:
        """Live rows held now."""
        return len(self._keys)

    @property
    def capacity(self) -> int:
        """Slots allocated (live, freed and never used)."""
        return len(self._versions)

    @property
    def evictions(self) -> int:
        """Rows a bounded store dropped to make room for inserts, since it was made."""
        return self._evictions

    @property
    def nbytes(self) -> int:
        """Bytes of every array the store holds allocated: values, versions, stamps, index and free stack."""
        return int(self._values.nbytes + self._versions.nbytes + self._stamps.nbytes + self._keys.nbytes
                   + self._slots.nbytes + self._free.nbytes)

    # -- reads -----------------------------------------------------------------------------------------

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each ID's position in the index (where it is or would go) and whether it is there."""
        keys = self._keys
        pos = np.searchsorted(keys, ids)
        if not len(keys):
            return pos, np.zeros(len(ids), dtype=bool)
        return pos, keys[np.minimum(pos, len(keys) - 1)] == ids

    def gather(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy the rows of the IDs held into ``out``; return which were found (bool ``[len(ids)]``).

        ``ids`` is int64 and may repeat IDs; ``out`` is a writable float32 ``[len(ids), dim]`` array. Rows
        of IDs absent leave their lines of ``out`` untouched. In a bounded store the rows found count as
        used now.

        Raises:
            ValueError: ``ids`` is not 1-D int64, or ``out`` not a writable float32 array of that shape.
        """
        ids = _as_ids(ids)
        if not isinstance(out, np.ndarray):
            raise ValueError(f"out must be a numpy array, got {type(out).__name__}")
        if out.dtype != np.float32:
            raise ValueError(f"out must be float32, got {out.dtype}")
        if out.shape != (len(ids), self._dim):
            raise ValueError(f"out must have shape ({len(ids)}, {self._dim}) (len(ids), dim), got {out.shape}")
        if not out.flags.writeable:
            raise ValueError("out must be writable")
        pos, found = self._find(ids)
        slots = self._slots[pos[found]]
        out[found] = self._values[slots]
        if self._max_rows and len(slots):
            self._clock += 1
            self._stamps[slots] = self._clock
        return found

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of every live row: IDs ascending (int64), their values ``[rows, dim]`` and versions.

        Reading them is not a use (recency does not change).
        """
        return self._keys.copy(), self._values[self._slots], self._versions[self._slots]

    # -- writes ----------------------------------------------------------------------------------------

    def upsert(self, ids: np.ndarray, values: np.ndarray, versions: np.ndarray, *, insert: bool = True) -> int:
        """Write rows; return how many were written (updated or inserted).

        ``ids`` is int64 with each ID at most once per call, ``values`` float32 ``[len(ids), dim]`` and
        ``versions`` uint64 ``[len(ids)]``. A row held is replaced (values and version) only where the
        given version is >= the stored one, so a row read earlier never overwrites a newer one. An ID
        absent is inserted when ``insert``, else ignored.

        Bounded: updates do not count as a use. Inserts that would pass ``max_rows`` first evict the least
        recently used rows held (ties in any order), which may include rows this call just updated (they
        still count as written). If more IDs are absent than ``max_rows``, only the first ``max_rows`` of
        them in the order of ``ids`` are inserted (and every row held before is evicted).

        Raises:
            ValueError: a shape or dtype is wrong, or an ID repeats.
        """
        ids, values, versions = _as_rows(ids, values, versions, self._dim)
        if not len(ids):
            return 0
        sorted_ids, order = _sorted_unique(ids)
        pos, found = self._find(sorted_ids)

        src = order[found]
        slots = self._slots[pos[found]]
        newer = versions[src] >= self._versions[slots]
        src, slots = src[newer], slots[newer]
        self._values[slots] = values[src]
        self._versions[slots] = versions[src]
        written = len(slots)
        if not insert:
            return written

        absent = ~found
        new_ids, src = sorted_ids[absent], order[absent]
        if self._max_rows and len(src) > self._max_rows:
            keep = src <= np.partition(src, self._max_rows - 1)[self._max_rows - 1]
            new_ids, src = new_ids[keep], src[keep]
        m = len(src)
        if not m:
            return written
        if self._max_rows:
            self._evict(self.rows + m - self._max_rows)
        elif self.rows + m > _MAX_SLOTS:
            raise ValueError(f"at most {_MAX_SLOTS} rows fit one store; {self.rows} held, {m} more given")
        slots = self._take(m)
        self._values[slots] = values[src]
        self._versions[slots] = versions[src]
        if self._max_rows:
            self._clock += 1
            self._stamps[slots] = self._clock
        self._merge(new_ids, slots)
        return written + m

    def remove(self, ids: np.ndarray) -> int:
        """Drop the rows of these IDs (int64; repeats and absent IDs ignored); return rows removed.

        Their slots are reused by later inserts. Removals are not evictions.

        Raises:
            ValueError: ``ids`` is not 1-D int64.
        """
        ids = _as_ids(ids)
        pos, found = self._find(ids)
        gone = np.unique(pos[found])
        self._drop(gone)
        if not self._max_rows and self.capacity > _MIN_CAPACITY and self.rows * _SHRINK_BELOW < self.capacity:
            self._compact()
        return len(gone)

    def clear(self) -> None:
        """Drop every row (not counted as evictions). An unbounded store frees its arrays; a bounded one
        keeps its allocation of ``max_rows`` slots."""
        if not self._max_rows:
            self._values = np.empty((0, self._dim), dtype=np.float32)
            self._versions = np.zeros(0, dtype=np.uint64)
        self._keys = np.empty(0, dtype=np.int64)
        self._slots = np.empty(0, dtype=np.int32)
        self._free = np.empty(0, dtype=np.int32)
        self._nfree = 0
        self._top = 0

    # -- slots and index -------------------------------------------------------------------------------

    def _evict(self, count: int) -> None:
        """Drop the ``count`` least recently used rows (none when ``count <= 0``)."""
        if count <= 0:
            return
        if count >= self.rows:
            gone = np.arange(self.rows)
        else:
            gone = np.argpartition(self._stamps[self._slots], count - 1)[:count]
        self._drop(gone)
        self._evictions += len(gone)

    def _drop(self, positions: np.ndarray) -> None:
        """Remove the index entries at these (unique) positions and free their slots."""
        if not len(positions):
            return
        freed = self._slots[positions]
        keep = np.ones(len(self._keys), dtype=bool)
        keep[positions] = False
        self._keys = self._keys[keep]
        self._slots = self._slots[keep]
        need = self._nfree + len(freed)
        if need > len(self._free):
            grown = np.empty(max(need, int(len(self._free) * _GROWTH), _MIN_CAPACITY), dtype=np.int32)
            grown[:self._nfree] = self._free[:self._nfree]
            self._free = grown
        self._free[self._nfree:need] = freed
        self._nfree = need

    def _take(self, count: int) -> np.ndarray:
        """``count`` slots to write new rows in: freed ones first, then never-used ones (growing if needed)."""
        reused = min(count, self._nfree)
        self._nfree -= reused
        taken = self._free[self._nfree:self._nfree + reused].copy()
        fresh = count - reused
        if not fresh:
            return taken
        if self._top + fresh > self.capacity:
            self._grow(self._top + fresh)
        start = self._top
        self._top += fresh
        return np.concatenate([taken, np.arange(start, self._top, dtype=np.int32)])

    def _compact(self) -> None:
        """Move an unbounded store's rows into its first slots (in ID order) and reallocate the slot arrays
        to the rows with the growth headroom: a table that lost most of its rows gives the memory back."""
        live = self._slots
        capacity = max(int(self.rows * _GROWTH), _MIN_CAPACITY)
        values = np.empty((capacity, self._dim), dtype=np.float32)
        values[:self.rows] = self._values[live]
        versions = np.zeros(capacity, dtype=np.uint64)
        versions[:self.rows] = self._versions[live]
        self._values, self._versions = values, versions
        self._slots = np.arange(self.rows, dtype=np.int32)
        self._free = np.empty(0, dtype=np.int32)
        self._nfree = 0
        self._top = self.rows

    def _grow(self, needed: int) -> None:
        """Reallocate the slot arrays of an unbounded store to hold at least ``needed`` slots."""
        capacity = min(max(needed, int(self.capacity * _GROWTH), _MIN_CAPACITY), _MAX_SLOTS)
        values = np.empty((capacity, self._dim), dtype=np.float32)
        values[:self._top] = self._values[:self._top]
        versions = np.zeros(capacity, dtype=np.uint64)
        versions[:self._top] = self._versions[:self._top]
        self._values, self._versions = values, versions

    def _merge(self, new_ids: np.ndarray, new_slots: np.ndarray) -> None:
        """Add IDs absent from the index (ascending) with their slots, keeping it sorted."""
        n, k = len(self._keys), len(new_ids)
        at = np.searchsorted(self._keys, new_ids) + np.arange(k)
        old = np.ones(n + k, dtype=bool)
        old[at] = False
        keys = np.empty(n + k, dtype=np.int64)
        keys[at] = new_ids
        keys[old] = self._keys
        slots = np.empty(n + k, dtype=np.int32)
        slots[at] = new_slots
        slots[old] = self._slots
        self._keys, self._slots = keys, slots
