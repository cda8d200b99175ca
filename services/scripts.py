"""The Lua scripts of the parameter plane: one class per script that renders its KEYS and ARGV by
name, and their registration on a client.

Each script's header names every position it reads, and its :class:`ScriptCall` (:class:`PushCall`,
:class:`ApplyCall`, :class:`AccountCall`, ...) renders the arguments from the same names, so a call
never counts positions (``tests/test_services_protocol.py`` checks they agree). :func:`script` and
:func:`execute_with_script` load a script and reload it on NOSCRIPT.
See docs/parameter-plane.md, *The wire contract, in one place*.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, ClassVar, NamedTuple

import redis

from common.fence import fence_token
from common.keys import GroupKeys, JobKeys

from .protocol import AccountPlan, PlanUpdate, Update
from .resp import PackedArgs, arg_count
from .wire import pack

__all__ = ["ScriptCall", "PushCall", "ApplyCall", "ShardPublish", "ShardPlan", "TablePublish", "TablePlan",
           "AccountCall", "RowsSweepCall", "TableCutCall", "RowsScanCall", "FeedReadCall",
           "DEFAULT_FEED_ENTRIES", "CALLS",
           "script",
           "execute_with_script"]


@cache
def _source(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def script(client: redis.Redis, name: str) -> redis.commands.core.Script:
    """``services/lua/<name>.lua`` registered on ``client`` (EVALSHA, reloaded on NOSCRIPT)."""
    cached = getattr(client, "_streamtrain_scripts", None)
    if cached is None:
        cached = {}
        client._streamtrain_scripts = cached  # type: ignore[attr-defined]  # our cache, kept on the client
    if name not in cached:
        cached[name] = client.register_script(_source(name))
        # load it now: an EVALSHA answered NOSCRIPT costs more than the round trip (redis-py
        # formats the error with every argument of the transaction, megabytes of it)
        client.script_load(_source(name))
    return cached[name]


def execute_with_script(client: redis.Redis, name: str,
                        build: Callable[[redis.client.Pipeline, str], None]) -> list:
    """Run a MULTI/EXEC that ``build(pipe, sha)`` queues, including an EVALSHA of script ``name``.

    EVALSHA is queued directly (redis-py's pipelined ``Script`` would add a
    SCRIPT EXISTS round trip to every call); on NOSCRIPT (a restarted or
    flushed Redis) the script is loaded and the whole transaction rebuilt and
    run once more, so ``build`` must be repeatable.
    """
    sha = script(client, name).sha
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=True)
        build(pipe, sha)
        try:
            return pipe.execute()
        except redis.exceptions.NoScriptError:
            if attempt == 2:
                raise
            client.script_load(_source(name))
    raise AssertionError("unreachable")


# -- the calls -------------------------------------------------------------------------------------

DEFAULT_FEED_ENTRIES = 1000
"""Entries a group's feed (``GroupKeys.feed``) keeps unless the servers say otherwise (``streamtrain ps
--feed-entries``): one per apply that writes rows or shards, one per sweep step that removes rows."""


class ScriptCall:
    """One call of a script of ``services/lua``, rendering its KEYS and ARGV by name.

    A subclass names the script and the positions it reads, in the order of the script's header;
    it supplies the values by name (:meth:`named_keys`, :meth:`named_argv`) and the
    variable-length tails in order (:meth:`key_tail`, :meth:`argv_tail`).
    """

    SCRIPT: ClassVar[str]
    """``services/lua/<SCRIPT>.lua``."""
    KEYS: ClassVar[tuple[str, ...]]
    """Names of KEYS[1], KEYS[2], ... (the keys' attribute names in :mod:`common.keys`)."""
    KEYS_TAIL: ClassVar[str | None] = None
    """Name of the variable-length rest of KEYS, after the named ones (None: there is none)."""
    ARGV: ClassVar[tuple[str, ...]] = ()
    """Names of ARGV[1], ARGV[2], ..."""
    ARGV_TAIL: ClassVar[str | None] = None
    """Name of the variable-length rest of ARGV (None: there is none)."""
    ENTRIES: ClassVar[Mapping[str, type[tuple]]] = {}
    """Prefix of the script's locals -> the NamedTuple whose fields it reads by position (1-based)
    from the entries of its plan."""

    def named_keys(self) -> Mapping[str, str]:
        """Name -> key of each of :attr:`KEYS`."""
        raise NotImplementedError

    def key_tail(self) -> Sequence[str]:
        """The keys after the named ones."""
        return ()

    def named_argv(self) -> Mapping[str, Any]:
        """Name -> value of each of :attr:`ARGV`."""
        raise NotImplementedError

    def argv_tail(self) -> Sequence[Any]:
        """The arguments after the named ones."""
        return ()

    @classmethod
    def key_index(cls, name: str) -> int:
        """The 1-based KEYS index of ``name`` (for the tail: of its first key), as a plan names it."""
        return _index(cls.KEYS, cls.KEYS_TAIL, name, f"{cls.SCRIPT}.lua KEYS")

    @classmethod
    def arg_index(cls, name: str) -> int:
        """The 1-based ARGV index of ``name`` (for the tail: of its first argument)."""
        return _index(cls.ARGV, cls.ARGV_TAIL, name, f"{cls.SCRIPT}.lua ARGV")

    def keys(self) -> list[str]:
        """KEYS, in the script's order."""
        return _render(self.KEYS, self.named_keys(), self.KEYS_TAIL, self.key_tail(), f"{self.SCRIPT}.lua KEYS")

    def argv(self) -> list[Any]:
        """ARGV, in the script's order."""
        return _render(self.ARGV, self.named_argv(), self.ARGV_TAIL, self.argv_tail(), f"{self.SCRIPT}.lua ARGV")

    def queue(self, pipe: redis.client.Pipeline, sha: str) -> None:
        """Queue the EVALSHA of this call (``sha``: the script's) on ``pipe``."""
        keys = self.keys()
        pipe.evalsha(sha, len(keys), *keys, *self.argv())

    def queue_eval(self, pipe: redis.client.Pipeline) -> None:
        """Queue an EVAL of this call with the script's source on ``pipe``: for a transaction whose
        later commands must never run after a NOSCRIPT (Redis finds the script it has cached by the
        source's SHA1, a few microseconds)."""
        keys = self.keys()
        pipe.execute_command("EVAL", _source(self.SCRIPT), len(keys), *keys, *self.argv())


def _index(names: tuple[str, ...], tail: str | None, name: str, what: str) -> int:
    if name in names:
        return names.index(name) + 1
    if name == tail:
        return len(names) + 1
    raise KeyError(f"{what} has no {name!r}")


def _render(names: tuple[str, ...], values: Mapping[str, Any], tail: str | None, rest: Sequence[Any],
            what: str) -> list[Any]:
    if set(values) != set(names):
        raise TypeError(f"{what}: got {sorted(values)}, the script reads {list(names)}")
    if rest and tail is None:
        raise TypeError(f"{what}: {len(rest)} value(s) after the named ones, but the script has no tail")
    return [*(values[n] for n in names), *rest]


def _named(space: JobKeys | GroupKeys, names: tuple[str, ...]) -> dict[str, str]:
    """Name -> key, for keys named by their attribute in :mod:`common.keys`."""
    return {n: getattr(space, n) for n in names}


@dataclass(frozen=True)
class PushCall(ScriptCall):
    """``push.lua``: append ``update`` to the log and commit its offsets, fenced (the job's slot)."""

    SCRIPT: ClassVar[str] = "push"
    KEYS: ClassVar[tuple[str, ...]] = ("generation", "assignment", "offsets", "update_log", "clocks", "unapplied")
    ARGV: ClassVar[tuple[str, ...]] = ("member_id", "generation", "fence", "clock", "max_pending", "range_count")
    ARGV_TAIL: ClassVar[str | None] = "ranges"

    job: JobKeys
    """The job's keys."""
    update: Update
    """The update (its token and wire bytes set: its header is the log entry)."""
    max_pending: int
    """Unapplied updates the log may hold before the push is refused (BACKPRESSURE)."""

    def named_keys(self) -> dict[str, str]:
        return _named(self.job, self.KEYS)

    def named_argv(self) -> dict[str, Any]:
        u = self.update
        return {"member_id": u.member_id, "generation": u.generation,
                "fence": fence_token(u.member_id, u.generation), "clock": u.clock,
                "max_pending": self.max_pending, "range_count": len(u.offsets)}

    def argv_tail(self) -> list[Any]:
        """Partition, first, next of each offset range, then the log entry's field/value pairs."""
        return [*(x for r in self.update.ranges() for x in r),
                *(x for kv in self.update.to_fields().items() for x in kv)]


class ShardPublish(NamedTuple):
    """What an apply publishes for one shard it changed (an input of :class:`ApplyCall`)."""

    index: int  # type: ignore[assignment]  # a field, hiding tuple.index() (never called on it)
    """Shard index."""
    version_read: int
    """Its version when the server loaded it (compare-and-set)."""
    delta: bytes | None
    """Its delta at the new version, or None (the whole shard changed)."""
    compacted: bool
    """Its full bytes are among the renames (it becomes the shard's base)."""


class ShardPlan(NamedTuple):
    """One entry of ``plan.shards`` of ``apply.lua``, which reads it by position (``S_`` locals)."""

    index: int  # type: ignore[assignment]  # a field, hiding tuple.index() (never called on it)
    """Shard index."""
    version_read: int
    """Its version when the server loaded it."""
    delta: int
    """ARGV index of its delta (0: none)."""
    full: int
    """1 when its full bytes are written (compaction), else 0."""
    stream: int
    """KEYS index of its delta stream."""


class TablePublish(NamedTuple):
    """What an apply writes for one embedding table (an input of :class:`ApplyCall`): ID blobs for the
    script (its feed entry, a checkpoint's cut), and the same rows as command arguments for the native
    HSET/HDEL that follow it (:meth:`ApplyCall.queue_rows`)."""

    table: str
    """Table name."""
    row_ids: bytes
    """IDs (8 little-endian bytes each) of the rows written."""
    rows: PackedArgs | list[bytes]
    """Their field/value arguments: each ID, then its stored record (:func:`services.resp.pair_args`)."""
    seen_ids: bytes
    """IDs of the sighting records written."""
    seen: PackedArgs | list[bytes]
    """Their field/value arguments."""
    unseen_ids: bytes
    """IDs admitted by this apply whose sighting record goes."""
    unseen: PackedArgs | list[bytes]
    """The same IDs, one argument each (:func:`services.resp.id_args`)."""
    steps: int
    """The table's step count after the apply."""
    admitted: int
    """Rows born."""
    dropped: int
    """Gradient rows dropped (IDs not admitted yet)."""


class TablePlan(NamedTuple):
    """One entry of ``plan.tables`` of ``apply.lua``, which reads it by position (``T_`` locals)."""

    name: str
    """Table name (its counters in ``table_stats`` are ``<name>:<counter>``)."""
    rows: int
    """KEYS index of its rows hash."""
    seen: int
    """KEYS index of its seen hash."""
    row_ids: int
    """ARGV index of the IDs of the rows written (0: none)."""
    seen_ids: int
    """ARGV index of the IDs of the sighting records written (0: none)."""
    unseen: int
    """ARGV index of the IDs whose sighting record goes (0: none)."""
    steps: int
    """The table's step count after the apply."""
    admitted: int
    """Rows born."""
    dropped: int
    """Gradient rows dropped."""
    rows_shadow: int
    """KEYS index of its rows shadow (a checkpoint's cut)."""
    seen_shadow: int
    """KEYS index of its seen shadow."""


@dataclass(frozen=True)
class ApplyCall(ScriptCall):
    """``apply.lua``: the group's half of an apply (compare-and-set on the cursor and the shard
    versions; the group's slot)."""

    SCRIPT: ClassVar[str] = "apply"
    KEYS: ClassVar[tuple[str, ...]] = ("cursor", "versions", "version", "optimizer_steps", "bases", "delta_floors",
                                       "persisted", "unaccounted", "table_stats", "table_cut", "rows_blob_shadow",
                                       "feed", "feed_head")
    KEYS_TAIL: ClassVar[str] = "renames"
    ARGV: ClassVar[tuple[str, ...]] = ("plan", "accounting")
    ARGV_TAIL: ClassVar[str] = "deltas"
    ENTRIES: ClassVar[Mapping[str, type[tuple]]] = {"S": ShardPlan, "T": TablePlan}

    group: GroupKeys
    """The group's keys."""
    cursor: str
    """The cursor the server read (``''`` when none)."""
    last: str
    """The cursor after the batch (``cursor`` when it has no update)."""
    renames: Sequence[tuple[str, str]]
    """(staging key, destination) of each full value staged in the same transaction."""
    shards: Sequence[ShardPublish]
    """What it publishes for each shard it changed."""
    accounting: AccountPlan | None
    """The job's half, kept in ``unaccounted`` (None: none)."""
    steps: Mapping[int, int] | None = None
    """Shard -> optimizer steps when the group persists its optimizer state (staged among the
    renames) as of ``last``; None when it does not."""
    blobs: Sequence[str] = ()
    """Gradient blob keys to delete (those of the updates the persisted state now includes)."""
    version: int = -1
    """The group version the server read: a compare-and-set when it writes rows, which are stamped
    with the next (-1: none is written)."""
    tables: Sequence[TablePublish] = ()
    """What it writes for each embedding table the batch touched."""
    row_blobs: Sequence[str] = ()
    """Row-gradient blob keys of the batch's updates, deleted now (their rows are written here)."""
    feed_entries: int = DEFAULT_FEED_ENTRIES
    """Entries the group's feed keeps (about: ``MAXLEN ~``); a call that bumps the version appends one."""

    @property
    def rows(self) -> int:
        """Rows written in all (a call that writes any bumps the group version)."""
        return sum(len(t.row_ids) // 8 for t in self.tables)

    def named_keys(self) -> dict[str, str]:
        return _named(self.group, self.KEYS)

    def key_tail(self) -> list[str]:
        """The renames' pairs, the changed shards' delta streams, the blobs, the row-gradient blobs,
        then each table's rows, seen, rows shadow and seen shadow hashes."""
        return [*(k for pair in self.renames for k in pair), *(self.group.deltas(s.index) for s in self.shards),
                *self.blobs, *self.row_blobs,
                *(k for t in self.tables for k in (self.group.table_rows(t.table), self.group.table_seen(t.table),
                                                   self.group.table_shadow(t.table),
                                                   self.group.seen_shadow(t.table)))]

    def _plan(self) -> dict[str, Any]:
        first_stream = self.key_index(self.KEYS_TAIL) + 2 * len(self.renames)
        first_row_blob = first_stream + len(self.shards) + len(self.blobs)
        first_table = first_row_blob + len(self.row_blobs)
        first_delta = self.arg_index(self.ARGV_TAIL)
        shards, deltas = [], 0
        for j, s in enumerate(self.shards):
            at = 0
            if s.delta is not None:
                at, deltas = first_delta + deltas, deltas + 1
            shards.append(list(ShardPlan(s.index, s.version_read, at, int(s.compacted), first_stream + j)))
        tables, argv = [], first_delta + deltas

        def arg(blob: bytes) -> int:
            nonlocal argv
            if not blob:
                return 0
            argv += 1
            return argv - 1

        for j, t in enumerate(self.tables):
            at = first_table + 4 * j
            tables.append(list(TablePlan(t.table, at, at + 1, arg(t.row_ids), arg(t.seen_ids), arg(t.unseen_ids),
                                         t.steps, t.admitted, t.dropped, at + 2, at + 3)))
        return {"cursor": self.cursor, "last": self.last, "version": self.version, "renames": len(self.renames),
                "shards": shards,
                "persist": 0 if self.steps is None else {
                    "steps": [x for kv in sorted(self.steps.items()) for x in kv],
                    "blobs": [first_stream + len(self.shards), len(self.blobs)]},
                "row_blobs": [first_row_blob, len(self.row_blobs)], "rows": self.rows, "tables": tables,
                "feed": self.feed_entries}

    def named_argv(self) -> dict[str, Any]:
        return {"plan": pack(self._plan()), "accounting": "" if self.accounting is None else self.accounting.pack()}

    def argv_tail(self) -> list[bytes]:
        """The deltas, in the order of :attr:`shards`, then each table's non-empty ID blobs, in the
        order the plan names them."""
        out: list[bytes] = [s.delta for s in self.shards if s.delta is not None]
        for t in self.tables:
            out += [blob for blob in (t.row_ids, t.seen_ids, t.unseen_ids) if blob]
        return out

    def queue_rows(self, pipe: redis.client.Pipeline) -> None:
        """Queue, after the script's EVALSHA in the same MULTI/EXEC, the native writes of the tables'
        rows and sighting records (HSET of field/value arguments, HDEL of the IDs unseen). They are
        not conditional: the caller runs the transaction only under a WATCH of the state the
        script's compare-and-set reads, checked against it first (``services.server.apply``)."""
        for t in self.tables:
            for cmd, key, args in (("HSET", self.group.table_rows(t.table), t.rows),
                                   ("HSET", self.group.table_seen(t.table), t.seen),
                                   ("HDEL", self.group.table_seen(t.table), t.unseen)):
                if arg_count(args):
                    pipe.execute_command(cmd, key, *([args] if isinstance(args, PackedArgs) else args))

    @property
    def watched(self) -> list[str]:
        """The keys the script's compare-and-set reads (the WATCH of :meth:`queue_rows`'s transaction)."""
        return [self.group.cursor, self.group.versions, self.group.version]


@dataclass(frozen=True)
class AccountCall(ScriptCall):
    """``account.lua``: the job's half of an apply (idempotent; the job's slot)."""

    SCRIPT: ClassVar[str] = "account"
    KEYS: ClassVar[tuple[str, ...]] = ("group_accounted", "applied_clocks", "applied_samples", "unapplied", "members",
                                       "clocks", "staleness", "audit_floor", "update_log", "group_persisted")
    KEYS_TAIL: ClassVar[str | None] = "applied_by"
    ARGV: ClassVar[tuple[str, ...]] = ("plan",)
    ENTRIES: ClassVar[Mapping[str, type[tuple]]] = {"U": PlanUpdate}

    job: JobKeys
    """The job's keys."""
    plan: AccountPlan
    """What to record."""

    def named_keys(self) -> dict[str, str]:
        return _named(self.job, self.KEYS)

    def key_tail(self) -> list[str]:
        """The ``applied_by`` hash of each update of the plan, in order."""
        return [self.job.applied_by(u.update_id) for u in self.plan.updates]

    def named_argv(self) -> dict[str, Any]:
        return {"plan": self.plan.pack()}


@dataclass(frozen=True)
class RowsSweepCall(ScriptCall):
    """``rows_sweep.lua``: one step of keeping a group's part of a table bounded (expiry by age, eviction
    beyond a row cap; the group's slot)."""

    SCRIPT: ClassVar[str] = "rows_sweep"
    KEYS: ClassVar[tuple[str, ...]] = ("rows", "seen", "table_stats", "table_cut", "rows_shadow", "seen_shadow",
                                       "version", "feed", "feed_head")
    ARGV: ClassVar[tuple[str, ...]] = ("table", "written_at", "cutoff_ms", "cursor", "seen_cursor", "count", "cap",
                                       "most_evicted", "feed_entries")

    group: GroupKeys
    """The group's keys."""
    table: str
    """The table."""
    written_at: int
    """1-based byte position of ``written_ms`` in a row record."""
    cutoff_ms: int
    """Remove what was last written or sighted before this (0: no expiry)."""
    cursor: bytes | str
    """Where this step of the rows scan starts."""
    seen_cursor: bytes | str
    """Where this step of the seen scan starts."""
    count: int
    """Entries each scan step looks at."""
    cap: int
    """Most rows the group keeps of the table (0: no cap)."""
    most_evicted: int
    """Most rows one call evicts."""
    feed_entries: int = DEFAULT_FEED_ENTRIES
    """Entries the group's feed keeps; a call that removes rows appends one."""

    def named_keys(self) -> dict[str, str]:
        return {"rows": self.group.table_rows(self.table), "seen": self.group.table_seen(self.table),
                "table_stats": self.group.table_stats, "table_cut": self.group.table_cut,
                "rows_shadow": self.group.table_shadow(self.table), "seen_shadow": self.group.seen_shadow(self.table),
                "version": self.group.version, "feed": self.group.feed, "feed_head": self.group.feed_head}

    def named_argv(self) -> dict[str, Any]:
        return {"table": self.table, "written_at": self.written_at, "cutoff_ms": self.cutoff_ms,
                "cursor": self.cursor, "seen_cursor": self.seen_cursor, "count": self.count, "cap": self.cap,
                "most_evicted": self.most_evicted, "feed_entries": self.feed_entries}


@dataclass(frozen=True)
class TableCutCall(ScriptCall):
    """``table_cut.lua``: take, keep or drop a checkpoint's cut of a group's tables (the group's slot)."""

    SCRIPT: ClassVar[str] = "table_cut"
    KEYS: ClassVar[tuple[str, ...]] = ("version", "table_cut", "rows_blob_shadow")
    KEYS_TAIL: ClassVar[str | None] = "shadows"
    ARGV: ClassVar[tuple[str, ...]] = ("op", "owner", "ttl_ms", "blobs")
    OPS: ClassVar[tuple[str, ...]] = ("take", "keep", "drop")

    group: GroupKeys
    """The group's keys."""
    tables: Sequence[str]
    """The model's tables (their shadows)."""
    op: str
    """One of :attr:`OPS`."""
    owner: str
    """The save's token (no spaces)."""
    ttl_ms: int = 0
    """The cut expires unless renewed within this (``take``, ``keep``)."""
    blobs: bool = False
    """The applies copy the row-gradient blobs they delete (``take``, ``keep``)."""

    def __post_init__(self) -> None:
        if self.op not in self.OPS:
            raise ValueError(f"table_cut.lua: op must be one of {self.OPS}, got {self.op!r}")
        if not self.owner or any(c.isspace() for c in self.owner):
            raise ValueError(f"table_cut.lua: owner must be a token without spaces, got {self.owner!r}")

    def named_keys(self) -> dict[str, str]:
        return _named(self.group, self.KEYS)

    def key_tail(self) -> list[str]:
        """Each table's rows shadow and seen shadow."""
        return [k for t in self.tables for k in (self.group.table_shadow(t), self.group.seen_shadow(t))]

    def named_argv(self) -> dict[str, Any]:
        return {"op": self.op, "owner": self.owner, "ttl_ms": self.ttl_ms, "blobs": 1 if self.blobs else 0}


@dataclass(frozen=True)
class RowsScanCall(ScriptCall):
    """``rows_scan.lua``: one step of a scan of a table's hash (rows, sighting records or a shadow), as
    bulk bytes (the group's slot)."""

    SCRIPT: ClassVar[str] = "rows_scan"
    KEYS: ClassVar[tuple[str, ...]] = ("version", "hash", "skip")
    ARGV: ClassVar[tuple[str, ...]] = ("cursor", "count", "width", "prefix", "newest", "skip_present")

    group: GroupKeys
    """The group's keys."""
    hash: str
    """The hash scanned (one of the group's table hashes)."""
    cursor: bytes | str
    """Where this step starts (``'0'``: from the start)."""
    count: int
    """Entries this step looks at."""
    width: int
    """Bytes of each record (entries of another size are left out)."""
    prefix: int
    """Bytes of each record returned."""
    newest: int = -1
    """Leave out rows whose version is above this (-1: none)."""
    skip: str | None = None
    """Leave out the IDs present in this hash of the group (None: none)."""

    def named_keys(self) -> dict[str, str]:
        return {"version": self.group.version, "hash": self.hash, "skip": self.skip or self.hash}

    def named_argv(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "count": self.count, "width": self.width, "prefix": self.prefix,
                "newest": self.newest, "skip_present": 0 if self.skip is None else 1}


@dataclass(frozen=True)
class FeedReadCall(ScriptCall):
    """``feed_read.lua``: the entries of a group's feed after a position, and the rows they name as they
    are now (the group's slot)."""

    SCRIPT: ClassVar[str] = "feed_read"
    KEYS: ClassVar[tuple[str, ...]] = ("version", "feed", "feed_head")
    KEYS_TAIL: ClassVar[str | None] = "tables"
    ARGV: ClassVar[tuple[str, ...]] = ("since", "limit", "most_rows")
    ARGV_TAIL: ClassVar[str | None] = "tables"

    group: GroupKeys
    """The group's keys."""
    since: int
    """The position the reader has applied (0: none)."""
    limit: int
    """Most entries read (at least 1)."""
    most_rows: int
    """Stop after the entry that brings the IDs named to this many (at least one entry is read)."""
    tables: Sequence[tuple[str, int]]
    """(name, bytes of each record returned) of every table of the model."""

    def __post_init__(self) -> None:
        if self.since < 0 or self.limit < 1 or self.most_rows < 1:
            raise ValueError(f"feed_read.lua: since >= 0, limit >= 1 and most_rows >= 1, got {self.since}, "
                             f"{self.limit}, {self.most_rows}")

    def named_keys(self) -> dict[str, str]:
        return _named(self.group, self.KEYS)

    def key_tail(self) -> list[str]:
        """Each table's rows hash."""
        return [self.group.table_rows(name) for name, _ in self.tables]

    def named_argv(self) -> dict[str, Any]:
        return {"since": self.since, "limit": self.limit, "most_rows": self.most_rows}

    def argv_tail(self) -> list[Any]:
        """Each table's name and record width."""
        return [x for name, width in self.tables for x in (name, width)]


CALLS: tuple[type[ScriptCall], ...] = (PushCall, ApplyCall, AccountCall, RowsSweepCall, TableCutCall, RowsScanCall,
                                       FeedReadCall)
"""The call class of every script in ``services/lua``."""
