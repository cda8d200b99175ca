"""What one server's apply does to its group's rows (pure: the I/O is in ``services.server``).

A server applies a batch of updates in log order. For its rows it first loads,
in one round trip, every row the batch touches (``store.load_rows``), then
applies each update in turn to that working set (:class:`TableBatch`), and
writes back, in the group's atomic apply, exactly the rows, sighting records
and counters that changed: nothing that does not change is rewritten. The math
is the math of applying the updates one by one: each row's steps keep their
order, and the table's step count advances once per update that carries
gradients for the table (the update's header names those tables, so every
group counts alike, whether or not it owns any of the rows).

**Admission** (Monolith's occurrence threshold). A gradient for an ID without
a row counts one sighting of the ID; once an ID has been sighted in
``admit_after`` updates it gets a row, born at its initial value, and that
update's gradient is its first step. Until then its gradients are *dropped*
and counted (``dropped``), and its sighting record keeps the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .grads import RowGrads
from .optim import step_rows
from .rows import SEEN_DTYPE, initial_rows, row_dtype
from .spec import TableSpec
from .store import LoadedRows

__all__ = ["TableBatch", "TableWrites"]


@dataclass(frozen=True)
class TableWrites:
    """What one table's batch writes (all IDs int64; records as stored)."""

    table: str
    """Table name."""
    record_size: int
    """Bytes per row record."""
    row_ids: np.ndarray
    """IDs of the rows written (changed or born)."""
    rows: bytes
    """Their ``row_dtype`` records, concatenated in ``row_ids`` order."""
    seen_ids: np.ndarray
    """IDs whose sighting record changed."""
    seen: bytes
    """Their ``SEEN_DTYPE`` records."""
    unseen_ids: np.ndarray
    """IDs admitted by this batch whose sighting record goes."""
    steps: int
    """The table's step count after the batch."""
    admitted: int
    """Rows born."""
    dropped: int
    """Gradient rows dropped because their ID was not admitted yet."""

    @property
    def empty(self) -> bool:
        """Nothing to write but, perhaps, the step count."""
        return not (self.row_ids.size or self.seen_ids.size or self.unseen_ids.size)


@dataclass
class TableBatch:
    """One table's rows that a batch of updates touches, in a server's memory during the batch."""

    spec: TableSpec
    ids: np.ndarray
    """Every ID the batch touches that this group owns, sorted, unique."""
    steps: int
    """The table's step count (updates that carried its gradients)."""
    present: np.ndarray = field(init=False)
    values: np.ndarray = field(init=False)
    state: np.ndarray = field(init=False)
    written_ms: np.ndarray = field(init=False)
    changed: np.ndarray = field(init=False)
    born: np.ndarray = field(init=False)
    seen_count: np.ndarray = field(init=False)
    seen_ms: np.ndarray = field(init=False)
    seen_changed: np.ndarray = field(init=False)
    admitted: int = 0
    dropped: int = 0

    @classmethod
    def load(cls, spec: TableSpec, loaded: LoadedRows, steps: int) -> TableBatch:
        """The working set of ``loaded`` (whose IDs must be sorted and unique)."""
        tb = cls(spec, loaded.ids, steps)
        n = loaded.ids.size
        tb.present = loaded.present.copy()
        tb.values = np.empty((n, spec.dim), dtype=np.float32)
        tb.state = np.zeros((n, spec.slots), dtype=np.float32)
        tb.written_ms = np.zeros(n, dtype=np.uint64)
        tb.values[tb.present] = loaded.records["values"]
        tb.state[tb.present] = loaded.records["state"]
        tb.written_ms[tb.present] = loaded.records["written_ms"]
        absent = ~tb.present
        if absent.any():
            tb.values[absent] = initial_rows(spec, loaded.ids[absent])
        tb.changed = np.zeros(n, dtype=bool)
        tb.born = np.zeros(n, dtype=bool)
        tb.seen_count = np.zeros(n, dtype=np.uint32)
        tb.seen_ms = np.zeros(n, dtype=np.uint64)
        tb.seen_count[loaded.seen] = loaded.seen_records["count"]
        tb.seen_ms[loaded.seen] = loaded.seen_records["seen_ms"]
        tb.seen_changed = np.zeros(n, dtype=bool)
        return tb

    def step(self, part: RowGrads | None, now_ms: int) -> None:
        """Apply one update that carries gradients for this table (``part``: those of this group's
        rows, None when it has none of them): the step count advances either way."""
        self.steps += 1
        if part is None or part.ids.size == 0:
            return
        pos = np.searchsorted(self.ids, part.ids)
        if pos.size and (pos[-1] >= self.ids.size or not np.array_equal(self.ids[pos], part.ids)):
            raise ValueError(f"table {self.spec.name}: an update touches IDs the batch did not load")
        grads = part.grads
        new = ~self.present[pos]
        if new.any():
            at = pos[new]
            count = self.seen_count[at] + np.uint32(1)
            admit = count >= self.spec.admit_after
            born = at[admit]
            self.present[born] = True
            self.born[born] = True
            self.admitted += int(born.size)
            waiting = at[~admit]
            self.seen_count[waiting] = count[~admit]
            self.seen_ms[waiting] = now_ms
            self.seen_changed[waiting] = True
            self.dropped += int(waiting.size)
            keep = self.present[pos]
            pos, grads = pos[keep], grads[keep]
        values, state = self.values[pos], self.state[pos]
        step_rows(self.spec.optimizer, values, state, grads, self.steps)
        self.values[pos], self.state[pos] = values, state
        self.written_ms[pos] = now_ms
        self.changed[pos] = True

    def writes(self, version: int) -> TableWrites:
        """What to write for this batch, the rows stamped with the group ``version`` the apply makes."""
        rows_at = np.flatnonzero(self.changed)
        records = np.empty(rows_at.size, dtype=row_dtype(self.spec))
        records["version"] = version
        records["values"] = self.values[rows_at]
        records["written_ms"] = self.written_ms[rows_at]
        records["state"] = self.state[rows_at]
        seen_at = np.flatnonzero(self.seen_changed & ~self.present)
        seen = np.empty(seen_at.size, dtype=SEEN_DTYPE)
        seen["count"] = self.seen_count[seen_at]
        seen["seen_ms"] = self.seen_ms[seen_at]
        unseen = self.ids[self.born & (self.seen_count > 0)]
        return TableWrites(self.spec.name, records.dtype.itemsize, self.ids[rows_at], records.tobytes(),
                           self.ids[seen_at], seen.tobytes(),
                           unseen, self.steps, self.admitted, self.dropped)
