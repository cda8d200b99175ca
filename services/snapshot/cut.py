"""The consistent cut a checkpoint saves: each slot read in its own MULTI/EXEC, made to fit.

A job's keys live in ``1 + G`` hash slots, and a MULTI/EXEC reads one (:mod:`services.slots`), so a save
reads the log, then each group (:func:`_read_group`, taking the cut of its embedding tables in the same
MULTI/EXEC), then the job's slot (:func:`_read_job`), then the blobs pushed meanwhile; :func:`_settle`
(pure) rolls the job's accounting back, in the file only, to each group's cut, so that a restore keeps
invariant 1 (no record applied twice, none lost). A cut that something it needs moved under is read
again. Why this restores exactly, step by step: ``docs/parameter-plane.md`` (*Checkpoints*, *The cut*).
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
from ..protocol import AccountingRecord, AccountPlan, StreamId, Update, after, group_of
from ..slots import JOB_HASHES, SHARD_HASHES, GroupSlot, JobSlot, ModelMeta
from .table_cut import CUT_TTL_MS, CutBusy, drop_cut, keep_cut, take_call, took

logger = logging.getLogger(__name__)

__all__ = ["GroupCut", "JobCut", "Cut", "read_cut", "let_go"]

_ATTEMPTS = 20


class _Moved(Exception):
    """What a cut needs changed under it: read it again."""


def _text(value: bytes | str | None) -> str:
    return "" if value is None else value.decode() if isinstance(value, bytes) else value


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
    """Its hashes by shard (``services.slots.SHARD_HASHES``), as stored."""
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
class JobCut:
    """The job's slot in a cut: as the MULTI/EXEC of step 3 read it (:func:`_read_job`), and, once
    :func:`_settle` has rolled its accounting back to the groups' cut, as the checkpoint restores it."""

    meta: bytes | None
    """The model's meta as stored."""
    log: list[tuple[str, dict[bytes, bytes]]]
    hashes: dict[str, dict[str, str]]
    """Its hashes a checkpoint saves (``services.slots.JOB_HASHES``), by name."""
    unapplied: int
    accounted: dict[int, str]
    """Group -> its accounted cursor (``group_accounted``)."""
    persisted: dict[int, str]
    """Group -> its reported persisted cursor (``group_persisted``)."""
    applied_samples: list[tuple[str, dict[str, str]]]
    applied_by: dict[str, dict[str, str]]
    """Update -> its ``applied_by`` hash (as read: of the updates named before the read)."""
    uncompleted: int = 0
    """Updates the rollback un-completed (for the log line; 0 as read)."""


def _settle(groups: Sequence[GroupCut], job: JobCut) -> JobCut:
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
    return JobCut(meta=job.meta, log=job.log, hashes=hashes, unapplied=job.unapplied + len(dropped),
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
    slot = GroupSlot.of(client, job, meta, group)
    wanted = [(u.token, i) for u in known.values() if u is not None for i in u.shards
              if group_of(i, meta.groups) == group]
    fields = ("version", "cursor", "persisted", "plan", *SHARD_HASHES, "shards", "optimizer", "deltas")
    if not meta.tables:
        read = slot.read(*fields, blobs=wanted)
    else:
        row_tokens = [u.token for u in known.values() if u is not None and group in u.row_groups]
        read = slot.read(*fields, "table_stats", blobs=wanted, row_blobs=row_tokens,
                         call=take_call(job, group, meta.tables, owner))
        if took(read.reply, job, group) != read.version:
            raise CheckpointError(f"job {job} group {group}: the cut of its tables is not at the version read "
                                  "with it")
    return GroupCut(
        version=read.version, cursor=read.cursor, persisted=read.persisted, plan=read.plan,
        hashes={name: {str(i): str(v) for i, v in getattr(read, name).items()} for name in SHARD_HASHES},
        shards=read.shards, optimizer=read.optimizer,
        deltas={i: [(_text(eid), f[b"d"]) for eid, f in stream] for i, stream in read.deltas.items()},
        blobs=read.blobs, table_stats=read.table_stats, row_blobs=read.row_blobs)


def _read_job(client: redis.Redis, job: str, named: Sequence[str]) -> JobCut:
    """Step 3: the job's slot in one MULTI/EXEC, with the ``applied_by`` hashes of ``named``."""
    read = JobSlot(client, job).read("meta", "log", *JOB_HASHES, "unapplied", "group_accounted", "group_persisted",
                                     "applied_samples", applied_by=named)
    return JobCut(meta=read.meta, log=read.log, hashes={name: getattr(read, name) for name in JOB_HASHES},
                  unapplied=read.unapplied, accounted=read.group_accounted, persisted=read.group_persisted,
                  applied_samples=read.applied_samples, applied_by=read.applied_by)


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
        read = GroupSlot.of(client, job, meta, group).read("persisted", blobs=late, row_blobs=late_rows,
                                                           shadowed_row_blobs=late_rows)
        if read.persisted != cut.persisted and None in read.blobs.values():
            raise _Moved(f"group {group} persisted past an update pushed during the save")
        out.update({key: blob for key, blob in read.blobs.items() if blob is not None})
        for token in late_rows:
            blob = read.row_blobs[token]
            if blob is None:
                blob = read.shadowed_row_blobs[token]
            if blob is not None:  # neither: missing at the cut, refused anyway
                rows[token] = blob
    return out, rows


def _read_cut(client: redis.Redis, job: str, raw_meta: bytes, meta: ModelMeta, owner: str
              ) -> tuple[list[GroupCut], JobCut, list[dict[tuple[str, int], bytes]], list[dict[str, bytes]]]:
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
    state: JobCut
    """The job's slot as the checkpoint restores it (settled)."""
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
