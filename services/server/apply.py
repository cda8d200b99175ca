"""The atomic write of a batch of applied updates, in two halves, shared by every server group.

The group's half (``lua/apply.lua``, its slot: deltas, compactions, cursor, persisted optimizer state,
behind a compare-and-set) and the job's half (``lua/account.lua``, the job's slot: each update's verdict
and accounting, exactly once) run on different nodes under Redis Cluster; a server killed between
them finishes the second from ``unaccounted`` (:func:`finish_accounting`).
See docs/parameter-plane.md, *Apply: exactly once, with deltas, in two halves*.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import redis
import torch

from common.keys import JobKeys

from ..errors import ParameterPlaneError
from ..protocol import AccountingRecord, AccountPlan, PlanUpdate, Status, Update
from ..resp import id_args, pair_args
from ..scripts import DEFAULT_FEED_ENTRIES, AccountCall, ApplyCall, ShardPublish, TablePublish, execute_with_script
from ..tables.apply import TableWrites
from ..tables.rows import SEEN_DTYPE, id_bytes

__all__ = ["Outcome", "ShardWrite", "Persist", "Housekeeping", "WriteResult", "AccountingError", "write_batch",
           "finish_accounting"]


class AccountingError(ParameterPlaneError):
    """The job's half of an apply was refused (its accounted cursor is not where the group's half
    left it)."""


@dataclass(frozen=True)
class Outcome:
    """A group's verdict on one update of a batch."""

    update: Update
    """The update (its ``shards`` name the gradient blobs to delete; ``log_id`` is set)."""
    status: Status
    """Applied, or rejected."""
    reason: str = ""
    """Why it was rejected (empty when applied)."""
    grad_bytes: int = 0
    """Bytes of its encoded gradients (what its trainer put on the wire)."""
    applied_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    """When the server applied (or refused) it, ms since the epoch."""

    def record(self) -> AccountingRecord:
        """Its ``applied_samples`` entry, as this group sees it (the entry's status is
        ``rejected`` when any group refused the update)."""
        return AccountingRecord.of(self.update, Status(self.status), reason=self.reason,
                                   grad_bytes=self.grad_bytes, applied_ms=self.applied_ms)


@dataclass(frozen=True)
class ShardWrite:
    """What one write publishes for one shard it changed."""

    index: int
    """Shard index."""
    version_read: int
    """Its version (the model version that last changed it) when the server loaded it
    (compare-and-set)."""
    delta: bytes | None
    """The coordinates the batch changed and their new values (``services.deltas``); None when
    the whole shard changed (then ``full`` is set and carries it)."""
    full: torch.Tensor | None = None
    """The shard's values in full (contiguous float32, sent without a copy) when it is
    compacted: it becomes the shard's base at the new version."""


@dataclass(frozen=True)
class Persist:
    """A group's optimizer state as of the batch's last update, and the log entries it covers."""

    state: Sequence[tuple[int, int, torch.Tensor]]
    """(shard, slot, values) of every optimizer state tensor of the group."""
    steps: Mapping[int, int]
    """Shard -> optimizer steps applied."""
    covered: Sequence[tuple[str, list[str]]]
    """(update id, the group's gradient blob keys of it) of the updates applied since the group's
    previous persist: their blobs are deleted (only this group reads them), and the log drops the
    updates once every group's persisted state includes them."""


@dataclass(frozen=True)
class Housekeeping:
    """The periodic part of a write, which keeps what the plane stores bounded (ordinary writes
    carry none). The script also removes a departed member's per-member fields when it completes
    that member's last pushed update; housekeeping catches the members that left with nothing
    pending."""

    horizon_ms: int
    """Trim the ``applied_samples`` entries older than this (by Redis's clock), raising each
    partition's ``audit_floor`` to the highest ``next`` offset they cover; 0 keeps them all."""
    most: int = 2000
    """Most entries trimmed by one write (:attr:`WriteResult.more` says when more are due)."""

    def __post_init__(self) -> None:
        if self.horizon_ms < 0 or self.most < 1:
            raise ValueError(f"bad housekeeping {self!r}: horizon_ms >= 0 and most >= 1")


@dataclass(frozen=True)
class WriteResult:
    """What ``lua/apply.lua`` answered."""

    ok: bool
    """True when written; False when the cursor or a shard version had moved (nothing written)."""
    version: int = 0
    """Model version after the write (unchanged when no shard was written)."""
    conflict: str = ""
    """What moved, when not ok."""
    trimmed: int = 0
    """``applied_samples`` entries the housekeeping trimmed."""
    more: bool = False
    """More entries are past the horizon than one write trims: housekeep again soon."""
    forgotten: int = 0
    """Departed members whose ``clocks``/``applied_clocks``/``staleness`` fields were removed."""


def _view(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous float32 CPU tensor (redis-py sends memoryviews as they are)."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # numpy types ndarray a Buffer from 3.12 on


def write_batch(client: redis.Redis, job: str, *, group: int, groups: int, cursor: str,
                outcomes: Sequence[Outcome], shards: Sequence[ShardWrite], persist: Persist | None = None,
                housekeeping: Housekeeping | None = None, version: int | None = None,
                tables: Sequence[TableWrites] = (), row_blobs: Sequence[str] = (),
                feed_entries: int = DEFAULT_FEED_ENTRIES, before_exec: Callable[[], None] = lambda: None
                ) -> WriteResult:
    """Write a batch for ``group``: its half (deltas, compactions, cursor, optionally the persisted
    optimizer state) in one MULTI/EXEC if nothing moved since ``cursor``, then the job's half (the
    per-update accounting, optionally the :class:`Housekeeping`).

    Full values are SET under staging keys in the same transaction and RENAMEd
    into place by the script (or deleted when the compare-and-set fails); deltas
    travel as script arguments. ``before_exec`` runs just before the EVALSHA is
    queued (fault injection). The cursor moves to the last update of ``outcomes``
    (it stays with none, e.g. a persist on its own); the group version is bumped
    once when any shard or row is written. A write with no shard, no update and no
    persist (housekeeping alone) runs only the job's half.

    ``tables``: what the batch writes to the group's embedding tables (rows stamped with
    ``version + 1``, ``version`` being the group version the server read: the script checks it);
    ``row_blobs``: the row-gradient blobs of the batch's updates, deleted by the same step.
    ``feed_entries``: entries the group's feed keeps (a write that bumps the version appends one).

    Raises:
        ValueError: ``tables`` without the ``version`` their rows are stamped from.
    """
    if tables and version is None:
        raise ValueError("a write of rows needs the group version the server read")
    last = outcomes[-1].update.log_id if outcomes else cursor
    account = _account_plan(group, groups, cursor, last, outcomes, persist, housekeeping)
    if not shards and not outcomes and persist is None and not tables:
        return _account(client, job, account, version=0)
    gkeys = JobKeys(job).group(group)
    token = uuid.uuid4().hex
    staged: list[tuple[str, memoryview]] = []
    renames: list[tuple[str, str]] = []

    def stage(dest: str, value: torch.Tensor) -> None:
        key = gkeys.staging(token, len(staged))
        staged.append((key, _view(value)))
        renames.append((key, dest))

    for w in shards:
        if w.full is not None:
            stage(gkeys.shard(w.index), w.full)
        elif w.delta is None:
            raise ValueError(f"shard {w.index}: a write needs a delta or the full values")
    if persist is not None:
        for index, slot, value in persist.state:
            stage(gkeys.optimizer_state(index, slot), value)
    call = ApplyCall(gkeys, cursor=cursor, last=last, renames=renames,
                     shards=[ShardPublish(w.index, w.version_read, w.delta, w.full is not None) for w in shards],
                     accounting=account, steps=None if persist is None else persist.steps,
                     blobs=[k for _, keys in persist.covered for k in keys] if persist is not None else [],
                     version=-1 if version is None else version,
                     tables=[TablePublish(w.table, id_bytes(w.row_ids),
                                          pair_args(client, w.row_ids, w.rows, w.record_size),
                                          id_bytes(w.seen_ids),
                                          pair_args(client, w.seen_ids, w.seen, SEEN_DTYPE.itemsize),
                                          id_bytes(w.unseen_ids), id_args(client, w.unseen_ids), w.steps, w.admitted,
                                          w.dropped)
                             for w in tables],
                     row_blobs=row_blobs, feed_entries=feed_entries)

    def build(pipe: redis.client.Pipeline, sha: str) -> None:
        for key, value in staged:
            pipe.set(key, value)
        before_exec()
        call.queue(pipe, sha)

    res = _write_rows(client, call, staged, before_exec) if call.tables else execute_with_script(
        client, call.SCRIPT, build)[-1]
    tag = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
    if tag != "OK":
        return WriteResult(ok=False, conflict=" ".join(x.decode() if isinstance(x, bytes) else str(x)
                                                       for x in res))
    return _account(client, job, account, version=int(res[1]))


def _write_rows(client: redis.Redis, call: ApplyCall, staged: Sequence[tuple[str, memoryview]],
                before_exec: Callable[[], None]) -> list:
    """The group's half of a write of rows: the script (compare-and-set, shards, version, feed entry,
    counters), then the rows and sighting records as native HSET/HDEL (``ApplyCall.queue_rows``: Redis
    spends a fraction of a script's CPU on them), in one MULTI/EXEC under a WATCH of the state the
    compare-and-set reads, checked here first: a state that moved is a conflict before anything is
    sent, or aborts the EXEC, so the unconditional writes after the script run only when its
    compare-and-set holds. Returns the script's reply (or a conflict in its form)."""
    gk = call.group
    with client.pipeline(transaction=True) as pipe:
        pipe.watch(*call.watched)
        moved = _moved(pipe, call)
        if moved is not None:
            return moved
        pipe.multi()
        for key, value in staged:
            pipe.set(key, value)
        before_exec()
        call.queue_eval(pipe)  # EVAL, not EVALSHA: a NOSCRIPT must never leave the rows written alone
        call.queue_rows(pipe)
        try:
            replies = pipe.execute()
        except redis.WatchError:
            return ["MOVED", f"{gk.cursor} {gk.versions} {gk.version}"]
    return list(replies[len(staged)])


def _moved(pipe: redis.client.Pipeline, call: ApplyCall) -> list | None:
    """What of the state ``call``'s compare-and-set reads moved since the server read it, in the
    script's form (``['CURSOR', cursor]``, ...), read on a watching ``pipe``; None when nothing did."""
    gk = call.group
    cursor = pipe.get(gk.cursor) or b""
    if (cursor.decode() if isinstance(cursor, bytes) else str(cursor)) != call.cursor:
        return ["CURSOR", cursor]
    if call.shards:
        read = pipe.hmget(gk.versions, [s.index for s in call.shards])
        for s, v in zip(call.shards, read, strict=True):
            if int(v or 0) != s.version_read:
                return ["VERSION", s.index, v]
    version = int(pipe.get(gk.version) or 0)
    if version != call.version:
        return ["GROUP", version]
    return None


def _account_plan(group: int, groups: int, cursor: str, last: str, outcomes: Sequence[Outcome],
                  persist: Persist | None, housekeeping: Housekeeping | None) -> AccountPlan:
    """The plan of the job's half (``lua/account.lua``)."""
    return AccountPlan(group=group, groups=groups, start=cursor, end=last,
                       updates=tuple(PlanUpdate.of(o.record()) for o in outcomes),
                       persisted=last if persist is not None else "",
                       housekeep=None if housekeeping is None else (housekeeping.horizon_ms, housekeeping.most))


def _account(client: redis.Redis, job: str, plan: AccountPlan, *, version: int) -> WriteResult:
    """Run the job's half for ``plan``; ``version`` is what the group's half answered."""
    call = AccountCall(JobKeys(job), plan)
    res = execute_with_script(client, call.SCRIPT, call.queue)[-1]
    tag = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
    if tag == "ALREADY" or (tag == "PAST" and plan.updates):
        return WriteResult(ok=True, version=version)
    if tag == "PAST":  # a plan without updates that another server of the group overtook: it reloads
        return WriteResult(ok=False, version=version, conflict=" ".join(
            x.decode() if isinstance(x, bytes) else str(x) for x in res))
    if tag != "OK":
        # the group's half is written: its plan stays in `unaccounted` for the next load to finish
        raise AccountingError(f"job {job} group {plan.group}: accounting of {plan.start!r}..{plan.end!r} "
                              f"refused: {' '.join(x.decode() if isinstance(x, bytes) else str(x) for x in res)}")
    return WriteResult(ok=True, version=version, trimmed=int(res[2]), more=bool(int(res[3])),
                       forgotten=int(res[4]))


def finish_accounting(client: redis.Redis, job: str, group: int) -> bool:
    """Run the job's half of ``group``'s last apply when a crash cut it off (its plan is kept in
    ``unaccounted``); True when there was one to finish, False when it was already recorded.

    Raises:
        AccountingError: the job's accounted cursor of the group is neither the plan's start, nor its
            end, nor past it (the job's slot lost writes the group's slot kept: a Redis restored from
            different points in time).
    """
    raw = cast("bytes | None", client.get(JobKeys(job).group(group).unaccounted))
    if raw is None:
        return False
    plan = dataclasses.replace(AccountPlan.unpack(raw, what=f"group {group} unaccounted plan"), housekeep=None)
    keys = JobKeys(job)
    before = (cast("bytes | None", client.hget(keys.group_accounted, str(group))) or b"").decode()
    _account(client, job, plan, version=0)
    return before == plan.start != plan.end  # recorded now (not before, nor overtaken)
