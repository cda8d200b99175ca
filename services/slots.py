"""What a job and a shard group hold in Redis: the parameter plane's data model as a layer of its own.

:mod:`common.keys` spells the names; this module owns what they hold: the one list of a group's keys
(:meth:`GroupSlot.state_keys`, which creating the model and restoring a checkpoint clear alike), the
readers that take the fields a caller names in one MULTI/EXEC of a slot and return them by name
(:class:`GroupSlot`, :class:`JobSlot`), and :func:`read_meta`, the one place that decides "no model yet"
(``NoModelError``). Once the model exists its meta's ``groups`` is the one group count (the config's
``ps_groups`` only seeds it). Why, and the data model itself: ``docs/parameter-plane.md`` (*Redis data model*).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import redis

from common.keys import GroupKeys, JobKeys

from .errors import LayoutError, NoModelError
from .protocol import own_shards
from .scripts import ScriptCall, execute_with_script

if TYPE_CHECKING:  # imported where used: reading the job's clocks (services.consistency) needs no torch
    from .layout import Layout
    from .optim import OptimizerConfig
    from .tables.spec import TableSpec

__all__ = ["ModelMeta", "read_meta", "SlotKey", "GroupSlot", "GroupRead", "JobSlot", "JobRead", "SHARD_HASHES",
           "JOB_HASHES", "GROUP_FIELDS", "JOB_FIELDS"]

SHARD_HASHES = ("versions", "bases", "delta_floors", "optimizer_steps")
"""A group's hashes keyed by shard index (their names in ``GroupKeys``; a checkpoint saves them by these names)."""
JOB_HASHES = ("offsets", "clocks", "applied_clocks", "audit_floor")
"""The job's hashes a checkpoint saves (their names in ``JobKeys``)."""
GROUP_FIELDS = ("version", "cursor", "persisted", "plan", *SHARD_HASHES, "table_stats", "shards", "optimizer",
                "deltas")
"""The fields :meth:`GroupSlot.read` reads by name."""
JOB_FIELDS = ("meta", "log", *JOB_HASHES, "unapplied", "group_accounted", "group_persisted", "applied_samples",
              "members")
"""The fields :meth:`JobSlot.read` reads by name."""


# -- the model's meta ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelMeta:
    """What ``meta`` holds: the layout, the optimizer and the number of server shard groups."""

    layout: Layout
    """Tensors and shards."""
    optimizer: OptimizerConfig
    """Server-side optimizer."""
    groups: int
    """Number of parameter-server shard groups (shard i belongs to group
    ``services.protocol.group_of(i, groups)``): the job's one group count once the model exists."""
    tables: tuple[TableSpec, ...] = ()
    """The model's embedding tables (rows live only in Redis; row ``id`` of a table belongs to group
    ``services.tables.group_of_ids([id], groups)``)."""

    def to_json(self) -> str:
        """Stored form (``tables`` only when the model has some: a dense model's meta is as before)."""
        from .tables.spec import tables_to_json
        raw = {"layout": json.loads(self.layout.to_json()), "optimizer": json.loads(self.optimizer.to_json()),
               "groups": self.groups}
        if self.tables:
            raw["tables"] = tables_to_json(self.tables)
        return json.dumps(raw, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelMeta:
        """Inverse of :meth:`to_json`."""
        from .layout import Layout
        from .optim import OptimizerConfig
        from .tables.spec import tables_from_json
        raw = json.loads(text)
        return cls(Layout.from_json(json.dumps(raw["layout"])),
                   OptimizerConfig(**raw["optimizer"]), int(raw["groups"]), tables_from_json(raw.get("tables", [])))

    def table(self, name: str) -> TableSpec:
        """The spec of embedding table ``name``.

        Raises:
            LayoutError: the model has no such table (names the ones it has).
        """
        for t in self.tables:
            if t.name == name:
                return t
        raise LayoutError(f"no embedding table {name!r} in the model (tables: {[t.name for t in self.tables]})")


def _meta_of(job: str, raw: bytes | str | None) -> ModelMeta:
    if raw is None:
        raise NoModelError(job)
    return ModelMeta.from_json(raw)


def read_meta(client: redis.Redis, job: str) -> ModelMeta:
    """The job's model meta.

    Raises:
        NoModelError: the job has no model in this Redis.
    """
    return _meta_of(job, cast("bytes | None", client.get(JobKeys(job).meta)))


# -- a group's slot --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SlotKey:
    """One key of a group's slot."""

    name: str
    """What it is: its attribute in ``GroupKeys`` and, for a shard's or table's, the index or table
    (``"shard:3"``, ``"opt:3:1"``, ``"table_rows:user"``)."""
    key: str
    """The key."""
    kind: str
    """Its Redis type: ``string``, ``hash`` or ``stream``."""


def _text(value: bytes | str | None) -> str:
    return "" if value is None else value.decode() if isinstance(value, bytes) else value


def _b2s(d: dict[bytes, bytes] | None) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in (d or {}).items()}


def _ints(d: dict[bytes, bytes] | None) -> dict[int, int]:
    return {int(k): int(v) for k, v in (d or {}).items()}


@dataclass(frozen=True)
class GroupRead:
    """What one MULTI/EXEC of a group's slot read (:meth:`GroupSlot.read`): the fields asked for; the
    others keep their empty defaults (:attr:`asked` names those read)."""

    group: int
    """The group."""
    asked: frozenset[str]
    """The fields read (of :data:`GROUP_FIELDS`, and ``blobs``, ``row_blobs``, ``shadowed_row_blobs``)."""
    version: int = 0
    """The group's version (0 before it has one)."""
    cursor: str = ""
    """The last update it applied ("" none)."""
    persisted: str = ""
    """The last update its persisted optimizer state includes ("" none)."""
    plan: bytes | None = None
    """Its ``unaccounted`` plan, as stored."""
    versions: dict[int, int] = field(default_factory=dict)
    """Shard -> the group version that last changed it."""
    bases: dict[int, int] = field(default_factory=dict)
    """Shard -> the group version its full bytes are as of."""
    delta_floors: dict[int, int] = field(default_factory=dict)
    """Shard -> every delta above this version is kept."""
    optimizer_steps: dict[int, int] = field(default_factory=dict)
    """Shard -> optimizer steps as of :attr:`persisted`."""
    table_stats: dict[str, str] = field(default_factory=dict)
    """``<table>:<counter>`` -> its value."""
    shards: dict[int, bytes | None] = field(default_factory=dict)
    """Shard -> its full bytes (None: missing), of the shards asked."""
    optimizer: dict[tuple[int, int], bytes | None] = field(default_factory=dict)
    """(shard, slot) -> its persisted optimizer state (None: none)."""
    deltas: dict[int, list[Any]] = field(default_factory=dict)
    """Shard -> its delta entries in the range asked, as XRANGE returns them (``services.deltas``)."""
    blobs: dict[tuple[str, int], bytes | None] = field(default_factory=dict)
    """(token, shard) -> the gradient blob, of those asked."""
    row_blobs: dict[str, bytes | None] = field(default_factory=dict)
    """token -> the row-gradient blob, of those asked."""
    shadowed_row_blobs: dict[str, bytes | None] = field(default_factory=dict)
    """token -> the row-gradient blob a table cut had the applies copy (``rows_blob_shadow``)."""
    reply: Any = None
    """The reply of the script call queued last in the same MULTI/EXEC (``call``), else None."""


class GroupSlot:
    """Shard group ``group`` of a job in Redis (hash tag ``{job:g<group>}``): its keys, and its fields
    read in one MULTI/EXEC.

    Args:
        client: a redis-py client (``services.store.connect``).
        keys: the group's keys.
        own: the shards the group owns (``services.protocol.own_shards``).
        opt_slots: optimizer state tensors per shard (``services.optim.slots``).
        tables: the model's embedding tables' names.
    """

    def __init__(self, client: redis.Redis, keys: GroupKeys, own: Iterable[int], opt_slots: int,
                 tables: Iterable[str] = ()) -> None:
        self.client = client
        self.keys = keys
        self.own = tuple(own)
        self.opt_slots = opt_slots
        self.tables = tuple(tables)

    @classmethod
    def of(cls, client: redis.Redis, job: str, meta: ModelMeta, group: int) -> GroupSlot:
        """Group ``group`` of ``job``'s model ``meta``."""
        from .optim import slots
        return cls(client, JobKeys(job).group(group), own_shards(meta.layout, meta.groups, group),
                   slots(meta.optimizer), [t.name for t in meta.tables])

    # -- its keys ----------------------------------------------------------------------------------
    def state_keys(self) -> list[SlotKey]:
        """Every key of the group's state (``docs/parameter-plane.md``, *each group's slot*), but those
        named by a push token: the gradient blobs (``GroupKeys.blobs_pattern``: deleted by the apply,
        the persist or the sweeper) and the staged values of an apply (renamed into place or deleted by
        it)."""
        gk = self.keys
        out = [SlotKey(n, getattr(gk, n), "string") for n in ("version", "cursor", "persisted", "unaccounted",
                                                              "table_cut", "feed_head")]
        out += [SlotKey(n, getattr(gk, n), "hash") for n in (*SHARD_HASHES, "table_stats", "rows_blob_shadow")]
        out.append(SlotKey("feed", gk.feed, "stream"))
        for i in self.own:
            out += [SlotKey(f"shard:{i}", gk.shard(i), "string"), SlotKey(f"deltas:{i}", gk.deltas(i), "stream")]
            out += [SlotKey(f"opt:{i}:{s}", gk.optimizer_state(i, s), "string") for s in range(self.opt_slots)]
        for t in self.tables:
            out += [SlotKey(f"{n}:{t}", getattr(gk, n)(t), "hash")
                    for n in ("table_rows", "table_seen", "table_shadow", "seen_shadow")]
        return out

    def clear(self, pipe: redis.client.Pipeline, *, restored: bool) -> None:
        """Queue on ``pipe`` (a MULTI/EXEC of the group's slot) what empties the group: every key of
        :meth:`state_keys` is deleted (the tables' hashes, possibly large, freed off Redis's main thread).
        The feed: a new model's starts over at position 0 (deleted with its head); a ``restored`` one is
        emptied and its head moved one past, so every position before the restore reads as gone."""
        keep = {self.keys.feed, self.keys.feed_head}
        large = [k.key for k in self.state_keys() if k.kind == "hash" and k.name.split(":")[0] in (
            "table_rows", "table_seen", "table_shadow", "seen_shadow", "rows_blob_shadow")]
        pipe.delete(*(k.key for k in self.state_keys() if k.key not in keep and k.key not in large))
        pipe.unlink(*large)
        if restored:
            pipe.xtrim(self.keys.feed, maxlen=0, approximate=False)
            pipe.incr(self.keys.feed_head)
        else:
            pipe.delete(*keep)

    # -- reading -----------------------------------------------------------------------------------
    def table_sizes(self, samples: int) -> dict[str, tuple[int, int]]:
        """Each table's rows (HLEN) and Redis's estimate of its rows hash's memory (MEMORY USAGE,
        ``samples`` fields sampled), in one round trip (not a transaction: an estimate)."""
        pipe = self.client.pipeline(transaction=False)
        for t in self.tables:
            pipe.hlen(self.keys.table_rows(t))
            pipe.memory_usage(self.keys.table_rows(t), samples=samples)
        got = iter(pipe.execute())
        return {t: (int(rows), int(size or 0)) for t, rows, size in zip(self.tables, got, got, strict=False)}

    def read(self, *fields: str, shards: Iterable[int] | None = None, deltas: Iterable[int] | None = None,
             after: int | None = None, upto: int | None = None, blobs: Sequence[tuple[str, int]] = (),
             row_blobs: Sequence[str] = (), shadowed_row_blobs: Sequence[str] = (),
             call: ScriptCall | None = None) -> GroupRead:
        """The ``fields`` (of :data:`GROUP_FIELDS`) of the group, in one MULTI/EXEC of its slot.

        ``shards``, ``optimizer`` and ``deltas`` are those of every shard the group owns; ``shards=`` and
        ``deltas=`` read those of the shards given instead (and imply the field). Deltas are the entries
        after version ``after`` up to ``upto`` (None: all). ``blobs`` ((token, shard) pairs), ``row_blobs``
        and ``shadowed_row_blobs`` (tokens) read those gradient blobs. ``call`` (a script call, e.g. the
        cut of the group's tables) is queued last in the same MULTI/EXEC; its reply is
        :attr:`GroupRead.reply`.

        Raises:
            ValueError: a field not of :data:`GROUP_FIELDS`.
        """
        unknown = sorted(set(fields) - set(GROUP_FIELDS))
        if unknown:
            raise ValueError(f"no group field {unknown[0]!r}; the fields are {', '.join(GROUP_FIELDS)}")
        gk, k = self.keys, self.opt_slots
        want_shards = list(self.own if shards is None else shards) if "shards" in fields or shards is not None else []
        want_deltas = list(self.own if deltas is None else deltas) if "deltas" in fields or deltas is not None else []
        want_opt = list(self.own) if "optimizer" in fields else []
        queued: list[str] = []

        def build(pipe: redis.client.Pipeline, sha: str | None = None) -> None:
            queued.clear()
            for name in ("version", "cursor", "persisted", "plan"):
                if name in fields:
                    pipe.get(gk.unaccounted if name == "plan" else getattr(gk, name))
                    queued.append(name)
            for name in (*SHARD_HASHES, "table_stats"):
                if name in fields:
                    pipe.hgetall(getattr(gk, name))
                    queued.append(name)
            for name, keys in (("shards", [gk.shard(i) for i in want_shards]),
                               ("optimizer", [gk.optimizer_state(i, s) for i in want_opt for s in range(k)]),
                               ("blobs", [gk.update_blob(t, i) for t, i in blobs]),
                               ("row_blobs", [gk.rows_blob(t) for t in row_blobs])):
                if keys:
                    pipe.mget(keys)
                    queued.append(name)
            if shadowed_row_blobs:
                pipe.hmget(gk.rows_blob_shadow, [gk.rows_blob(t) for t in shadowed_row_blobs])
                queued.append("shadowed_row_blobs")
            lo, hi = "-" if after is None else str(after + 1), "+" if upto is None else str(upto)
            for i in want_deltas:
                pipe.xrange(gk.deltas(i), min=lo, max=hi)
                queued.append("deltas")
            if call is not None:
                assert sha is not None, "a script call is queued with its sha"
                call.queue(pipe, sha)
                queued.append("reply")

        if call is None:
            pipe = self.client.pipeline(transaction=True)
            build(pipe)
            replies = pipe.execute()
        else:
            replies = execute_with_script(self.client, call.SCRIPT, build)
        got: dict[str, Any] = {}
        streams = []
        for name, value in zip(queued, replies, strict=True):
            if name == "deltas":
                streams.append(value)
            else:
                got[name] = value
        asked = {*fields, *(n for n in ("shards", "deltas") if n in queued)}
        asked |= {n for n, given in (("blobs", blobs), ("row_blobs", row_blobs),
                                     ("shadowed_row_blobs", shadowed_row_blobs)) if given}
        return GroupRead(
            group=gk.group, asked=frozenset(asked), version=int(got.get("version") or 0),
            cursor=_text(got.get("cursor")), persisted=_text(got.get("persisted")), plan=got.get("plan"),
            versions=_ints(got.get("versions")), bases=_ints(got.get("bases")),
            delta_floors=_ints(got.get("delta_floors")), optimizer_steps=_ints(got.get("optimizer_steps")),
            table_stats=_b2s(got.get("table_stats")),
            shards=dict(zip(want_shards, got.get("shards", []), strict=True)),
            optimizer={(i, s): got["optimizer"][j * k + s] for j, i in enumerate(want_opt) for s in range(k)},
            deltas=dict(zip(want_deltas, streams, strict=True)),
            blobs=dict(zip(blobs, got.get("blobs", []), strict=True)),
            row_blobs=dict(zip(row_blobs, got.get("row_blobs", []), strict=True)),
            shadowed_row_blobs=dict(zip(shadowed_row_blobs, got.get("shadowed_row_blobs", []), strict=True)),
            reply=got.get("reply"))


# -- the job's slot --------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobRead:
    """What one MULTI/EXEC of the job's slot read (:meth:`JobSlot.read`): the fields asked for; the
    others keep their empty defaults (:attr:`asked` names those read)."""

    job: str
    """The job."""
    asked: frozenset[str]
    """The fields read (of :data:`JOB_FIELDS`, and ``applied_by``)."""
    meta: bytes | None = None
    """The model's meta as stored (None: no model; :meth:`model` parses it)."""
    log: list[tuple[str, dict[bytes, bytes]]] = field(default_factory=list)
    """The update log's entries (id, fields)."""
    offsets: dict[str, str] = field(default_factory=dict)
    """Kafka partition -> the next offset to consume."""
    clocks: dict[str, str] = field(default_factory=dict)
    """Member -> the clock of its last push."""
    applied_clocks: dict[str, str] = field(default_factory=dict)
    """Member -> the highest clock of its updates applied by every group."""
    audit_floor: dict[str, str] = field(default_factory=dict)
    """Kafka partition -> the offset below which records are no longer accounted one by one."""
    unapplied: int = 0
    """Updates pushed and not yet accounted by every group."""
    group_accounted: dict[int, str] = field(default_factory=dict)
    """Group -> the last update whose accounting it recorded."""
    group_persisted: dict[int, str] = field(default_factory=dict)
    """Group -> the last update its persisted optimizer state includes."""
    applied_samples: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    """The ``applied_samples`` entries (id, fields)."""
    applied_by: dict[str, dict[str, str]] = field(default_factory=dict)
    """Update -> its ``applied_by`` hash, of the updates asked that have one."""
    members: frozenset[str] = frozenset()
    """The live members' ids (the coordinator's ``members``; the plane only reads them)."""

    def model(self) -> ModelMeta:
        """The model's meta read.

        Raises:
            NoModelError: the job had no model at the read.
        """
        return _meta_of(self.job, self.meta)


class JobSlot:
    """The job's slot in Redis (hash tag ``{job}``): its fields read in one MULTI/EXEC."""

    def __init__(self, client: redis.Redis, job: str) -> None:
        self.client = client
        self.keys = JobKeys(job)

    def read(self, *fields: str, applied_by: Sequence[str] = ()) -> JobRead:
        """The ``fields`` (of :data:`JOB_FIELDS`) and the ``applied_by`` hashes of the updates named, in
        one MULTI/EXEC of the job's slot.

        Raises:
            ValueError: a field not of :data:`JOB_FIELDS`.
        """
        unknown = sorted(set(fields) - set(JOB_FIELDS))
        if unknown:
            raise ValueError(f"no job field {unknown[0]!r}; the fields are {', '.join(JOB_FIELDS)}")
        keys = self.keys
        queued = [name for name in JOB_FIELDS if name in fields]
        pipe = self.client.pipeline(transaction=True)
        for name in queued:
            key = keys.update_log if name == "log" else getattr(keys, name)
            if name in ("log", "applied_samples"):
                pipe.xrange(key)
            elif name in ("meta", "unapplied"):
                pipe.get(key)
            elif name == "members":
                pipe.hkeys(key)
            else:
                pipe.hgetall(key)
        for eid in applied_by:
            pipe.hgetall(keys.applied_by(eid))
        replies = pipe.execute()
        got = dict(zip(queued, replies, strict=False))
        by = replies[len(queued):]
        return JobRead(
            job=keys.job, asked=frozenset({*fields, *(("applied_by",) if applied_by else ())}),
            meta=got.get("meta"), log=[(_text(eid), f) for eid, f in got.get("log", [])],
            offsets=_b2s(got.get("offsets")), clocks=_b2s(got.get("clocks")),
            applied_clocks=_b2s(got.get("applied_clocks")), audit_floor=_b2s(got.get("audit_floor")),
            unapplied=int(got.get("unapplied") or 0),
            group_accounted={int(g): v for g, v in _b2s(got.get("group_accounted")).items()},
            group_persisted={int(g): v for g, v in _b2s(got.get("group_persisted")).items()},
            applied_samples=[(_text(eid), _b2s(f)) for eid, f in got.get("applied_samples", [])],
            applied_by={eid: _b2s(h) for eid, h in zip(applied_by, by, strict=True) if h},
            members=frozenset(_text(m) for m in got.get("members", [])))
