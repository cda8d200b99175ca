"""Training examples as sources hand them out: dense features, labels and categorical IDs, row for row."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .jagged import Jagged, concat_features, take_features

__all__ = ["Examples"]


@dataclass(frozen=True)
class Examples:
    """``n`` examples: what a source yields block by block and what :meth:`Source.read` returns.

    For examples without IDs, ``x, y = examples`` unpacks the dense pair, so code written before
    IDs existed (``x, y = load_source(spec).read()``) keeps working. Examples with IDs refuse to
    unpack (``TypeError``): read ``.x``, ``.y`` and ``.ids``, and no ID is dropped unnoticed.

    Raises:
        ValueError: the parts do not all have ``n`` rows.
    """

    x: np.ndarray
    """Dense features, float32 ``[n, d]`` (``d`` may be 0 when the examples carry only IDs)."""
    y: np.ndarray
    """Labels ``[n]``: int64 (classification) or float32 (regression)."""
    ids: dict[str, Jagged] = field(default_factory=dict)
    """Categorical features: name -> IDs of the ``n`` examples; empty for dense-only sources."""

    def __post_init__(self) -> None:
        if self.x.ndim != 2 or self.y.shape != (self.x.shape[0],):
            raise ValueError(f"examples need x [n, d] and y [n]; got x {self.x.shape}, y {self.y.shape}")
        bad = {name: col.n for name, col in self.ids.items() if col.n != self.x.shape[0]}
        if bad:
            raise ValueError(f"ID features {bad} do not have the {self.x.shape[0]} rows of x")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __iter__(self) -> Iterator[np.ndarray]:
        """``x, y = examples``, for examples without IDs only."""
        if self.ids:
            raise TypeError(f"these examples carry ID features ({', '.join(self.ids)}); unpacking into "
                            "(x, y) would drop them: read .x, .y and .ids")
        return iter((self.x, self.y))

    def slice(self, start: int, stop: int) -> Examples:
        """Examples ``start .. stop-1`` (views, no copy)."""
        return Examples(self.x[start:stop], self.y[start:stop],
                        {name: col.slice(start, stop) for name, col in self.ids.items()})

    def take(self, rows: np.ndarray) -> Examples:
        """The examples ``rows`` (integer indices or a boolean mask), in that order."""
        rows = np.asarray(rows)
        if rows.dtype == np.bool_ and self.ids:  # to indices once, not once per feature
            if rows.shape != (len(self),):
                raise ValueError(f"a mask must have {len(self)} entries, got shape {rows.shape}")
            rows = np.flatnonzero(rows)
        return Examples(self.x[rows], self.y[rows], take_features(self.ids, rows))

    @staticmethod
    def concat(parts: Sequence[Examples]) -> Examples:
        """The parts one after the other, in fresh arrays (even of one part); an ID feature missing
        from a part has zero IDs there.

        Raises:
            ValueError: no parts, or dense widths differ.
        """
        if not parts:
            raise ValueError("nothing to concatenate")
        ids = concat_features([(len(p), p.ids) for p in parts]) if any(p.ids for p in parts) else {}
        return Examples(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]), ids)
