"""What one server's apply does to its group's rows (pure: the I/O is in ``services.server.service``).

:class:`RowBatch` applies a batch of updates in log order to the rows the batch touches, loaded in one
round trip, with admission after ``admit_after`` sightings (gradients of unadmitted IDs dropped and
counted); :class:`TableWrites` is exactly what changed, for the group's atomic apply. The math is that
of the updates one by one. See docs/embeddings.md, *Pull, push, apply* and *Admission, expiry, eviction*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .grads import RowGrads
from .optim import step_rows
from .rows import (
    SEEN_DTYPE,
    decode_state,
    decode_values,
    encode_state,
    encode_values,
    initial_rows,
    round_stored,
    row_dtype,
)
from .spec import TableSpec
from .store import LoadedRows

__all__ = ["RowBatch", "TableWrites", "kinds"]


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


def kinds(tables: Sequence[TableSpec]) -> list[tuple[TableSpec, ...]]:
    """``tables`` grouped by what their math and records share (dimension, row optimizer, admission,
    stored type): each group is applied by one :class:`RowBatch`, whatever the number of tables in it."""
    out: dict[tuple[Any, ...], list[TableSpec]] = {}
    for t in tables:
        out.setdefault((t.dim, t.optimizer, t.admit_after, t.value_dtype), []).append(t)
    return [tuple(group) for group in out.values()]


@dataclass
class RowBatch:
    """The rows of some tables of one kind (:func:`kinds`) that a batch of updates touches, in a
    server's memory during the batch: the tables' rows side by side (table after table, each table's
    IDs sorted), so a batch of updates is applied in a few vectorised rounds, not one step per
    update and table.

    Applying: every (update, row) pair of gradient is ranked among the pairs of its row in log order;
    round k applies every row's k-th pair at once (a row appears at most once in a round), with each
    pair's own step count (its table's count at its update). That is the math of the updates one by
    one, bit for bit: each row's steps keep their order, and the rows of one update never interact.
    Rows are held in float32 (decoded on load); in a narrow table (``value_dtype``) each step's result
    is rounded to what its record stores, so a row stepped twice in one batch is, bit for bit, a row
    stepped, stored, loaded and stepped again.
    """

    specs: tuple[TableSpec, ...]
    """The tables, in the order of their rows."""
    ids: np.ndarray
    """Every ID the batch touches that this group owns, table after table, each table's sorted."""
    table: np.ndarray
    """int64: the index in :attr:`specs` of each row's table."""
    bounds: np.ndarray
    """int64 ``[len(specs) + 1]``: table j's rows are ``bounds[j]:bounds[j + 1]``."""
    steps: dict[str, int]
    """Table -> its step count (updates that carried its gradients)."""
    present: np.ndarray = field(init=False)
    values: np.ndarray = field(init=False)
    state: np.ndarray = field(init=False)
    written_ms: np.ndarray = field(init=False)
    changed: np.ndarray = field(init=False)
    born: np.ndarray = field(init=False)
    seen_count: np.ndarray = field(init=False)
    seen_ms: np.ndarray = field(init=False)
    seen_changed: np.ndarray = field(init=False)
    admitted: np.ndarray = field(init=False)
    """int64 per table: rows born."""
    dropped: np.ndarray = field(init=False)
    """int64 per table: gradient rows dropped."""

    @classmethod
    def load(cls, specs: Sequence[TableSpec], loaded: Mapping[str, LoadedRows], steps: Mapping[str, int]
             ) -> RowBatch:
        """The working set of ``loaded`` (table -> its rows; each table's IDs sorted and unique)."""
        specs = tuple(specs)
        spec = specs[0]
        parts = [loaded[t.name] for t in specs]
        sizes = np.array([p.ids.size for p in parts], dtype=np.int64)
        bounds = np.zeros(len(specs) + 1, dtype=np.int64)
        np.cumsum(sizes, out=bounds[1:])
        rb = cls(specs, np.concatenate([p.ids for p in parts]), np.repeat(np.arange(len(specs)), sizes), bounds,
                 {t.name: int(steps.get(t.name, 0)) for t in specs})
        n = rb.ids.size
        rb.present = np.concatenate([p.present for p in parts])
        rb.values = np.empty((n, spec.dim), dtype=np.float32)
        rb.state = np.zeros((n, spec.slots), dtype=np.float32)
        rb.written_ms = np.zeros(n, dtype=np.uint64)
        records = np.concatenate([p.records for p in parts])
        rb.values[rb.present] = decode_values(spec, records["values"])
        rb.state[rb.present] = decode_state(spec, records["state"])
        rb.written_ms[rb.present] = records["written_ms"]
        for j, t in enumerate(specs):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            absent = np.flatnonzero(~rb.present[lo:hi]) + lo
            if absent.size:
                rb.values[absent] = initial_rows(t, rb.ids[absent])
        rb.changed = np.zeros(n, dtype=bool)
        rb.born = np.zeros(n, dtype=bool)
        seen = np.concatenate([p.seen for p in parts])
        seen_records = np.concatenate([p.seen_records for p in parts])
        rb.seen_count = np.zeros(n, dtype=np.uint32)
        rb.seen_ms = np.zeros(n, dtype=np.uint64)
        rb.seen_count[seen] = seen_records["count"]
        rb.seen_ms[seen] = seen_records["seen_ms"]
        rb.seen_changed = np.zeros(n, dtype=bool)
        rb.admitted = np.zeros(len(specs), dtype=np.int64)
        rb.dropped = np.zeros(len(specs), dtype=np.int64)
        return rb

    def apply(self, updates: Sequence[tuple[Sequence[str], Mapping[str, RowGrads]]], now_ms: int) -> None:
        """Apply ``updates`` in log order: each is (the tables it carries gradients for, which all
        count a step, whether or not this group owns any of their rows; its gradient rows of this
        group's rows by table)."""
        index = {t.name: j for j, t in enumerate(self.specs)}
        rows, grads, ts = [], [], []
        for tables, parts in updates:
            for name in tables:
                j = index.get(name)
                if j is None:
                    continue
                self.steps[name] += 1
                part = parts.get(name)
                if part is None or part.ids.size == 0:
                    continue
                lo, hi = int(self.bounds[j]), int(self.bounds[j + 1])
                at = np.searchsorted(self.ids[lo:hi], part.ids)
                if at.size and (at[-1] >= hi - lo or not np.array_equal(self.ids[lo:hi][at], part.ids)):
                    raise ValueError(f"table {name}: an update touches IDs the batch did not load")
                rows.append(at + lo)
                grads.append(part.grads)
                ts.append(np.full(at.size, self.steps[name], dtype=np.int64))
        if not rows:
            return
        row, grad, t = np.concatenate(rows), np.concatenate(grads), np.concatenate(ts)
        # rank each pair among its row's pairs, in log order (the concatenation's order)
        order = np.argsort(row, kind="stable")
        sorted_rows = row[order]
        first = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
        rank = np.empty(row.size, dtype=np.int64)
        rank[order] = np.arange(row.size) - np.repeat(first, np.diff(np.r_[first, row.size]))
        for k in range(int(rank.max()) + 1):
            pick = np.flatnonzero(rank == k)
            self._round(row[pick], grad[pick], t[pick], now_ms)

    def _round(self, rows: np.ndarray, grads: np.ndarray, t: np.ndarray, now_ms: int) -> None:
        """One step of each of ``rows`` (distinct), with its gradient and step count."""
        new = ~self.present[rows]
        if new.any():
            at = rows[new]
            count = self.seen_count[at] + np.uint32(1)
            admit = count >= self.specs[0].admit_after
            born = at[admit]
            self.present[born] = True
            self.born[born] = True
            np.add.at(self.admitted, self.table[born], 1)
            waiting = at[~admit]
            self.seen_count[waiting] = count[~admit]
            self.seen_ms[waiting] = now_ms
            self.seen_changed[waiting] = True
            np.add.at(self.dropped, self.table[waiting], 1)
            keep = self.present[rows]
            rows, grads, t = rows[keep], grads[keep], t[keep]
        if not rows.size:
            return
        values, state = self.values[rows], self.state[rows]
        spec = self.specs[0]
        step_rows(spec.optimizer, values, state, grads, t)
        self.values[rows] = round_stored(values, spec.value_dtype)
        self.state[rows] = round_stored(state, spec.state_dtype)
        self.written_ms[rows] = now_ms
        self.changed[rows] = True

    def writes(self, version: int) -> list[TableWrites]:
        """What to write for this batch, table by table, the rows stamped with the group ``version``
        the apply makes."""
        out = []
        dtype = row_dtype(self.specs[0])
        for j, spec in enumerate(self.specs):
            lo, hi = int(self.bounds[j]), int(self.bounds[j + 1])
            rows_at = np.flatnonzero(self.changed[lo:hi]) + lo
            records = np.empty(rows_at.size, dtype=dtype)
            records["version"] = version
            records["values"] = encode_values(spec, self.values[rows_at])
            records["written_ms"] = self.written_ms[rows_at]
            records["state"] = encode_state(spec, self.state[rows_at])
            seen_at = np.flatnonzero(self.seen_changed[lo:hi] & ~self.present[lo:hi]) + lo
            seen = np.empty(seen_at.size, dtype=SEEN_DTYPE)
            seen["count"] = self.seen_count[seen_at]
            seen["seen_ms"] = self.seen_ms[seen_at]
            unseen = self.ids[lo:hi][self.born[lo:hi] & (self.seen_count[lo:hi] > 0)]
            out.append(TableWrites(spec.name, dtype.itemsize, self.ids[rows_at], records.tobytes(),
                                   self.ids[seen_at], seen.tobytes(), unseen, self.steps[spec.name],
                                   int(self.admitted[j]), int(self.dropped[j])))
        return out
