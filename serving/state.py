"""What a replica serves: the job's model (dense module and row stores) at one feed position, and the
forward pass that scores a request from it.

:class:`ServedState` is one consistent state; :meth:`ServedState.apply` brings it forward by a run of
feed answers that ends at the head, in one synchronous step (no request sees half of it), and
:meth:`ServedState.lookup` / :func:`score` are a request's two halves (rows a bounded store lacks are
read between them). See docs/serving.md, *The serving replica*.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from services.tables import TableSpec
from services.tables.feed import DecodedChanges
from services.tables.rows import initial_rows
from trainers.models import ModelSpec
from trainers.tables import TableLookup, plan_lookups, pool

from .protocol import Batch, Signature
from .rowstore import RowStore

_CPU = torch.device("cpu")
DEDUPE_FROM = 32
"""Records from which a request's IDs are looked up once each (sorted) rather than as they come."""

__all__ = ["ServedState", "ModuleFactory", "Lookup", "Applied", "signature_of", "score"]


def _dense_width(spec: ModelSpec) -> int:
    """Columns of ``x`` the module takes."""
    width = getattr(spec.model, "dense", None)
    if isinstance(width, int) and not isinstance(width, bool):
        return width
    for m in spec.model.modules():
        if isinstance(m, nn.Linear):
            return int(m.in_features)
    raise ValueError(f"model spec {spec.name!r}: cannot tell how many dense features it takes (no 'dense' "
                     f"attribute and no nn.Linear)")


def signature_of(spec: ModelSpec, job: str, *, max_records: int) -> Signature:
    """What the model of ``spec`` takes and gives, in the protocol's terms.

    Raises:
        ValueError: the width of its dense input cannot be told.
    """
    if spec.binary:
        kind, classes = "binary", 0
    elif spec.classification:
        last = [m for m in spec.model.modules() if isinstance(m, nn.Linear)]
        kind, classes = "classes", int(last[-1].out_features) if last else 0
    else:
        kind, classes = "regression", 0
    return Signature(job=job, dense=_dense_width(spec), features=tuple(f for t in spec.tables for f in t.features),
                     kind=kind, classes=classes, max_records=max_records)


@dataclass(frozen=True)
class Applied:
    """What :meth:`ServedState.apply` changed."""

    upserts: int
    """Rows written."""
    removed: int
    """Rows removed (tombstones)."""
    dense: bool
    """The dense part was replaced."""
    entries: int
    """Feed entries the answers covered."""
    newest_applied_ms: int
    """Redis time of the newest entry covered (0: none)."""


@dataclass
class ServedState:
    """One state of the job's model as the replica serves it."""

    module: nn.Module
    """The dense part (in eval mode); replaced, never changed in place, when the feed brings a new one."""
    tables: dict[str, RowStore]
    """Table -> its rows (every row of the table, or with ``bounded`` the most recently used)."""
    specs: dict[str, TableSpec]
    """Table -> its spec (initial values, pooling)."""
    position: str
    """The feed position applied (the next read's ``since``)."""
    version: str
    """The groups' versions the state is at (the name a prediction carries)."""
    dense_version: str
    """The version of the dense part."""
    bounded: bool = False
    """Stores hold only the most recently used rows: an ID absent is read from the parameter plane."""
    misses: int = 0
    """Rows read from the parameter plane on a request (bounded stores only)."""
    source: str = "redis"
    """Where its rows were loaded from: ``redis`` (the replica's own export) or the export folder."""
    loaded: dict[str, int] = field(default_factory=dict)
    """Table -> rows loaded when the state was built."""

    def apply(self, answers: Iterable[DecodedChanges], module_for: ModuleFactory) -> Applied:
        """Apply a run of feed answers, oldest first (the last one at every group's head), in one step.

        ``module_for(tensors)`` builds a fresh dense module from a dense answer's tensors (a request
        holding the old one finishes with it)."""
        upserts = removed = entries = 0
        newest = 0
        dense: DecodedChanges | None = None
        last: DecodedChanges | None = None
        for answer in answers:
            for name, (ids, values, gone) in answer.tables.items():
                store = self.tables.get(name)
                if store is None:
                    continue
                versions = answer.versions.get(name)
                if versions is None:
                    versions = np.zeros(ids.size, np.uint64)
                if gone.size:
                    removed += store.remove(gone)
                if ids.size:
                    upserts += store.upsert(ids, values, versions, insert=not self.bounded)
            if answer.dense:
                dense = answer
            entries += int(answer.applied_ms.size)
            if answer.applied_ms.size:
                newest = max(newest, int(answer.applied_ms.max()))
            last = answer
        if dense is not None:
            self.module = module_for(dense.dense)
            self.dense_version = dense.dense_version or dense.version
        if last is not None:
            self.position, self.version = last.position, last.version
        return Applied(upserts, removed, dense is not None, entries, newest)

    def lookup(self, batch: Batch) -> Lookup:
        """The rows ``batch`` needs from this state (its module held with them); the IDs a bounded
        store lacks are left for the caller to read (:meth:`Lookup.fill`)."""
        # a few records: a row per ID as it comes (a sort costs more than repeats); many: each ID once
        lookups = plan_lookups(self.specs, batch.ids, batch.n, dedupe=batch.n >= DEDUPE_FROM)
        rows: dict[str, np.ndarray] = {}
        wanted: dict[str, np.ndarray] = {}
        for name, lk in lookups.items():
            out = np.empty((lk.ids.size, lk.spec.dim), dtype=np.float32)
            found = self.tables[name].gather(lk.ids, out) if lk.ids.size else np.zeros(0, bool)
            lacking = np.flatnonzero(~found)
            if lacking.size:
                if self.bounded:
                    wanted[name] = lacking
                else:  # every row is here: an ID without one has its initial value, as a trainer computes it
                    out[lacking] = initial_rows(lk.spec, lk.ids[lacking])
            rows[name] = out
        return Lookup(batch, self.module, lookups, rows, wanted, self.version)

    def insert_read(self, name: str, ids: np.ndarray, values: np.ndarray, versions: np.ndarray,
                    present: np.ndarray) -> None:
        """Keep the rows read from the parameter plane on a request that it has (``present``: an ID without
        a row is not kept, so the store never holds a row the plane lacks; never over newer ones)."""
        self.tables[name].upsert(ids[present], values[present], versions[present], insert=True)
        self.misses += int(ids.size)

    @property
    def rows(self) -> int:
        """Rows held, every table."""
        return sum(s.rows for s in self.tables.values())

    @property
    def nbytes(self) -> int:
        """Bytes the row stores hold allocated."""
        return sum(s.nbytes for s in self.tables.values())


class ModuleFactory:
    """Builds the served dense module from tensors: a fresh copy of the spec's module each time."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def __call__(self, tensors: Mapping[str, np.ndarray | torch.Tensor]) -> nn.Module:
        import copy
        module = copy.deepcopy(self.spec.model)
        module.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()})
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        return module


@dataclass
class Lookup:
    """A request's rows, read from one state."""

    batch: Batch
    module: nn.Module
    lookups: dict[str, TableLookup]
    rows: dict[str, np.ndarray]
    """Table -> ``[unique IDs, dim]`` float32."""
    wanted: dict[str, np.ndarray]
    """Table -> positions (in its lookup's IDs) of rows a bounded store lacked: read them, then :meth:`fill`."""
    version: str
    """The state's version."""

    def wanted_ids(self) -> dict[str, np.ndarray]:
        """Table -> the IDs to read from the parameter plane (each once, ascending)."""
        return {name: np.unique(self.lookups[name].ids[at]) for name, at in self.wanted.items()}

    def fill(self, name: str, ids: np.ndarray, values: np.ndarray) -> None:
        """The rows read for table ``name``: ``values`` of :meth:`wanted_ids`'s ``ids``, placed wherever the
        request names them."""
        at = self.wanted[name]
        self.rows[name][at] = values[np.searchsorted(ids, self.lookups[name].ids[at])]


def score(lookup: Lookup) -> np.ndarray:
    """The module's output for the request (logits, class logits or values)."""
    batch = lookup.batch
    with torch.inference_mode():
        x = torch.from_numpy(batch.x)
        if not lookup.lookups:
            return lookup.module(x).numpy()
        pooled, _ = pool(lookup.lookups, lookup.rows, _CPU, grad=False)
        return lookup.module(x, pooled).numpy()
