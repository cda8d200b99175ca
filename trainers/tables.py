"""A trainer's side of embedding tables: the rows a batch needs, fetched, pooled, and their
gradients sent back as rows.

Per step and table, :func:`plan_lookups` deduplicates the batch's IDs, :class:`RowFetcher` serves what the
row cache may and pulls the rest in one round trip per group, :func:`pool` pools each feature's records
from one leaf tensor with ``embedding_bag``, and :func:`row_gradients` sends that leaf's gradient: exactly
the batch's unique rows. See docs/embeddings.md, *Pull, push, apply*.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import torch

from datastream.jagged import Jagged
from services.consistency import Consistency, required_clock
from services.tables import RowGrads, TableSpec, group_of_ids
from services.tables.store import pull_rows

from .rowcache import RowCache, TableBound

__all__ = ["FeatureLookup", "TableLookup", "plan_lookups", "sort_pairs", "RowFetcher", "Fetched", "pool",
           "row_gradients", "wait_consistency", "table_required", "table_inputs"]


@dataclass(frozen=True)
class FeatureLookup:
    """One feature's records, as positions among its table's unique IDs."""

    feature: str
    index: np.ndarray
    """int64 ``[nnz]``: each ID's position in :attr:`TableLookup.ids`, record after record."""
    offsets: np.ndarray
    """int64 ``[n]``: where each record's IDs start in ``index``."""


@dataclass(frozen=True)
class TableLookup:
    """The rows of one table a batch needs."""

    spec: TableSpec
    ids: np.ndarray
    """Unique IDs, sorted (int64)."""
    features: tuple[FeatureLookup, ...]
    owners: np.ndarray | None = None
    """The shard group of each of :attr:`ids` (``services.tables.group_of_ids``), computed once
    for the pull and the push of the step."""


def plan_lookups(tables: Mapping[str, TableSpec], ids: Mapping[str, Jagged], n: int, *,
                 groups: int | None = None, dedupe: bool = True) -> dict[str, TableLookup]:
    """The lookups of a batch of ``n`` records with categorical features ``ids`` (a feature the batch
    lacks has no ID in any record, and pools to zeros); with ``groups``, each ID's shard group too.
    ``dedupe=False`` (serving: no gradient to gather per row) skips the sort: a table's ``ids`` are
    its features' IDs as they come, repeats included.

    Raises:
        ValueError: a feature's column does not have ``n`` records.
    """
    out = {}
    planned = []
    for name, spec in tables.items():
        columns = []
        for f in spec.features:
            col = ids.get(f)
            if col is None:
                col = Jagged.empty(n)
            elif col.n != n:
                raise ValueError(f"feature {f!r} has {col.n} records, the batch {n}")
            columns.append((f, col))
        planned.append((name, spec, columns))
    parts = [c.values for _, _, columns in planned for _, c in columns]
    values = np.concatenate(parts).astype(np.int64, copy=False) if parts else np.empty(0, np.int64)
    sizes = [sum(c.nnz for _, c in columns) for _, _, columns in planned]
    starts = np.zeros(len(planned) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    if dedupe:  # one sort for every table: by table, then ID
        order, first = sort_pairs(np.repeat(np.arange(len(planned)), sizes), values)
        unique = values[order][first]
        inverse = np.empty(values.size, dtype=np.int64)
        inverse[order] = np.cumsum(first) - 1
        bounds = np.concatenate(([0], np.cumsum(first)))[starts]
    else:
        unique, inverse, bounds = values, np.arange(values.size, dtype=np.int64), starts
    owners = None if groups is None else group_of_ids(unique, groups)
    for i, (name, spec, columns) in enumerate(planned):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        feats, at = [], int(starts[i])
        for f, col in columns:
            feats.append(FeatureLookup(f, inverse[at:at + col.nnz] - lo, col.offsets[:-1]))
            at += col.nnz
        out[name] = TableLookup(spec, unique[lo:hi], tuple(feats), None if owners is None else owners[lo:hi])
    return out


def sort_pairs(tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The order that sorts the (table number, ID) pairs by table, then by ID, and which of the sorted
    pairs start a run of equal ones (bool): one sort for all of a step's tables, not one per table."""
    order = np.argsort(ids)
    small = tables.astype(np.int16 if tables.size == 0 or tables.max() < 2 ** 15 else np.int64)
    order = order[np.argsort(small[order], kind="stable")]  # a radix sort: 16-bit keys
    t, v = small[order], ids[order]
    first = np.ones(v.size, dtype=bool)
    first[1:] = (v[1:] != v[:-1]) | (t[1:] != t[:-1])
    return order, first


@dataclass(frozen=True)
class Fetched:
    """The rows one step fetched."""

    rows: dict[str, np.ndarray]
    """Table -> ``[len(ids), dim]`` float32, in the order of its lookup's IDs."""
    hits: int
    """Rows the cache served."""
    pulled: int
    """Rows pulled from the parameter plane."""
    wire_bytes: int
    """Bytes the pull read."""


class RowFetcher:
    """Fetches the rows of a batch's lookups for job ``job``: the cache first, the rest in one pull."""

    def __init__(self, client: redis.Redis, job: str, tables: Mapping[str, TableSpec], groups: int,
                 cache: RowCache) -> None:
        self.client = client
        self.job = job
        self.tables = dict(tables)
        self.groups = groups
        self.cache = cache
        self.pulled_bytes = 0
        """Bytes the pulls of :meth:`fetch` read since this fetcher was made."""

    def fetch(self, lookups: Mapping[str, TableLookup], *, clock: int, bound: TableBound,
              required: int | None, covers: int) -> Fetched:
        """The rows for a step at ``clock``: a cached row only while ``bound`` allows (``required``:
        under BSP/SSP, the applied clock the rows must cover); the others pulled, and cached as read
        after a wait that observed ``covers`` (every live member's updates up to it are applied)."""
        rows: dict[str, np.ndarray] = {}
        wanted: dict[str, np.ndarray] = {}
        misses: dict[str, np.ndarray] = {}
        hits = 0
        served = self.cache.lookup_all({name: lk.ids for name, lk in lookups.items()}, clock=clock, bound=bound,
                                       required=required)
        for name, lk in lookups.items():
            hit, out = served[name]  # the cached rows in place: the misses filled below
            if out.shape[1] != lk.spec.dim:  # a table the cache does not hold
                out = np.empty((lk.ids.size, lk.spec.dim), dtype=np.float32)
            rows[name] = out
            hits += int(hit.sum())
            miss = np.flatnonzero(~hit)
            if miss.size:
                misses[name] = miss
                wanted[name] = lk.ids[miss]
        wire = 0
        if wanted:
            owners = {name: owned[miss] if (owned := lookups[name].owners) is not None
                      else group_of_ids(wanted[name], self.groups) for name, miss in misses.items()}
            pulled = pull_rows(self.client, self.job, self.tables, self.groups, wanted, owners=owners)
            wire = pulled.wire_bytes
            self.pulled_bytes += wire
            versions = np.zeros(self.groups, dtype=np.int64)  # each row's read: as of its group's version
            for g, v in pulled.group_versions.items():
                versions[g] = v
            for name, miss in misses.items():
                rows[name][miss] = pulled.tables[name].values
            self.cache.insert_all({name: (got.ids, got.values, versions[owners[name]])
                                   for name, got in pulled.tables.items()}, clock=clock, covers=covers)
        return Fetched(rows, hits, sum(m.size for m in misses.values()), wire)

    def pull(self, wanted: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The rows of ``wanted`` (table -> IDs) as they are now, past the cache (evaluation)."""
        pulled = pull_rows(self.client, self.job, self.tables, self.groups, wanted)
        return {name: got.values for name, got in pulled.tables.items()}


def wait_consistency(dense: Consistency, tables: TableBound | None) -> Consistency:
    """The bound a step's clock wait enforces: the stricter of the dense part's and, when the
    model has tables under BSP or SSP, theirs (tables under ASP never wait on others)."""
    if tables is None or tables.mode == "asp":
        return dense
    table = Consistency(tables.mode, tables.staleness)
    if dense.mode == "asp":
        return table
    s_dense = 0 if dense.mode == "bsp" else dense.staleness
    s_table = 0 if table.mode == "bsp" else table.staleness
    return dense if s_dense <= s_table else table


def table_required(bound: TableBound, clock: int) -> int | None:
    """The applied clock a row must cover to be used at ``clock`` under ``bound`` (None under ASP)."""
    return required_clock(Consistency(bound.mode, bound.staleness), clock)


def table_inputs(tables: Mapping[str, TableSpec], ids: Mapping[str, Jagged],
                 pull: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], device: torch.device
                 ) -> Callable[[int, int], tuple[dict[str, torch.Tensor]]]:
    """``inputs(start, stop)`` for ``trainers.evaluate``: the pooled rows of records ``start:stop``
    of held-out categorical features ``ids``, their rows read with ``pull`` (table -> IDs -> rows)."""
    def inputs(start: int, stop: int) -> tuple[dict[str, torch.Tensor]]:
        part = {f: col.slice(start, stop) for f, col in ids.items()}
        lookups = plan_lookups(tables, part, stop - start)
        pooled, _ = pool(lookups, pull({name: lk.ids for name, lk in lookups.items()}), device)
        return (pooled,)
    return inputs


def pool(lookups: Mapping[str, TableLookup], rows: Mapping[str, np.ndarray], device: torch.device, *,
         grad: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, _Rows]]:
    """Each feature's rows pooled per record, and the leaf tensors they were pooled from (on
    ``device``, requiring grad unless ``grad=False``): (feature -> ``[n, dim]``, table -> its
    ``[ids, dim]`` rows, views of the leaf).

    Tables of one dimension and pooling share one leaf and one ``embedding_bag`` call (their rows
    stacked, each feature's bags one after the other), so a step with 26 tables runs one kernel, not
    26, forward and backward."""
    kinds: dict[tuple[int, str], list[TableLookup]] = {}
    for lk in lookups.values():
        kinds.setdefault((lk.spec.dim, lk.spec.pooling), []).append(lk)
    pooled: dict[str, torch.Tensor] = {}
    leaves: dict[str, _Rows] = {}
    for (_, mode), group in kinds.items():
        base, at = 0, 0
        index: list[np.ndarray] = []
        offsets: list[np.ndarray] = []
        feats: list[str] = []
        for lk in group:
            for f in lk.features:
                index.append(f.index + base)
                offsets.append(f.offsets + at)
                at += f.index.size
                feats.append(f.feature)
            base += lk.ids.size
        stacked = np.concatenate([rows[lk.spec.name] for lk in group]) if len(group) > 1 else rows[group[0].spec.name]
        leaf = torch.from_numpy(stacked).to(device, non_blocking=True)
        if grad:
            leaf.requires_grad_()
        out = torch.nn.functional.embedding_bag(
            torch.from_numpy(np.concatenate(index)).to(device, non_blocking=True), leaf,
            torch.from_numpy(np.concatenate(offsets)).to(device, non_blocking=True), mode=mode)
        n = out.shape[0] // max(len(feats), 1)
        for j, feature in enumerate(feats):
            pooled[feature] = out[j * n:(j + 1) * n]
        start = 0
        for lk in group:
            leaves[lk.spec.name] = _Rows(leaf, start, start + lk.ids.size)
            start += lk.ids.size
    return pooled, leaves


class _Rows:
    """Rows ``start:stop`` of a shared leaf: one table's part of it."""

    def __init__(self, leaf: torch.Tensor, start: int, stop: int) -> None:
        self.leaf, self.start, self.stop = leaf, start, stop

    @property
    def grad(self) -> torch.Tensor | None:
        g = self.leaf.grad
        return None if g is None else g[self.start:self.stop]


def row_gradients(lookups: Mapping[str, TableLookup], leaves: Mapping[str, Any],
                  dtype: torch.dtype = torch.float32) -> list[RowGrads]:
    """The gradient rows the backward pass left on ``leaves``, one part per table that has any, cast to
    ``dtype`` where they are (on the GPU: only the cast ``[ids, dim]`` rows cross to the host)."""
    out = []
    for name, lk in lookups.items():
        grad = leaves[name].grad
        if grad is None or lk.ids.size == 0:
            continue
        out.append(RowGrads(name, lk.ids, grad.detach().to(dtype).cpu().numpy(), lk.owners))
    return out
