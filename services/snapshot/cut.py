"""The consistent cut a checkpoint saves: each slot read in its own MULTI/EXEC, made to fit.

A job's keys live in ``1 + G`` hash slots (``common.keys``): the job's slot
(the log, offsets, clocks and accounting) and one per shard group (its
shards, deltas, version, cursors, optimizer state and gradient blobs). A
MULTI/EXEC reads one slot, so a checkpoint reads each slot in its own
MULTI/EXEC and then makes the pieces fit: restored into an empty Redis, the
state must keep invariant 1 (no record applied twice, none lost).

**What a restore must find.** For each group g, its shards at its cursor
``C_g``, its optimizer state at its persisted cursor ``P_g``, its gradient
blobs of every logged update after ``P_g`` (to replay ``(P_g, C_g]`` and
apply the rest), and its plan in ``unaccounted``. In the job's slot: every
update after the lowest ``P_g`` with its committed offsets, and the
accounting of exactly the updates each group has applied: group g's
accounted cursor ``T_g`` is ``C_g``, or the start of its plan when the plan
is not recorded yet (the restored server records it on load,
``services.server.apply.finish_accounting``).

**Save.** Each attempt:

1. reads the log (the job's slot), to learn the updates' blob tokens;
2. reads each group in one MULTI/EXEC of its slot: version, cursor,
   persisted cursor, plan, shards, bases, delta floors, deltas, optimizer
   state and steps, and its blobs of the updates read in 1 (atomically with
   ``P_g``: those after it are all there, or were missing when it read them);
   with embedding tables, it takes the cut of the group's tables (below);
3. reads the job's slot in one MULTI/EXEC: meta, log, offsets, clocks,
   applied clocks, ``applied_samples``, ``audit_floor``, ``unapplied``, the
   groups' accounted and persisted cursors, and the ``applied_by`` hash of
   every update pushed before 3 began (a log read just before names them);
4. reads, from each group's slot, its blobs of the updates pushed after 1
   (with its persisted cursor, in one MULTI/EXEC);
5. writes each group's tables as of its cut, in pieces.

Everything a group applied by its read in 2 was pushed before 3, so the job's
slot holds it, its offsets and its log entry (the log keeps every update
after the lowest persisted cursor that the groups reported). Pushes after 2
are updates no group of the cut applied: they stay pending, as pushes during
an ordinary stop would. But groups go on applying between 2 and 3, so the
job's slot may account updates after a group's cut (``group_accounted`` past
``C_g``). The save rolls that back in what it writes (never in Redis): for
every logged update, the groups that report it are those whose ``T_g`` is at
or after it; an update every group had reported by 3 but not every group by
its cut is *un-completed*: its ``applied_samples`` entry is dropped,
``unapplied`` counts it again, its ``applied_by`` hash names the groups of the
cut with their verdicts (from the group's plan when it is there, else from the
entry: ``applied``, or the reason it was rejected), and its member's applied
clock goes back below its clock. ``group_persisted[g]`` goes back to ``P_g``
(the log must keep what g replays). A restored group then applies those
updates again (it is at ``C_g``) and accounts them once. The attempt is retried (up to ``_ATTEMPTS`` times, then
``CheckpointError``) when what that needs is gone: the log was trimmed
past a group's ``P_g``, a blob read in 4 is missing because the group
persisted past its update meanwhile, or an un-completed update's
``applied_samples`` entry was already trimmed (an audit horizon shorter than
the save). Approximations, on these rolled-back updates only: the reason
recorded for one whose groups disagreed may name another group's verdict, and
a departed member's clocks removed on its completion stay removed (the
consistency rules read live members' clocks only).

**Embedding tables.** A group's rows are written with its version by its
applies, but a table can be far larger than a MULTI/EXEC may read, and a scan
while the servers apply is no cut. So step 2 also *takes the cut* of the
group's tables in its MULTI/EXEC (``GroupKeys.table_cut``: the version V it
reads, the save's token, an expiry the save renews; one save at a time, another
waits up to ``wait_s``), reads the tables' counters (``table_stats``) and the
group's row-gradient blobs of the updates read in 1, and deletes the shadows a
save that died left. While the cut is held, the applies and the sweeps copy
every row record of version at most V and every sighting record into the
tables' shadows before they overwrite or delete it, and the row-gradient blobs
they delete into ``rows_blob_shadow`` (an apply deletes the blob of each update
it applies, so step 4 finds there those of updates pushed after 1 and applied
after the cut; the save then stops that copying). After the cut is settled, each
table of each group is read as of its cut, HSCAN step by step, and written piece
by piece (``services.snapshot.checkpoint_tables``, ``services.snapshot.table_cut``); the
group's cut is dropped, with its shadows, once its tables are written. A row
gradient is applied with its row's optimizer state and never replayed, so the
blobs kept are those of the updates after ``C_g`` (not ``P_g``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import redis

from common.keys import JobKeys
from common.outage import REDIS_DOWN

from ..errors import CheckpointError, ParameterPlaneError, PayloadError
from ..optim import slots
from ..protocol import AccountingRecord, AccountPlan, StreamId, Update, after, group_of, own_shards
from ..scripts import execute_with_script
from ..store import ModelMeta
from .table_cut import CUT_TTL_MS, CutBusy, drop_cut, keep_cut, take_call, took

logger = logging.getLogger(__name__)

__all__ = ["GroupCut", "JobState", "Cut", "read_cut", "let_go", "GROUP_HASHES", "JOB_HASHES"]

_ATTEMPTS = 20

GROUP_HASHES = ("versions", "bases", "delta_floors", "optimizer_steps")
"""The group's hashes a cut holds (by their name in ``GroupKeys``)."""
JOB_HASHES = ("offsets", "clocks", "applied_clocks", "audit_floor")
"""The job's hashes a cut holds (by their name in ``JobKeys``)."""


class _Moved(Exception):
    """What a cut needs changed under it: read it again."""


def _text(value: bytes | str | None) -> str:
    return "" if value is None else value.decode() if isinstance(value, bytes) else value


def _b2s(d: Mapping[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in d.items()}


def _parse(entry_id: str, fields: Mapping[bytes, bytes]) -> Update | None:
    """A log entry's update (without gradients), or None for a malformed one (it names no blobs)."""
    try:
        return Update.from_fields(entry_id, fields)
    except ParameterPlaneError:
        return None


# -- the cut ---------------------------------------------------------------------------------------

@dataclass
class GroupCut:
    """What one MULTI/EXEC of a group's slot read (step 2)."""

    version: int
    cursor: str
    persisted: str
    plan: bytes | None
    """Its ``unaccounted`` plan as stored."""
    hashes: dict[str, dict[str, str]]
    shards: dict[int, bytes | None]
    optimizer: dict[tuple[int, int], bytes | None]
    deltas: dict[int, list[tuple[str, bytes]]]
    blobs: dict[tuple[str, int], bytes | None]
    """(token, shard) -> the blob, of the updates read in step 1."""
    table_stats: dict[str, str] = field(default_factory=dict)
    """Its tables' counters (``GroupKeys.table_stats``) at the cut."""
    row_blobs: dict[str, bytes | None] = field(default_factory=dict)
    """token -> the row-gradient blob, of the updates read in step 1 that name the group."""

    def verdicts(self) -> dict[str, str]:
        """Update -> the group's verdict on it ('' applied), of the updates its plan covers."""
        if self.plan is None:
            return {}
        return AccountPlan.unpack(self.plan, what="unaccounted plan").verdicts()

    def accounted(self, job_accounted: str) -> str:
        """``T_g``: the group's accounted cursor in the cut, given the job's (read later)."""
        if StreamId.parse(job_accounted) >= StreamId.parse(self.cursor):
            return self.cursor
        if self.plan is not None:
            plan = AccountPlan.unpack(self.plan, what="unaccounted plan")
            if plan.start == job_accounted and plan.end == self.cursor:
                return job_accounted  # its plan is not recorded yet: the restored server records it
        raise CheckpointError(f"the job's slot accounts this group up to {job_accounted!r}, behind its cursor "
                              f"{self.cursor!r}, and its plan does not lead there: the slots were restored "
                              "from different points in time?")


@dataclass
class _JobCut:
    """What the MULTI/EXEC of the job's slot read (step 3)."""

    meta: bytes | None
    log: list[tuple[str, dict[bytes, bytes]]]
    hashes: dict[str, dict[str, str]]
    unapplied: int
    accounted: dict[int, str]
    persisted: dict[int, str]
    applied_samples: list[tuple[str, dict[str, str]]]
    applied_by: dict[str, dict[str, str]]
    """Update -> its ``applied_by`` hash, of the updates named before the read."""


@dataclass
class JobState:
    """The job's slot as the checkpoint restores it (the cut's accounting)."""

    log: list[tuple[str, dict[bytes, bytes]]]
    hashes: dict[str, dict[str, str]]
    unapplied: int
    accounted: dict[int, str]
    persisted: dict[int, str]
    applied_samples: list[tuple[str, dict[str, str]]]
    applied_by: dict[str, dict[str, str]]
    uncompleted: int
    """Updates the rollback un-completed (for the log line)."""


def _settle(groups: Sequence[GroupCut], job: _JobCut) -> JobState:
    """The job's state that fits the groups' cut: the accounting of what each group had applied
    by its read, and nothing after (see the module docstring). Pure.

    Raises:
        _Moved: the log was trimmed past a group's persisted cursor, or an update to un-complete
            has no ``applied_samples`` entry left.
        CheckpointError: the slots contradict each other.
    """
    n = len(groups)
    at_job = [job.accounted.get(g, "") for g in range(n)]
    cut = []
    for g, group in enumerate(groups):
        try:
            cut.append(group.accounted(at_job[g]))
        except CheckpointError as exc:
            raise CheckpointError(f"group {g}: {exc}") from None
    lowest = min(StreamId.parse(group.persisted) for group in groups)
    trimmed_to = (min(StreamId.parse(p) for p in job.persisted.values()) if len(job.persisted) >= n
                  else StreamId.parse(""))
    if trimmed_to > lowest and not (job.log and StreamId.parse(job.log[0][0]) <= lowest):
        raise _Moved("the log was trimmed past a group's persisted cursor")
    samples = list(job.applied_samples)
    try:
        records = [AccountingRecord.from_fields(fields) for _, fields in samples]
    except PayloadError as exc:
        raise CheckpointError(f"unreadable applied_samples entry: {exc}") from None
    sample_of = {record.update_id: k for k, record in enumerate(records)}
    dropped: set[int] = set()
    clocks_back: dict[str, int] = {}
    applied_by: dict[str, dict[str, str]] = {}
    plans = [group.verdicts() for group in groups]
    for eid, fields in job.log:
        u = StreamId.parse(eid)
        in_cut = [g for g in range(n) if u <= StreamId.parse(cut[g])]
        at_read = [g for g in range(n) if u <= StreamId.parse(at_job[g])]
        if in_cut == at_read:
            if in_cut and len(in_cut) < n:
                if eid not in job.applied_by:
                    raise CheckpointError(f"update {eid}: reported by group(s) {in_cut} but its applied_by "
                                          "hash was not read")
                applied_by[eid] = job.applied_by[eid]
            continue
        if len(at_read) == n:  # completed after the cut: complete it again from the restored state
            k = sample_of.get(eid)
            if k is None:
                raise _Moved(f"update {eid} to un-complete has no applied_samples entry left")
            dropped.add(k)
            verdict = records[k].verdict
            hash_ = {str(g): plans[g].get(eid, verdict) for g in in_cut}
            update = _parse(eid, fields)
            if update is not None:
                clocks_back[update.member_id] = min(clocks_back.get(update.member_id, update.clock), update.clock)
        else:
            read = job.applied_by.get(eid, {})
            missing = [g for g in in_cut if str(g) not in read]
            if missing:
                raise CheckpointError(f"update {eid}: group(s) {missing} applied it by their read but its "
                                      "applied_by hash does not name them")
            hash_ = {str(g): read[str(g)] for g in in_cut}
        if hash_:
            applied_by[eid] = hash_
    hashes = {name: dict(h) for name, h in job.hashes.items()}
    applied_clocks = hashes["applied_clocks"]
    for member, clock in clocks_back.items():
        if member in applied_clocks:
            applied_clocks[member] = str(min(int(applied_clocks[member]), clock - 1))
    persisted = {}
    for g, group in enumerate(groups):
        reported = group.persisted if cut[g] == group.cursor else job.persisted.get(g, "")
        if reported:
            persisted[g] = reported
    return JobState(log=job.log, hashes=hashes, unapplied=job.unapplied + len(dropped),
                     accounted={g: c for g, c in enumerate(cut) if c}, persisted=persisted,
                     applied_samples=[s for k, s in enumerate(samples) if k not in dropped],
                     applied_by=applied_by, uncompleted=len(dropped))


def _read_group(client: redis.Redis, job: str, meta: ModelMeta, group: int,
                known: Mapping[str, Update | None], owner: str) -> GroupCut:
    """Step 2: the group's slot in one MULTI/EXEC, with its blobs of the ``known`` updates; with
    tables, the same MULTI/EXEC takes the cut of the group's tables for the save ``owner``, reads their
    counters and its row-gradient blobs of the ``known`` updates.

    Raises:
        CutBusy: another save holds the cut of the group's tables.
    """
    gk, own, k = JobKeys(job).group(group), own_shards(meta.layout, meta.groups, group), slots(meta.optimizer)
    wanted = [(u.token, i) for u in known.values() if u is not None for i in u.shards
              if group_of(i, meta.groups) == group]
    row_tokens = [u.token for u in known.values() if u is not None and group in u.row_groups]
    take = take_call(job, group, meta.tables, owner) if meta.tables else None

    def build(pipe: redis.client.Pipeline, sha: str | None = None) -> None:
        for key in (gk.version, gk.cursor, gk.persisted, gk.unaccounted):
            pipe.get(key)
        for name in GROUP_HASHES:
            pipe.hgetall(getattr(gk, name))
        pipe.mget([gk.shard(i) for i in own] or [gk.version])
        pipe.mget([gk.optimizer_state(i, s) for i in own for s in range(k)] or [gk.version])
        pipe.mget([gk.update_blob(t, i) for t, i in wanted] or [gk.version])
        for i in own:
            pipe.xrange(gk.deltas(i))
        if take is not None:
            pipe.hgetall(gk.table_stats)
            pipe.mget([gk.rows_blob(t) for t in row_tokens] or [gk.version])
            assert sha is not None, "the cut's script is queued with its sha"
            take.queue(pipe, sha)

    if take is None:
        pipe = client.pipeline(transaction=True)
        build(pipe)
        replies = pipe.execute()
        stats, row_blobs = {}, {}
    else:
        replies = execute_with_script(client, take.SCRIPT, build)
        *replies, raw_stats, rblobs, cut = replies
        if took(cut, job, group) != int(replies[0] or 0):
            raise CheckpointError(f"job {job} group {group}: the cut of its tables is not at the version read "
                                  "with it")
        stats, row_blobs = _b2s(raw_stats), dict(zip(row_tokens, rblobs, strict=False))
    version, cursor, persisted, plan, *rest = replies
    hashes = {name: _b2s(h) for name, h in zip(GROUP_HASHES, rest, strict=False)}
    shards, opt, blobs, *streams = rest[len(GROUP_HASHES):]
    return GroupCut(
        version=int(version or 0), cursor=_text(cursor), persisted=_text(persisted), plan=plan, hashes=hashes,
        shards=dict(zip(own, shards, strict=False)),
        optimizer={(i, s): opt[j * k + s] for j, i in enumerate(own) for s in range(k)},
        deltas={i: [(_text(eid), f[b"d"]) for eid, f in stream] for i, stream in zip(own, streams, strict=True)},
        blobs=dict(zip(wanted, blobs, strict=False)), table_stats=stats, row_blobs=row_blobs)


def _read_job(client: redis.Redis, job: str, named: Sequence[str]) -> _JobCut:
    """Step 3: the job's slot in one MULTI/EXEC, with the ``applied_by`` hashes of ``named``."""
    keys = JobKeys(job)
    pipe = client.pipeline(transaction=True)
    pipe.get(keys.meta)
    pipe.xrange(keys.update_log)
    for name in JOB_HASHES:
        pipe.hgetall(getattr(keys, name))
    pipe.get(keys.unapplied)
    pipe.hgetall(keys.group_accounted)
    pipe.hgetall(keys.group_persisted)
    pipe.xrange(keys.applied_samples)
    for eid in named:
        pipe.hgetall(keys.applied_by(eid))
    meta, log, *rest = pipe.execute()
    hashes = {name: _b2s(h) for name, h in zip(JOB_HASHES, rest, strict=False)}
    unapplied, accounted, persisted, samples, *by = rest[len(JOB_HASHES):]
    return _JobCut(
        meta=meta, log=[(_text(eid), fields) for eid, fields in log], hashes=hashes, unapplied=int(unapplied or 0),
        accounted={int(g): v for g, v in _b2s(accounted).items()},
        persisted={int(g): v for g, v in _b2s(persisted).items()},
        applied_samples=[(_text(eid), _b2s(fields)) for eid, fields in samples],
        applied_by={eid: _b2s(h) for eid, h in zip(named, by, strict=True) if h})


def _group_blobs(client: redis.Redis, job: str, meta: ModelMeta, group: int, cut: GroupCut,
                 log: Sequence[tuple[str, Mapping[bytes, bytes]]]
                 ) -> tuple[dict[tuple[str, int], bytes], dict[str, bytes]]:
    """The group's blobs of the logged updates after its persisted cursor, and its row-gradient blobs
    of those after its cursor: those step 2 read, and (step 4) those of updates pushed since step 1.
    A row-gradient blob is deleted by the apply of its update, so one the group applied since its cut
    is read from ``rows_blob_shadow``, where the cut had the applies copy it.

    Raises:
        _Moved: a blob of the former is gone because the group persisted past it meanwhile.
    """
    gk = JobKeys(job).group(group)
    out: dict[tuple[str, int], bytes] = {}
    rows: dict[str, bytes] = {}
    late: list[tuple[str, int]] = []
    late_rows: list[str] = []
    for eid, fields in log:
        update = _parse(eid, fields)
        if update is None or StreamId.parse(eid) <= StreamId.parse(cut.persisted):
            continue
        for i in update.shards:
            if group_of(i, meta.groups) != group:
                continue
            if (update.token, i) in cut.blobs:
                blob = cut.blobs[(update.token, i)]
                if blob is not None:  # missing when the group read it: it refuses the update anyway
                    out[(update.token, i)] = blob
            else:
                late.append((update.token, i))
        if group in update.row_groups and StreamId.parse(eid) > StreamId.parse(cut.cursor):
            if update.token in cut.row_blobs:
                if (blob := cut.row_blobs[update.token]) is not None:
                    rows[update.token] = blob
            else:
                late_rows.append(update.token)
    if late or late_rows:
        pipe = client.pipeline(transaction=True)
        pipe.get(gk.persisted)
        pipe.mget([gk.update_blob(t, i) for t, i in late] or [gk.version])
        pipe.mget([gk.rows_blob(t) for t in late_rows] or [gk.version])
        pipe.hmget(gk.rows_blob_shadow, [gk.rows_blob(t) for t in late_rows] or [gk.version])
        persisted, blobs, live_rows, shadowed_rows = pipe.execute()
        blobs = blobs[:len(late)]
        if _text(persisted) != cut.persisted and None in blobs:
            raise _Moved(f"group {group} persisted past an update pushed during the save")
        out.update({key: blob for key, blob in zip(late, blobs, strict=True) if blob is not None})
        for token, live, shadowed in zip(late_rows, live_rows, shadowed_rows, strict=False):
            if live is not None or shadowed is not None:  # neither: missing at the cut, refused anyway
                rows[token] = live if live is not None else shadowed
    return out, rows


def _read_cut(client: redis.Redis, job: str, raw_meta: bytes, meta: ModelMeta, owner: str
              ) -> tuple[list[GroupCut], JobState, list[dict[tuple[str, int], bytes]], list[dict[str, bytes]]]:
    """One attempt: steps 1-4 and the rollback.

    Raises:
        _Moved: what the cut needs changed under it.
        CutBusy: another save holds a group's cut of its tables.
    """
    keys = JobKeys(job)
    log = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(keys.update_log))
    known = {_text(eid): _parse(_text(eid), fields) for eid, fields in log}
    groups = [_read_group(client, job, meta, g, known, owner) for g in range(meta.groups)]
    last = max(known, key=StreamId.parse, default="")
    later = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(keys.update_log, min=after(last)))
    named = [*known, *(_text(eid) for eid, _ in later)]
    cut = _read_job(client, job, named)
    if cut.meta != raw_meta:
        raise CheckpointError(f"job {job}: the model's meta changed while checkpointing (removed or "
                              "restored meanwhile)")
    state = _settle(groups, cut)
    both = [_group_blobs(client, job, meta, g, group, cut.log) for g, group in enumerate(groups)]
    for g in range(meta.groups if meta.tables else 0):
        # the row-gradient blobs are read: the applies stop copying them; a cut lost before is read again
        if not keep_cut(client, job, g, meta.tables, owner, blobs=False):
            raise _Moved(f"the cut of group {g}'s tables expired")
    return groups, state, [b for b, _ in both], [r for _, r in both]


def let_go(client: redis.Redis, job: str, meta: ModelMeta, owner: str) -> None:
    """Drop every cut of the save ``owner`` still holds (each expires by itself if Redis is away)."""
    for g in range(meta.groups if meta.tables else 0):
        try:
            drop_cut(client, job, g, meta.tables, owner)
        except REDIS_DOWN as exc:
            logger.warning("job %s: could not let go of the cut of group %d's tables (it expires in %d s): %s",
                           job, g, CUT_TTL_MS // 1000, exc)


@dataclass
class Cut:
    """A consistent cut of a job (what :func:`read_cut` read)."""

    groups: list[GroupCut]
    """Each group's slot at its cut."""
    state: JobState
    """The job's slot as the checkpoint restores it."""
    blobs: list[dict[tuple[str, int], bytes]]
    """Each group's gradient blobs of the updates after its persisted cursor."""
    row_blobs: list[dict[str, bytes]]
    """Each group's row-gradient blobs of the updates after its cursor, by token."""
    attempts: int
    """Reads it took."""


def read_cut(client: redis.Redis, job: str, raw_meta: bytes, meta: ModelMeta, owner: str, wait_s: float) -> Cut:
    """Steps 1-4 until a cut fits (``_ATTEMPTS`` reads), waiting up to ``wait_s`` for another save that
    holds a group's cut of its tables. With tables, the save ``owner`` holds each group's cut of its
    tables when it returns (:func:`let_go` drops them).

    Raises:
        CheckpointError: no consistent cut in ``_ATTEMPTS`` attempts, the slots contradict each other,
            or another save held a group's cut longer than ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    attempt, why = 0, ""
    while True:
        try:
            return Cut(*_read_cut(client, job, raw_meta, meta, owner), attempts=attempt + 1)
        except _Moved as exc:
            attempt, why = attempt + 1, str(exc)
            logger.debug("job %s: checkpoint attempt %d read again: %s", job, attempt, why)
            if attempt >= _ATTEMPTS:
                raise CheckpointError(f"job {job}: no consistent checkpoint in {_ATTEMPTS} attempts; last: {why}") \
                    from None
        except CutBusy as exc:
            let_go(client, job, meta, owner)  # the groups taken so far: the other save goes on meanwhile
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(f"job {job}: {exc}; wait for it to end (wait_s, --wait-s) and save again") \
                    from None
            time.sleep(min(0.2, left, max(exc.pttl_ms, 1) / 1000))
