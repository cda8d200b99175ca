"""Ragged columns of categorical IDs, one per feature, with no per-record objects.

A :class:`Jagged` holds one feature's IDs for ``n`` records as a flat ``values`` array and ``n + 1``
``offsets``, like TorchRec's ``KeyedJaggedTensor``; several features travel as ``dict[str, Jagged]``,
joined row-wise by :func:`concat_features`. Every operation is vectorised numpy.
See docs/records.md, *IDs in a shard* and *IDs in a batch*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Jagged", "concat_features", "take_features"]

_INT64 = np.dtype(np.int64)


@dataclass(frozen=True)
class Jagged:
    """IDs of one categorical feature for n records: record r's IDs are values[offsets[r]:offsets[r+1]].

    Construction checks the invariants (vectorised, O(n)) and raises ``ValueError`` naming the
    broken one, so a ``Jagged`` that exists is well formed. The arrays may be read-only views
    (on a Kafka message, say); nothing here writes to them.
    """

    values: np.ndarray
    """int64 ``[nnz]``: the IDs of all records, record after record."""
    offsets: np.ndarray
    """int64 ``[n + 1]``: ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == nnz``."""

    def __post_init__(self) -> None:
        v, o = self.values, self.offsets
        if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype != _INT64:
            raise ValueError(f"Jagged values must be a 1-D int64 array, got {_describe(v)}")
        if not isinstance(o, np.ndarray) or o.ndim != 1 or o.dtype != _INT64 or len(o) == 0:
            raise ValueError(f"Jagged offsets must be a non-empty 1-D int64 array, got {_describe(o)}")
        first, last = o.item(0), o.item(-1)
        if first != 0 or last != len(v):
            raise ValueError(f"Jagged offsets must run from 0 to len(values) = {len(v)}; "
                             f"they run from {first} to {last}")
        if len(o) > 2 and bool((o[1:] < o[:-1]).any()):
            raise ValueError("Jagged offsets must be non-decreasing")

    @property
    def n(self) -> int:
        """Number of records."""
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.n

    @property
    def nnz(self) -> int:
        """Number of IDs over all records."""
        return len(self.values)

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[n]``: IDs per record."""
        return np.diff(self.offsets)

    @classmethod
    def empty(cls, n: int) -> Jagged:
        """``n`` records with no IDs."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return cls(np.empty(0, np.int64), np.zeros(n + 1, np.int64))

    @classmethod
    def from_lengths(cls, values: np.ndarray, lengths: np.ndarray) -> Jagged:
        """Records of ``lengths[r]`` IDs each, taken in order from ``values``.

        Raises:
            ValueError: a length is negative, or the lengths do not add up to ``len(values)``.
        """
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
            raise ValueError(f"lengths must be a 1-D integer array, got {_describe(lengths)}")
        if len(lengths) and int(lengths.min()) < 0:
            raise ValueError("lengths must be >= 0")
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, dtype=np.int64, out=offsets[1:])
        return cls(np.asarray(values, dtype=np.int64), offsets)

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> Jagged:
        """One record per list of IDs (for tests and small inputs; this one loops in Python)."""
        lengths = np.fromiter((len(r) for r in rows), np.int64, count=len(rows))
        values = np.fromiter((v for r in rows for v in r), np.int64, count=int(lengths.sum()))
        return cls.from_lengths(values, lengths)

    @classmethod
    def concat(cls, parts: Sequence[Jagged]) -> Jagged:
        """The records of ``parts`` one after the other (a fresh copy, even of one part)."""
        return _join([p.values for p in parts], [p.offsets for p in parts])

    def slice(self, start: int, stop: int) -> Jagged:
        """Records ``start .. stop-1``; ``values`` stays a view."""
        if not 0 <= start <= stop <= self.n:
            raise ValueError(f"slice {start}:{stop} outside 0:{self.n}")
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Jagged(self.values[lo:hi], self.offsets[start:stop + 1] - lo)

    def take(self, rows: np.ndarray) -> Jagged:
        """The records ``rows`` (integer indices, or a boolean mask of length ``n``), in that order."""
        rows = np.asarray(rows)
        if rows.dtype == np.bool_:
            if rows.shape != (self.n,):
                raise ValueError(f"a mask must have {self.n} entries, got shape {rows.shape}")
            rows = np.flatnonzero(rows)
        if self.nnz == self.n and np.array_equal(self.offsets, np.arange(self.n + 1)):  # one ID per record
            return Jagged(self.values[rows], np.arange(len(rows) + 1, dtype=np.int64))
        starts = self.offsets[:-1][rows]
        lengths = self.offsets[1:][rows] - starts
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, dtype=np.int64, out=offsets[1:])
        # position of every taken ID in values: its record's start plus its rank inside the record
        within = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        return Jagged(self.values[np.repeat(starts, lengths) + within], offsets)

    def row_ids(self) -> np.ndarray:
        """int64 ``[nnz]``: the record each value belongs to (for per-record sums with ``bincount``)."""
        return np.repeat(np.arange(self.n, dtype=np.int64), self.lengths)

    def to_lists(self) -> list[list[int]]:
        """One list of IDs per record (for tests and logs; this one loops in Python)."""
        return [self.values[a:b].tolist() for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Jagged):
            return NotImplemented
        return np.array_equal(self.values, other.values) and np.array_equal(self.offsets, other.offsets)


def concat_features(parts: Sequence[tuple[int, Mapping[str, Jagged]]]) -> dict[str, Jagged]:
    """Join the ID columns of consecutive groups of records, given as ``(rows, ids)`` pairs.

    Every feature present in any part is in the result, in order of first appearance; a part
    without it contributes ``rows`` zero-length records, so every column has ``sum(rows)`` records.

    Raises:
        ValueError: a part's column does not have that part's ``rows`` records.
    """
    names = list(dict.fromkeys(name for _, ids in parts for name in ids))
    none: dict[int, np.ndarray] = {}  # rows -> offsets of that many records without IDs
    out = {}
    for name in names:
        values, offsets = [], []
        for rows, ids in parts:
            col = ids.get(name)
            if col is None:
                if rows not in none:
                    none[rows] = np.zeros(rows + 1, np.int64)
                offsets.append(none[rows])
            elif col.n != rows:
                raise ValueError(f"feature {name!r} has {col.n} records in a part of {rows}")
            else:
                values.append(col.values)
                offsets.append(col.offsets)
        out[name] = _join(values, offsets)
    return out


def _join(values: list[np.ndarray], offsets: list[np.ndarray]) -> Jagged:
    """One column of consecutive parts, given their values and offsets (each starting at 0).

    Vectorised over the parts: the lengths are the differences of all offsets put end to end,
    less the step from each part's last offset to the next part's first.
    """
    if not offsets:
        return Jagged.empty(0)
    flat = np.concatenate(values) if values else np.empty(0, np.int64)
    if len(offsets) == 1:
        return Jagged(flat, offsets[0].copy())
    steps = np.diff(np.concatenate(offsets))
    keep = np.ones(len(steps), bool)
    keep[np.cumsum(np.fromiter((len(o) for o in offsets[:-1]), np.int64, count=len(offsets) - 1)) - 1] = False
    joined = np.zeros(len(steps) - len(offsets) + 2, np.int64)
    np.cumsum(steps[keep], out=joined[1:])
    return Jagged(flat, joined)


def take_features(ids: Mapping[str, Jagged], rows: np.ndarray) -> dict[str, Jagged]:
    """:meth:`Jagged.take` of every column."""
    return {name: col.take(rows) for name, col in ids.items()}


def _describe(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.ndim}-D {a.dtype}"
    return type(a).__name__
