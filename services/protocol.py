"""The parameter plane's wire contract: who owns which shard, and what its records look like in Redis.

Pure (no Redis, no torch), written once for the trainer, the servers, the checkpoint and the audit:
shard ownership (:func:`group_of`, :func:`own_shards`), stream ids (:class:`StreamId`, :func:`after`),
the ``log`` entry (:class:`Update`), the ``applied_samples`` entry (:class:`AccountingRecord`) and the
plan kept in ``unaccounted`` (:class:`AccountPlan`). Running jobs and checkpoint files hold these forms:
change them only with a new checkpoint format. See docs/parameter-plane.md, *The wire contract, in one place*.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from common.fence import SEPARATOR

from .errors import PayloadError
from .wire import pack, unpack

if TYPE_CHECKING:
    from .layout import Layout

__all__ = ["group_of", "own_shards", "StreamId", "after", "Update", "Status", "AccountingRecord", "PlanUpdate",
           "AccountPlan"]

_HEADER_LIMIT = 16 * 1024 * 1024
"""Largest log-entry header read back."""


# -- ownership -------------------------------------------------------------------------------------

def group_of(index: int, groups: int) -> int:
    """The shard group that owns shard ``index`` of a model split into ``groups`` groups."""
    return index % groups


def own_shards(shards: int | Layout, groups: int, group: int) -> list[int]:
    """Indices, in order, of the shards that group ``group`` owns, of a model with ``shards`` shards
    (a count, or the model's :class:`~services.layout.Layout`)."""
    count = shards if isinstance(shards, int) else len(shards.shards)
    return [i for i in range(count) if group_of(i, groups) == group]


# -- stream ids ------------------------------------------------------------------------------------

class StreamId(NamedTuple):
    """A Redis stream entry id ``<ms>-<seq>``, ordered as Redis orders them.

    The empty id (a group that has applied nothing: its cursor is ``''``) parses to ``(-1, -1)``,
    before every entry.
    """

    ms: int
    """Milliseconds part (Redis's clock when it made the id)."""
    seq: int
    """Sequence number within the millisecond."""

    @classmethod
    def parse(cls, entry_id: str | bytes) -> StreamId:
        """The id ``entry_id`` (``''``: before every entry).

        Raises:
            ValueError: ``entry_id`` is not ``<ms>-<seq>`` (it names it).
        """
        text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        if not text:
            return cls(-1, -1)
        ms, sep, seq = text.partition("-")
        if not (sep and ms.isascii() and ms.isdigit() and seq.isascii() and seq.isdigit()):
            raise ValueError(f"not a stream id (<ms>-<seq>): {text!r}")
        return cls(int(ms), int(seq))

    def __str__(self) -> str:
        return "" if self.ms < 0 else f"{self.ms}-{self.seq}"


def after(entry_id: str | bytes) -> str:
    """The XRANGE start just after stream id ``entry_id`` (``'-'``, from the start, for ``''``)."""
    sid = StreamId.parse(entry_id)
    return "-" if sid.ms < 0 else f"{sid.ms}-{sid.seq + 1}"


# -- the log entry ---------------------------------------------------------------------------------

_HEADER_FIELD = "h"
"""The one field of an ``update_log`` entry: the msgpack header."""


@dataclass(frozen=True)
class Update:
    """One trainer step as pushed to the parameter plane, and as its ``update_log`` entry reads back.

    The entry holds everything but the gradient bytes (:meth:`to_fields`), which the push writes
    into each group's slot under ``GroupKeys.update_blob(token, shard)``.
    """

    member_id: str
    """The pushing trainer (never reused)."""
    generation: int
    """Membership generation the trainer holds (fencing token)."""
    clock: int
    """Per-member step counter, +1 per push, starting at 1."""
    gradients: Mapping[int, bytes]
    """Shard index -> encoded gradient bytes (msgpack). Empty for an offsets-only update, and in an
    update read back from the log until its blobs are loaded."""
    codec: str = "none"
    """Codec chain that produced the gradients (informational; each blob names its codecs)."""
    offsets: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """Kafka partition -> (first offset, next offset) consumed into the batch."""
    samples: Sequence[tuple[str, int, int]] = ()
    """(producer id, first sequence number, count) of the rows in the batch."""
    batch_size: int = 0
    """Rows in the batch."""
    produced_ts_ms: int = 0
    """Oldest produce timestamp in the batch (ms since the epoch)."""
    log_id: str = ""
    """Update-log entry id (set when read back from the log)."""
    token: str = ""
    """Names the gradient blob keys (set by the push)."""
    shards: tuple[int, ...] = ()
    """Shards with a gradient (set when read back from the log, before the blobs are loaded)."""
    wire_bytes: int = 0
    """Encoded gradient bytes of all its shards and rows (set by the push)."""
    rows: Mapping[int, bytes] = field(default_factory=dict)
    """Group -> the gradient rows of the group's rows of embedding tables
    (``services.tables.grads``). Empty in an update read back from the log until its blobs are
    loaded."""
    tables: tuple[str, ...] = ()
    """Embedding tables the update carries gradient rows for (each group counts a step of each,
    whether or not it owns one of the rows)."""
    row_groups: tuple[int, ...] = ()
    """Groups with a row-gradient blob (set when read back from the log)."""

    def validate_header(self) -> None:
        """Check the fields' types and ranges.

        Raises:
            PayloadError: naming the bad field.
        """
        if not isinstance(self.member_id, str) or not self.member_id or SEPARATOR in self.member_id:
            raise PayloadError(f"update: member_id must be a non-empty string without {SEPARATOR!r} (the fence "
                               f"token's separator), got {self.member_id!r}")
        for name in ("generation", "batch_size", "produced_ts_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PayloadError(f"update: {name} must be an int >= 0, got {value!r}")
        if not isinstance(self.clock, int) or isinstance(self.clock, bool) or self.clock < 1:
            raise PayloadError(f"update: clock must be an int >= 1, got {self.clock!r}")
        for p, rng in self.offsets.items():
            if (not isinstance(p, int) or p < 0 or not isinstance(rng, (tuple, list)) or len(rng) != 2
                    or not all(isinstance(o, int) and o >= 0 for o in rng) or rng[0] > rng[1]):
                raise PayloadError(f"update: offsets[{p!r}] must be (first, next) with 0 <= first <= next, got {rng!r}")
        for s in self.samples:
            if (not isinstance(s, (tuple, list)) or len(s) != 3 or not isinstance(s[0], str)
                    or not all(isinstance(v, int) and v >= 0 for v in s[1:])):
                raise PayloadError(f"update: samples entries must be (producer_id, first_seq, count), got {s!r}")
        for i, blob in self.gradients.items():
            if not isinstance(i, int) or not isinstance(blob, (bytes, bytearray, memoryview)):
                raise PayloadError(f"update: gradients must map shard index -> bytes, got {i!r}: {type(blob).__name__}")
        for g, blob in self.rows.items():
            if not isinstance(g, int) or g < 0 or not isinstance(blob, (bytes, bytearray, memoryview)):
                raise PayloadError(f"update: rows must map group -> bytes, got {g!r}: {type(blob).__name__}")
        if not all(isinstance(t, str) and t for t in self.tables) or len(set(self.tables)) != len(self.tables):
            raise PayloadError(f"update: tables must be distinct table names, got {list(self.tables)!r}")
        if (self.rows or self.row_groups) and not self.tables:
            raise PayloadError("update: gradient rows without the tables they belong to")

    def ranges(self) -> list[tuple[int, int, int]]:
        """(partition, first, next) of each offset range, by partition."""
        return [(p, f, n) for p, (f, n) in sorted(self.offsets.items())]

    def to_fields(self) -> dict[str, bytes]:
        """The field/value pairs of its ``update_log`` entry: the msgpack header under ``h``
        (member, generation, clock, codec, offset ranges, samples, batch size, produce time, the
        shards with a gradient, the blob token and the gradient bytes; with gradient rows also
        ``rt``, the tables, and ``rg``, the groups with a row-gradient blob)."""
        header = {"m": self.member_id, "g": self.generation, "c": self.clock, "codec": self.codec,
                  "off": [list(r) for r in self.ranges()], "s": [list(s) for s in self.samples],
                  "b": self.batch_size, "ts": self.produced_ts_ms, "shards": sorted(self.gradients),
                  "t": self.token, "wb": self.wire_bytes}
        if self.tables:  # absent from the headers of dense updates, as they were before tables
            header["rt"] = list(self.tables)
            header["rg"] = sorted(self.rows) or list(self.row_groups)
        return {_HEADER_FIELD: pack(header)}

    @classmethod
    def from_fields(cls, entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> Update:
        """The update of ``update_log`` entry ``entry_id``, without its gradients (``shards`` names
        them; ``services.push.updates.load_gradients`` reads them).

        Raises:
            PayloadError: the header is missing or malformed (the message names the entry).
        """
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        raw = fields.get(_HEADER_FIELD.encode())
        if raw is None:
            raise PayloadError(f"update {eid}: header field {_HEADER_FIELD!r} missing")
        h = unpack(raw, max_bytes=_HEADER_LIMIT, what=f"update {eid} header")
        try:
            upd = cls(member_id=h["m"], generation=h["g"], clock=h["c"], gradients={}, codec=h["codec"],
                      offsets={int(p): (int(f), int(n)) for p, f, n in h["off"]},
                      samples=tuple((str(a), int(b), int(c)) for a, b, c in h["s"]),
                      batch_size=h["b"], produced_ts_ms=h["ts"], log_id=eid, token=str(h["t"]),
                      shards=tuple(int(i) for i in h["shards"]), wire_bytes=int(h.get("wb", 0)),
                      tables=tuple(str(t) for t in h.get("rt", ())),
                      row_groups=tuple(int(g) for g in h.get("rg", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise PayloadError(f"update {eid}: malformed header: {exc!r}") from None
        upd.validate_header()
        return upd


# -- the accounting record -------------------------------------------------------------------------

class Status(enum.StrEnum):
    """What became of an accounted update (field ``status`` of its ``applied_samples`` entry)."""

    APPLIED = "applied"
    """Every group applied it: its samples count as trained on."""
    REJECTED = "rejected"
    """Some group refused it (``reason`` says why): its samples are not applied."""


@dataclass(frozen=True)
class AccountingRecord:
    """One ``applied_samples`` entry: an update accounted once every group has reported it.

    The group that completes the update appends it in ``lua/account.lua``: the plan carries
    :meth:`fields_before_verdict`, and the script adds ``status`` (and ``reason``) from the groups'
    verdicts. Values are strings; ``samples`` and ``offsets`` are JSON.
    """

    update_id: str
    """The update's log entry id (field ``update``)."""
    member_id: str
    """The pushing trainer (field ``member``)."""
    generation: int
    """Membership generation it pushed at."""
    clock: int
    """Its clock."""
    samples: Sequence[tuple[str, int, int]]
    """(producer id, first sequence number, count) of its rows (JSON)."""
    offsets: Mapping[int, tuple[int, int]]
    """Kafka partition -> (first, next) it committed (JSON ``[[partition, first, next], ...]``,
    by partition: the servers' audit floor reads ``next``)."""
    batch_size: int
    """Rows in its batch."""
    produced_ts_ms: int
    """Oldest produce time of its rows (ms since the epoch)."""
    applied_ms: int
    """When the reporting server applied (or refused) it, ms since the epoch."""
    grad_bytes: int = 0
    """Bytes of its encoded gradients (what its trainer put on the wire; 0 in entries written
    before the field existed)."""
    status: Status = Status.APPLIED
    """Applied, or rejected."""
    reason: str = ""
    """Why it was rejected (absent from the entry when applied)."""

    @classmethod
    def of(cls, update: Update, status: Status = Status.APPLIED, *, reason: str = "", grad_bytes: int = 0,
           applied_ms: int) -> AccountingRecord:
        """The record of ``update`` (read back from the log: ``log_id`` set)."""
        return cls(update_id=update.log_id, member_id=update.member_id, generation=update.generation,
                   clock=update.clock, samples=tuple(update.samples), offsets=dict(update.offsets),
                   batch_size=update.batch_size, produced_ts_ms=update.produced_ts_ms, applied_ms=applied_ms,
                   grad_bytes=grad_bytes, status=Status(status), reason=reason)

    @property
    def verdict(self) -> str:
        """A group's verdict as ``applied_by`` keeps it: ``''`` when applied, else why it refused
        (``refused`` when no reason was given)."""
        return "" if self.status is Status.APPLIED else (self.reason or "refused")

    def fields_before_verdict(self) -> list[str]:
        """Field, value, field, value, ... of the entry without ``status`` and ``reason`` (what the
        plan carries; the script that completes the update adds them)."""
        return [
            "update", self.update_id, "member", self.member_id, "generation", str(self.generation),
            "clock", str(self.clock), "samples", json.dumps([list(s) for s in self.samples]),
            "offsets", json.dumps([[p, f, n] for p, (f, n) in sorted(self.offsets.items())]),
            "batch_size", str(self.batch_size), "produced_ts_ms", str(self.produced_ts_ms),
            "applied_ms", str(self.applied_ms), "grad_bytes", str(self.grad_bytes)]

    def to_fields(self) -> dict[str, str]:
        """The whole entry as field -> value, as ``lua/account.lua`` writes it."""
        flat = self.fields_before_verdict()
        out = dict(zip(flat[::2], flat[1::2], strict=True))
        out["status"] = str(self.status)
        if self.status is Status.REJECTED:
            out["reason"] = self.verdict
        return out

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> AccountingRecord:
        """The record of an ``applied_samples`` entry (field names and values as bytes or str).

        Raises:
            PayloadError: a field is missing or malformed (the message names it).
        """
        text = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in fields.items()}
        what = f"applied_samples entry of update {text.get('update', '?')!r}"
        try:
            return cls(update_id=text["update"], member_id=text["member"], generation=int(text["generation"]),
                       clock=int(text["clock"]),
                       samples=tuple((str(a), int(b), int(c)) for a, b, c in json.loads(text["samples"])),
                       offsets={int(p): (int(f), int(n)) for p, f, n in json.loads(text["offsets"])},
                       batch_size=int(text["batch_size"]), produced_ts_ms=int(text["produced_ts_ms"]),
                       applied_ms=int(text["applied_ms"]), grad_bytes=int(text.get("grad_bytes", 0)),
                       status=Status(text["status"]), reason=text.get("reason", ""))
        except KeyError as exc:
            raise PayloadError(f"{what}: field {exc.args[0]!r} missing") from None
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"{what}: malformed: {exc}") from None


class PlanUpdate(NamedTuple):
    """One update of an :class:`AccountPlan` (on the wire: this tuple, in this order)."""

    update_id: str
    """Its log entry id (names its ``applied_by`` hash)."""
    member_id: str
    """Its member (whose applied clock the completing group raises)."""
    clock: int
    """Its clock."""
    verdict: str
    """The group's verdict: ``''`` applied, else why the group refused it."""
    fields: Sequence[str]
    """:meth:`AccountingRecord.fields_before_verdict` of its record."""

    @classmethod
    def of(cls, record: AccountingRecord) -> PlanUpdate:
        """The plan entry of a group's ``record`` of an update."""
        return cls(record.update_id, record.member_id, record.clock, record.verdict,
                   tuple(record.fields_before_verdict()))


@dataclass(frozen=True)
class AccountPlan:
    """What ``lua/account.lua`` records for one apply of one group: the job's half of the apply.

    Kept, packed, in the group's ``unaccounted`` key (atomically with the group's half) until the
    job's slot has recorded it, so it is part of checkpoints: its wire form (a msgpack map with the
    keys ``group``, ``groups``, ``from``, ``to``, ``updates``, ``persisted``, ``housekeep``) stays.
    """

    group: int
    """The reporting group."""
    groups: int
    """The job's number of groups (an update completes when this many have reported it)."""
    start: str
    """The group's accounted cursor before this apply (``''`` when none; wire ``from``)."""
    end: str
    """Its cursor after it (wire ``to``)."""
    updates: Sequence[PlanUpdate] = ()
    """The updates of the apply, in log order."""
    persisted: str = ""
    """The group's persisted cursor after this apply, or ``''`` when it did not persist."""
    housekeep: tuple[int, int] | None = None
    """(horizon ms, most entries to trim) when this apply carries the housekeeping."""

    def pack(self) -> bytes:
        """The wire form (what ``unaccounted`` keeps and the script reads)."""
        return pack({"group": self.group, "groups": self.groups, "from": self.start, "to": self.end,
                     "updates": [[u.update_id, u.member_id, u.clock, u.verdict, list(u.fields)]
                                 for u in self.updates],
                     "persisted": self.persisted,
                     "housekeep": 0 if self.housekeep is None else list(self.housekeep)})

    @classmethod
    def unpack(cls, raw: bytes, *, what: str = "accounting plan") -> AccountPlan:
        """Inverse of :meth:`pack`.

        Raises:
            PayloadError: ``raw`` is not a plan (the message names ``what``).
        """
        plan: Any = unpack(raw, what=what)
        try:
            housekeep = plan["housekeep"]
            return cls(group=int(plan["group"]), groups=int(plan["groups"]), start=str(plan["from"]),
                       end=str(plan["to"]), updates=tuple(_plan_update(u) for u in plan["updates"]),
                       persisted=str(plan["persisted"]),
                       housekeep=None if not housekeep else (int(housekeep[0]), int(housekeep[1])))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise PayloadError(f"{what}: malformed: {exc!r}") from None

    def verdicts(self) -> dict[str, str]:
        """Update id -> the group's verdict on it (``''`` applied)."""
        return {u.update_id: u.verdict for u in self.updates}


def _plan_update(raw: Iterable[Any]) -> PlanUpdate:
    update_id, member_id, clock, verdict, fields = raw
    return PlanUpdate(str(update_id), str(member_id), int(clock), str(verdict), tuple(str(f) for f in fields))
