"""A synthetic click stream shaped like Criteo, with a hidden logistic truth that drifts.

:class:`ClickStream` (the source ``clicks``) draws Zipf-distributed categorical IDs and N(0, 1) dense
features, and labels each record from a logistic truth (:meth:`ClickStream.logit`) that turns slowly
with the record index, so an online learner can follow it. Vectorised numpy over blocks of
:data:`BLOCK` records, each seeded by ``(seed, block)``. See docs/records.md, *The clicks source*.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from common.hashing import mix64

from .examples import Examples
from .jagged import Jagged
from .records import hash_id

__all__ = ["BIAS", "BLOCK", "CATEGORICAL_STD", "ClickStream", "zipf_ranks"]

BLOCK = 8192
"""Records generated per numpy pass."""

BIAS = -1.0
"""Intercept of the hidden logit (with the default options about 38 % of the records are clicks)."""

CATEGORICAL_STD = 1.5
"""Standard deviation of the categorical part of the hidden logit (the dense part's is about 1)."""

TAGS = "tags"
"""Name of the multi-hot feature."""

_S32 = np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)
_UNIT = math.sqrt(12.0) / 2.0 ** 32  # a uniform 32-bit integer times this, less sqrt(3): mean 0, variance 1


def zipf_ranks(rng: np.random.Generator, n: np.ndarray | int, exponent: float, size: tuple[int, ...]
               ) -> np.ndarray:
    """int64 ranks in ``1..n`` with ``P(k) ∝ k^-exponent``, exactly, by rejection-inversion.

    ``n`` broadcasts against ``size`` (one bound per row with ``n`` of shape ``[rows, 1]``).
    The method (Hörmann & Derflinger 1996, as in Apache Commons Math's ``ZipfDistribution``)
    inverts ``H(x) = ∫_1^x t^-exponent dt``, rounds to the nearest rank, accepts most draws by a
    cheap squeeze and the rest by the exact test, and draws again for the few it rejects.
    """
    if not exponent > 0:
        raise ValueError(f"the Zipf exponent must be > 0, got {exponent}")
    q = 1.0 - exponent

    def h_integral(x: np.ndarray) -> np.ndarray:
        log_x = np.log(x)
        return log_x if q == 0 else np.expm1(q * log_x) / q

    def h_integral_inverse(u: np.ndarray) -> np.ndarray:
        if q == 0:
            return np.exp(u)
        t = u * q  # x = (1 + u q)^(1/q)
        np.maximum(t, -1.0, out=t)  # rounding may push it just past the pole
        t += 1.0
        np.log(t, out=t)  # not log1p: 2-3x faster, and x is only rounded to the nearest rank
        t *= 1.0 / q
        return np.exp(t, out=t)

    bound = np.asarray(n, dtype=np.float64)
    lo = h_integral(np.array([1.5]))[0] - 1.0
    top = h_integral(bound + 0.5)
    squeeze = 2.0 - h_integral_inverse(h_integral(np.array([2.5])) - 2.0 ** -exponent)[0]

    def draw(u: np.ndarray, top: np.ndarray, bound: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u *= lo - top  # uniform in (lo, top]
        u += top
        x = h_integral_inverse(u)
        k = np.floor(x + 0.5)
        np.minimum(k, bound, out=k)
        np.maximum(k, 1.0, out=k)
        odd = np.flatnonzero(k - x > squeeze)  # outside the squeeze: the exact test decides
        kk, uu = k.flat[odd], u.flat[odd]
        return k, odd[uu < h_integral(kk + 0.5) - np.exp(-exponent * np.log(kk))]

    k, todo = draw(rng.random(size), top, bound)
    k_flat = k.reshape(-1)  # a view: k is fresh and contiguous
    top_flat = np.broadcast_to(top, size).reshape(-1) if todo.size else top
    bound_flat = np.broadcast_to(bound, size).reshape(-1) if todo.size else bound
    while todo.size:  # the rejected few, drawn again
        again, rejected = draw(rng.random(todo.size), top_flat[todo], bound_flat[todo])
        k_flat[todo] = again
        todo = todo[rejected]
    return k.astype(np.int64)


@dataclass(frozen=True)
class ClickStream:
    """The generator behind the ``clicks`` source; its model: docs/records.md, *The clicks source*."""

    features: int = 26
    """Single-valued categorical features ``c1 .. c<features>``."""
    dense: int = 13
    """Dense features."""
    vocab: int = 10_000_000
    """IDs in all, split evenly over the categorical features (``tags`` included)."""
    zipf: float = 1.1
    """Zipf exponent of every feature's ID popularity."""
    multi: int = 0
    """Most IDs of the multi-hot feature ``tags``; 0 leaves it out."""
    drift: float = 0.1
    """Radians the hidden truth turns every million records."""
    seed: int = 0
    """Seed of the draws and of the hidden truth."""

    def __post_init__(self) -> None:
        cats = self.features + (1 if self.multi else 0)
        if min(self.features, self.dense, self.multi, self.seed) < 0:
            raise ValueError("features, dense, multi and seed must be >= 0")
        if cats + self.dense == 0:
            raise ValueError("a click stream needs some features")
        if cats and not cats <= self.vocab < (1 << 40) * cats:
            raise ValueError(f"vocab={self.vocab} must be at least one ID per categorical feature "
                             f"({cats}) and under 2^40 per feature")
        if not self.zipf > 0 or not math.isfinite(self.drift):
            raise ValueError(f"zipf must be > 0 and drift finite, got zipf={self.zipf}, drift={self.drift}")

    @property
    def names(self) -> list[str]:
        """The categorical features, in order."""
        return [f"c{f + 1}" for f in range(self.features)] + ([TAGS] if self.multi else [])

    @property
    def sizes(self) -> np.ndarray:
        """int64 ``[features (+1)]``: IDs of each categorical feature (the first ones get the remainder)."""
        cats = len(self.names)
        base, extra = divmod(self.vocab, cats) if cats else (0, 0)
        return np.array([base + (f < extra) for f in range(cats)], np.int64)

    def ids_of(self, feature: int | np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """int64 IDs of the 1-based popularity ``ranks`` of categorical feature number ``feature``
        (0-based; an array broadcasts against ``ranks``)."""
        key = (np.asarray(feature, dtype=np.uint64) + np.uint64(1)) << np.uint64(40)
        return mix64((np.asarray(ranks, dtype=np.uint64) - np.uint64(1)) | key).view(np.int64)

    def _dense_weights(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng((self.seed, 1 << 32))
        w = rng.standard_normal((2, self.dense)) / math.sqrt(max(self.dense, 1))
        return w[0].astype(np.float32), w[1].astype(np.float32)

    def _id_weights(self, name: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        salt = np.uint64(hash_id(f"{self.seed}/{name}") & 0xFFFF_FFFF_FFFF_FFFF)
        h = mix64(ids.view(np.uint64) ^ salt)
        a = (h >> _S32).astype(np.float64) * _UNIT - math.sqrt(3.0)
        b = (h & _LOW32).astype(np.float64) * _UNIT - math.sqrt(3.0)
        return a, b

    def logit(self, start: int, x: np.ndarray, ids: Mapping[str, Jagged]) -> np.ndarray:
        """float64 ``[n]``: the hidden truth's logit of records ``start .. start+n-1`` given their
        dense features ``x`` and ``ids`` (all of :attr:`names`)."""
        n = len(x)
        phi = self.drift * 1e-6 * np.arange(start, start + n, dtype=np.float64)
        cos, sin = np.cos(phi), np.sin(phi)
        sum_a, sum_b = np.zeros(n), np.zeros(n)
        for name in self.names:
            col = ids[name]
            a, b = self._id_weights(name, col.values)
            if name == TAGS:  # the mean over the record's tags, 0 without any
                rows, per = col.row_ids(), np.maximum(col.lengths, 1)
                a = np.bincount(rows, a, minlength=n) / per
                b = np.bincount(rows, b, minlength=n) / per
            sum_a += a
            sum_b += b
        scale = CATEGORICAL_STD / math.sqrt(len(self.names)) if self.names else 0.0
        logit = BIAS + scale * (cos * sum_a + sin * sum_b)
        if self.dense:
            v_a, v_b = self._dense_weights()
            logit += cos * (x @ v_a) + sin * (x @ v_b)
        return logit

    def block(self, index: int) -> Examples:
        """The :data:`BLOCK` records of block ``index`` (records ``index * BLOCK`` on)."""
        n = BLOCK
        rng = np.random.default_rng((self.seed, index))
        x = rng.standard_normal((n, self.dense), dtype=np.float32)
        sizes = self.sizes
        ids: dict[str, Jagged] = {}
        if self.features:
            ranks = zipf_ranks(rng, sizes[:self.features, None], self.zipf, (self.features, n))
            values = self.ids_of(np.arange(self.features)[:, None], ranks)  # [features, n], rows contiguous
            single = np.arange(n + 1, dtype=np.int64)  # one ID per record, shared by the columns
            for f in range(self.features):
                ids[f"c{f + 1}"] = Jagged(values[f], single)
        if self.multi:
            lengths = rng.integers(0, self.multi, size=n, endpoint=True)
            ranks = zipf_ranks(rng, int(sizes[-1]), self.zipf, (int(lengths.sum()),))
            ids[TAGS] = Jagged.from_lengths(self.ids_of(self.features, ranks), lengths)
        p = 1.0 / (1.0 + np.exp(-self.logit(index * BLOCK, x, ids)))
        y = (rng.random(n) < p).astype(np.int64)
        return Examples(x, y, ids)

    def blocks(self, limit: int | None = None) -> Iterator[tuple[int, Examples]]:
        """``(first record, examples)`` block after block, ``limit`` records in all (``None``: forever)."""
        index = 0
        while limit is None or index * BLOCK < limit:
            block = self.block(index)  # always whole, so a record does not depend on the limit
            if limit is not None and (index + 1) * BLOCK > limit:
                block = block.slice(0, limit - index * BLOCK)
            yield index * BLOCK, block
            index += 1
