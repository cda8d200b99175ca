"""The feed of row changes: what a serving system that keeps a copy of the tables follows.

Each group's changelog (``GroupKeys.feed``) is appended by ``lua/apply.lua`` and ``lua/rows_sweep.lua``
in the step that changes the rows; :func:`read_group` and :func:`read_changes` answer the entries after
a feed position with each row they name as it is now (upsert or tombstone), and
:func:`changes_to_safetensors` / :func:`changes_from_safetensors` carry the answer on the wire.
See docs/serving.md, *Following the tables row by row*.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import redis
from safetensors.numpy import load as _load_safetensors
from safetensors.numpy import save as _save_safetensors

from common.keys import JobKeys

from ..errors import LayoutError, ParameterPlaneError
from ..scripts import FeedReadCall, execute_with_script
from ..slot_types import VersionVector
from .rows import decode_values, ids_from_bytes, pull_dtype
from .spec import TableSpec

__all__ = ["TableChanges", "GroupChanges", "Changes", "FeedError", "FeedGoneError", "FeedAheadError",
           "read_group", "read_changes", "feed_heads", "feed_oldest",
           "changes_to_safetensors", "changes_from_safetensors", "FEED_LIMIT", "FEED_MOST_ROWS"]

FEED_LIMIT = 256
"""Most entries one read of a group takes unless asked otherwise."""
FEED_MOST_ROWS = 65536
"""One read of a group stops after the entry that brings the IDs it names to this many (each ID costs
Redis a few string operations, and the answer holds its row)."""


class FeedError(ParameterPlaneError):
    """Base of the feed's refusals."""


class FeedGoneError(FeedError):
    """Some group's entries after the position asked are no longer all kept (trimmed, or a checkpoint
    was restored since): a copy cannot be brought up to date from the feed; reload the tables (an
    export names the position to follow from) or start from ``oldest``."""

    def __init__(self, message: str, *, oldest: tuple[int, ...], head: tuple[int, ...]) -> None:
        super().__init__(message)
        self.oldest = oldest
        """Per group, the oldest position the feed answers now (the one before its oldest entry)."""
        self.head = head
        """Per group, its newest position."""


class FeedAheadError(FeedError):
    """Some group's position asked is past its newest (another job's position, or a job created anew)."""

    def __init__(self, message: str, *, head: tuple[int, ...]) -> None:
        super().__init__(message)
        self.head = head
        """Per group, its newest position."""


@dataclass(frozen=True)
class TableChanges:
    """One table's changes in a read: the rows named, as they are now."""

    ids: np.ndarray
    """int64: the IDs that have a row (upserts)."""
    values: np.ndarray
    """float32 ``[len(ids), dim]``: their values."""
    versions: np.ndarray
    """uint64: the group version that last wrote each of them."""
    removed: np.ndarray
    """int64: the IDs named that have no row now (tombstones: expired or evicted)."""


@dataclass(frozen=True)
class GroupChanges:
    """What one read of a group's feed returned (:func:`read_group`)."""

    since: int
    """The position asked."""
    position: int
    """The position reached (the last entry read; ``since`` when there was none)."""
    head: int
    """The group's newest position at the read (``position < head``: more to read)."""
    version: int
    """The group's version at the read (every row returned is as that version, or a sweep after it,
    left it)."""
    dense: bool
    """An entry read changed the group's dense shards."""
    applied_ms: np.ndarray
    """int64: each entry's Redis time (ms since the epoch) when its apply or sweep ran."""
    tables: dict[str, TableChanges]
    """Table -> its changes (every table of the model, possibly empty)."""


@dataclass(frozen=True)
class Changes:
    """What one read of every group's feed returned (:func:`read_changes`)."""

    since: tuple[int, ...]
    """The position asked, per group."""
    position: tuple[int, ...]
    """The position reached, per group (the next ``since``)."""
    head: tuple[int, ...]
    """Each group's newest position at its read."""
    version: tuple[int, ...]
    """Each group's version at its read."""
    dense: bool
    """Some group's dense shards changed in the range."""
    applied_ms: np.ndarray
    """int64: the Redis time of each entry read (all groups)."""
    tables: dict[str, TableChanges]
    """Table -> its changes over every group (the groups hold disjoint IDs)."""

    @property
    def more(self) -> bool:
        """Some group has entries past the position reached: read again at once."""
        return any(p < h for p, h in zip(self.position, self.head, strict=True))

    @property
    def empty(self) -> bool:
        """No entry was read."""
        return self.position == self.since


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def read_group(client: redis.Redis, job: str, group: int, tables: Sequence[TableSpec], since: int, *,
               limit: int = FEED_LIMIT, most_rows: int = FEED_MOST_ROWS) -> GroupChanges:
    """The entries of ``group``'s feed after position ``since`` (at most ``limit``, fewer once they name
    ``most_rows`` IDs; at least one), and the rows they name as they are now, in one script call.

    Raises:
        FeedGoneError: the entries after ``since`` are no longer all kept.
        FeedAheadError: ``since`` is past the group's newest position.
        LayoutError: a reply that does not fit the tables.
    """
    call = FeedReadCall(JobKeys(job).group(group), since, limit, most_rows,
                        [(t.name, pull_dtype(t).itemsize) for t in tables])
    res = execute_with_script(client, call.SCRIPT, call.queue)[-1]
    tag = _text(res[0])
    if tag == "AHEAD":
        head = int(res[1])
        raise FeedAheadError(f"job {job} group {group}: feed position {since} is past the newest, {head}",
                             head=(head,))
    if tag == "GONE":
        oldest, head = int(res[1]), int(res[2])
        raise FeedGoneError(f"job {job} group {group}: the feed no longer holds every entry after position {since}; "
                            f"the oldest position it answers is {oldest} (newest {head})", oldest=(oldest,),
                            head=(head,))
    out = {}
    for j, spec in enumerate(tables):
        ids, records, removed = res[6 + 3 * j:9 + 3 * j]
        rows = np.frombuffer(records, dtype=pull_dtype(spec))
        if rows.size * 8 != len(ids):
            raise LayoutError(f"job {job} group {group}: table {spec.name}: {len(ids) // 8} IDs for {rows.size} rows")
        out[spec.name] = TableChanges(ids_from_bytes(ids), decode_values(spec, rows["values"]), rows["version"],
                                      ids_from_bytes(removed))
    return GroupChanges(since, int(res[1]), int(res[4]), int(res[2]), bool(int(res[3])),
                        np.array([int(x) for x in res[5]], dtype=np.int64), out)


def feed_heads(client: redis.Redis, job: str, groups: int) -> tuple[int, ...]:
    """Each group's newest feed position (0 when it has none): where a copy read now continues from."""
    pipe = client.pipeline(transaction=False)
    for g in range(groups):
        pipe.get(JobKeys(job).group(g).feed_head)
    return tuple(int(cast("bytes | None", v) or 0) for v in pipe.execute())


def feed_oldest(client: redis.Redis, job: str, groups: int) -> tuple[int, ...]:
    """Each group's oldest position the feed answers now (the one before its oldest entry kept; its
    newest when it keeps none). Reads one entry per group: for error messages, not for every read."""
    heads = feed_heads(client, job, groups)
    out = []
    for g, head in enumerate(heads):
        first = client.xrange(JobKeys(job).group(g).feed, count=1)
        out.append(int(_text(first[0][0]).split("-")[0]) - 1 if first else head)
    return tuple(out)


def read_changes(client: redis.Redis, job: str, tables: Sequence[TableSpec], since: Sequence[int], *,
                 limit: int = FEED_LIMIT, most_rows: int = FEED_MOST_ROWS) -> Changes:
    """:func:`read_group` of every group (``since``: one position per group), merged.

    Raises:
        FeedGoneError, FeedAheadError: for the job as a whole (``oldest`` and ``head`` name every
            group's), when some group refuses its position.
    """
    reads = []
    for g, p in enumerate(since):
        try:
            reads.append(read_group(client, job, g, tables, p, limit=limit, most_rows=most_rows))
        except FeedAheadError:
            heads = feed_heads(client, job, len(since))
            raise FeedAheadError(f"job {job}: feed position {VersionVector(since).name()} is past the newest, "
                                 f"{VersionVector(heads).name()}", head=heads) from None
        except FeedGoneError:
            oldest, heads = feed_oldest(client, job, len(since)), feed_heads(client, job, len(since))
            raise FeedGoneError(f"job {job}: the feed no longer holds every change after position "
                                f"{VersionVector(since).name()}; the oldest position it answers is "
                                f"{VersionVector(oldest).name()} (newest {VersionVector(heads).name()}): "
                                f"load the tables "
                                f"(an export names its position) and follow from there", oldest=oldest,
                                head=heads) from None
    merged = {}
    for spec in tables:
        parts = [r.tables[spec.name] for r in reads]
        merged[spec.name] = TableChanges(
            np.concatenate([p.ids for p in parts]) if parts else np.zeros(0, np.int64),
            np.concatenate([p.values for p in parts]) if parts else np.zeros((0, spec.dim), np.float32),
            np.concatenate([p.versions for p in parts]) if parts else np.zeros(0, np.uint64),
            np.concatenate([p.removed for p in parts]) if parts else np.zeros(0, np.int64))
    return Changes(tuple(since), tuple(r.position for r in reads), tuple(r.head for r in reads),
                   tuple(r.version for r in reads), any(r.dense for r in reads),
                   np.concatenate([r.applied_ms for r in reads]) if reads else np.zeros(0, np.int64), merged)


# -- on the wire -----------------------------------------------------------------------------------

_SUFFIXES = ("ids", "values", "versions", "removed")


def changes_to_safetensors(changes: Changes, *, job: str, dense: Mapping[str, np.ndarray] | None = None,
                           dense_version: Sequence[int] | None = None) -> bytes:
    """``changes`` as the safetensors file ``GET /v1/model/updates`` answers: per table
    ``<table>.ids``, ``<table>.values``, ``<table>.removed``; ``dense`` (parameter name -> float32
    values, at ``dense_version``) when given. Metadata: ``streamtrain.job``, ``streamtrain.feed.since``,
    ``streamtrain.feed.position``, ``streamtrain.feed.head``, ``streamtrain.version`` (the groups'
    versions at the read), ``streamtrain.feed.applied_ms`` (each entry's time, comma-separated) and,
    with dense tensors, ``streamtrain.dense_version``.

    Raises:
        ValueError: a dense parameter's name is one of a table's tensors.
    """
    tensors: dict[str, np.ndarray] = {}
    for name, t in changes.tables.items():
        tensors[f"{name}.ids"] = np.ascontiguousarray(t.ids, dtype=np.int64)
        tensors[f"{name}.values"] = np.ascontiguousarray(t.values, dtype=np.float32)
        tensors[f"{name}.versions"] = np.ascontiguousarray(t.versions, dtype=np.uint64)
        tensors[f"{name}.removed"] = np.ascontiguousarray(t.removed, dtype=np.int64)
    metadata = {"format": "pt", "streamtrain.job": job, "streamtrain.feed.since": VersionVector(changes.since).name(),
                "streamtrain.feed.position": VersionVector(changes.position).name(),
                "streamtrain.feed.head": VersionVector(changes.head).name(),
                "streamtrain.version": VersionVector(changes.version).name(),
                "streamtrain.feed.applied_ms": ",".join(str(int(x)) for x in changes.applied_ms)}
    if dense is not None:
        for name, values in dense.items():
            if name in tensors:
                raise ValueError(f"dense parameter {name!r} has the name of a table's tensor")
            tensors[name] = np.ascontiguousarray(values, dtype=np.float32)
        metadata["streamtrain.dense_version"] = VersionVector(dense_version or ()).name()
    return _save_safetensors(tensors, metadata=metadata)


@dataclass(frozen=True)
class DecodedChanges:
    """A ``GET /v1/model/updates`` answer, read back (:func:`changes_from_safetensors`)."""

    position: str
    """The position reached: the next ``since``."""
    head: str
    """Each group's newest position at the read."""
    version: str
    """The groups' versions at the read."""
    applied_ms: np.ndarray
    """int64: each entry's Redis time."""
    tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Table -> (IDs with a row, their values, IDs without one)."""
    dense: dict[str, np.ndarray]
    """The dense tensors by parameter name (empty when no shard changed in the range)."""
    dense_version: str | None
    """The version of ``dense`` (None without)."""
    versions: dict[str, np.ndarray] = field(default_factory=dict)
    """Table -> uint64: the group version that last wrote each upserted row (in the order of its IDs;
    absent from an answer of a coordinator older than this field)."""

    @property
    def more(self) -> bool:
        """Some group has entries past the position reached."""
        return self.position != self.head


def changes_from_safetensors(body: bytes) -> DecodedChanges:
    """Read an answer of ``GET /v1/model/updates`` (what :func:`changes_to_safetensors` wrote).

    Raises:
        ValueError: ``body`` is not such a file.
    """
    if len(body) < 8:
        raise ValueError(f"not a safetensors file ({len(body)} bytes)")
    n = int.from_bytes(body[:8], "little")
    meta = json.loads(body[8:8 + n]).get("__metadata__") or {}
    if "streamtrain.feed.position" not in meta:
        raise ValueError("not an answer of /v1/model/updates: no streamtrain.feed.position in its metadata")
    tensors = _load_safetensors(body)
    tables = {}
    for key in tensors:
        if key.endswith(".removed"):
            name = key[:-len(".removed")]
            tables[name] = (tensors[f"{name}.ids"], tensors[f"{name}.values"], tensors[key])
    table_keys = {f"{name}.{s}" for name in tables for s in _SUFFIXES}
    ms = meta.get("streamtrain.feed.applied_ms", "")
    return DecodedChanges(meta["streamtrain.feed.position"], meta["streamtrain.feed.head"],
                          meta["streamtrain.version"],
                          np.array([int(x) for x in ms.split(",") if x], dtype=np.int64), tables,
                          {k: v for k, v in tensors.items() if k not in table_keys},
                          meta.get("streamtrain.dense_version"),
                          {name: tensors[f"{name}.versions"] for name in tables if f"{name}.versions" in tensors})
