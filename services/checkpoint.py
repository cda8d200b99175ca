"""Checkpoints: a consistent cut of a job's parameter plane to one file, and back.

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
``services.apply.finish_accounting``).

**Save.** Each attempt:

1. reads the log (the job's slot), to learn the updates' blob tokens;
2. reads each group in one MULTI/EXEC of its slot: version, cursor,
   persisted cursor, plan, shards, bases, delta floors, deltas, optimizer
   state and steps, and its blobs of the updates read in 1 (atomically with
   ``P_g``: those after it are all there, or were missing when it read them);
3. reads the job's slot in one MULTI/EXEC: meta, log, offsets, clocks,
   applied clocks, ``applied_samples``, ``audit_floor``, ``unapplied``, the
   groups' accounted and persisted cursors, and the ``applied_by`` hash of
   every update pushed before 3 began (a log read just before names them);
4. reads, from each group's slot, its blobs of the updates pushed after 1
   (with its persisted cursor, in one MULTI/EXEC).

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
:class:`CheckpointError`) when what that needs is gone: the log was trimmed
past a group's ``P_g``, a blob read in 4 is missing because the group
persisted past its update meanwhile, or an un-completed update's
``applied_samples`` entry was already trimmed (an audit horizon shorter than
the save). Approximations, on these rolled-back updates only: the reason
recorded for one whose groups disagreed may name another group's verdict, and
a departed member's clocks removed on its completion stay removed (the
consistency rules read live members' clocks only).

**Restore** (:func:`restore_checkpoint`), into a Redis without the job's
model, under the init lock that ``ParameterStore.init_model`` takes: each
group's slot in one MULTI/EXEC, then the job's slot with the meta last, so a
reader that sees the model finds everything in place. Trainers resume at the
committed offsets; each server finishes its plan, replays ``(P_g, C_g]`` and
applies the pending updates. The ``applied_samples`` history (bounded by the
servers' audit horizon) and ``audit_floor`` are part of a checkpoint, so the
restored job's audit goes on; the coordinator's keys (membership, config) and
``staleness`` are not.

Format ``streamtrain-checkpoint-3``: ``torch.save`` of a dict of tensors,
strings, bytes and numbers, loaded with ``weights_only=True`` (no pickled
code). Files of older formats (one MULTI/EXEC of a one-slot job) are refused.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
import torch

from common.keys import JobKeys

from .errors import LayoutError, ParameterPlaneError, PayloadError
from .export import version_name
from .optim import slots
from .protocol import AccountingRecord, AccountPlan, StreamId, Update, after, group_of, own_shards
from .store import ModelMeta

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "restore_checkpoint", "CheckpointError", "FORMAT"]

FORMAT = "streamtrain-checkpoint-3"
"""Format tag stored in every checkpoint."""

_ATTEMPTS = 20
_RESTORE_LOCK_MS = 600_000
"""How long a restore holds the job's init lock (it writes every group before the meta)."""

_GROUP_HASHES = ("versions", "bases", "delta_floors", "optimizer_steps")
_JOB_HASHES = ("offsets", "clocks", "applied_clocks", "audit_floor")


class CheckpointError(ParameterPlaneError):
    """A checkpoint file is unreadable or of another format, the target Redis already has the job,
    or no consistent cut could be read."""


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
class _GroupCut:
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
class _JobState:
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


def _settle(groups: Sequence[_GroupCut], job: _JobCut) -> _JobState:
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
    return _JobState(log=job.log, hashes=hashes, unapplied=job.unapplied + len(dropped),
                     accounted={g: c for g, c in enumerate(cut) if c}, persisted=persisted,
                     applied_samples=[s for k, s in enumerate(samples) if k not in dropped],
                     applied_by=applied_by, uncompleted=len(dropped))


def _read_group(client: redis.Redis, job: str, meta: ModelMeta, group: int,
                known: Mapping[str, Update | None]) -> _GroupCut:
    """Step 2: the group's slot in one MULTI/EXEC, with its blobs of the ``known`` updates."""
    gk, own, k = JobKeys(job).group(group), own_shards(meta.layout, meta.groups, group), slots(meta.optimizer)
    wanted = [(u.token, i) for u in known.values() if u is not None for i in u.shards
              if group_of(i, meta.groups) == group]
    pipe = client.pipeline(transaction=True)
    for key in (gk.version, gk.cursor, gk.persisted, gk.unaccounted):
        pipe.get(key)
    for name in _GROUP_HASHES:
        pipe.hgetall(getattr(gk, name))
    pipe.mget([gk.shard(i) for i in own] or [gk.version])
    pipe.mget([gk.optimizer_state(i, s) for i in own for s in range(k)] or [gk.version])
    pipe.mget([gk.update_blob(t, i) for t, i in wanted] or [gk.version])
    for i in own:
        pipe.xrange(gk.deltas(i))
    version, cursor, persisted, plan, *rest = pipe.execute()
    hashes = {name: _b2s(h) for name, h in zip(_GROUP_HASHES, rest, strict=False)}
    shards, opt, blobs, *streams = rest[len(_GROUP_HASHES):]
    return _GroupCut(
        version=int(version or 0), cursor=_text(cursor), persisted=_text(persisted), plan=plan, hashes=hashes,
        shards=dict(zip(own, shards, strict=False)),
        optimizer={(i, s): opt[j * k + s] for j, i in enumerate(own) for s in range(k)},
        deltas={i: [(_text(eid), f[b"d"]) for eid, f in stream] for i, stream in zip(own, streams, strict=True)},
        blobs=dict(zip(wanted, blobs, strict=False)))


def _read_job(client: redis.Redis, job: str, named: Sequence[str]) -> _JobCut:
    """Step 3: the job's slot in one MULTI/EXEC, with the ``applied_by`` hashes of ``named``."""
    keys = JobKeys(job)
    pipe = client.pipeline(transaction=True)
    pipe.get(keys.meta)
    pipe.xrange(keys.update_log)
    for name in _JOB_HASHES:
        pipe.hgetall(getattr(keys, name))
    pipe.get(keys.unapplied)
    pipe.hgetall(keys.group_accounted)
    pipe.hgetall(keys.group_persisted)
    pipe.xrange(keys.applied_samples)
    for eid in named:
        pipe.hgetall(keys.applied_by(eid))
    meta, log, *rest = pipe.execute()
    hashes = {name: _b2s(h) for name, h in zip(_JOB_HASHES, rest, strict=False)}
    unapplied, accounted, persisted, samples, *by = rest[len(_JOB_HASHES):]
    return _JobCut(
        meta=meta, log=[(_text(eid), fields) for eid, fields in log], hashes=hashes, unapplied=int(unapplied or 0),
        accounted={int(g): v for g, v in _b2s(accounted).items()},
        persisted={int(g): v for g, v in _b2s(persisted).items()},
        applied_samples=[(_text(eid), _b2s(fields)) for eid, fields in samples],
        applied_by={eid: _b2s(h) for eid, h in zip(named, by, strict=True) if h})


def _group_blobs(client: redis.Redis, job: str, meta: ModelMeta, group: int, cut: _GroupCut,
                 log: Sequence[tuple[str, Mapping[bytes, bytes]]]) -> dict[tuple[str, int], bytes]:
    """The group's blobs of the logged updates after its persisted cursor: those step 2 read, and
    (step 4) those of updates pushed since step 1.

    Raises:
        _Moved: one of the latter is gone because the group persisted past it meanwhile.
    """
    gk = JobKeys(job).group(group)
    out: dict[tuple[str, int], bytes] = {}
    late: list[tuple[str, int]] = []
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
    if late:
        pipe = client.pipeline(transaction=True)
        pipe.get(gk.persisted)
        pipe.mget([gk.update_blob(t, i) for t, i in late])
        persisted, blobs = pipe.execute()
        if _text(persisted) != cut.persisted and None in blobs:
            raise _Moved(f"group {group} persisted past an update pushed during the save")
        out.update({key: blob for key, blob in zip(late, blobs, strict=True) if blob is not None})
    return out


def _read_cut(client: redis.Redis, job: str, raw_meta: bytes, meta: ModelMeta
              ) -> tuple[list[_GroupCut], _JobState, list[dict[tuple[str, int], bytes]]]:
    """One attempt: steps 1-4 and the rollback."""
    keys = JobKeys(job)
    log = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(keys.update_log))
    known = {_text(eid): _parse(_text(eid), fields) for eid, fields in log}
    groups = [_read_group(client, job, meta, g, known) for g in range(meta.groups)]
    last = max(known, key=StreamId.parse, default="")
    later = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(keys.update_log, min=after(last)))
    named = [*known, *(_text(eid) for eid, _ in later)]
    cut = _read_job(client, job, named)
    if cut.meta != raw_meta:
        raise CheckpointError(f"job {job}: the model's meta changed while checkpointing (removed or "
                              "restored meanwhile)")
    state = _settle(groups, cut)
    blobs = [_group_blobs(client, job, meta, g, group, cut.log) for g, group in enumerate(groups)]
    return groups, state, blobs


# -- save ------------------------------------------------------------------------------------------

def _floats(blob: bytes | None) -> torch.Tensor | None:
    return None if blob is None else torch.frombuffer(bytearray(blob), dtype=torch.float32)


def save_checkpoint(client: redis.Redis, job: str, path: str) -> tuple[int, ...]:
    """Write a consistent cut of ``job`` to ``path`` (atomically via a temp file).

    Returns:
        The model version it holds: each group's version (``services.export.version_name``
        writes it).

    Raises:
        LayoutError: the job has no model.
        CheckpointError: no consistent cut in ``_ATTEMPTS`` attempts, or the slots contradict
            each other.
    """
    raw_meta = cast("bytes | None", client.get(JobKeys(job).meta))
    if raw_meta is None:
        raise LayoutError(f"job {job} has no model to checkpoint")
    meta = ModelMeta.from_json(raw_meta)
    why = ""
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            groups, state, blobs = _read_cut(client, job, raw_meta, meta)
            break
        except _Moved as exc:
            why = str(exc)
            logger.debug("job %s: checkpoint attempt %d read again: %s", job, attempt, why)
    else:
        raise CheckpointError(f"job {job}: no consistent checkpoint in {_ATTEMPTS} attempts; last: {why}")
    version = tuple(group.version for group in groups)
    data: dict[str, Any] = {
        "format": FORMAT, "job": job, "meta": raw_meta.decode(), "version": list(version),
        "groups": [{
            "version": group.version, "cursor": group.cursor, "persisted": group.persisted,
            "unaccounted": group.plan, "hashes": group.hashes,
            "shards": {str(i): _floats(b) for i, b in group.shards.items()},
            "optimizer": {f"{i}:{s}": _floats(b) for (i, s), b in group.optimizer.items() if b is not None},
            "deltas": {str(i): [[eid, blob] for eid, blob in stream] for i, stream in group.deltas.items()},
            "blobs": [[token, i, blob] for (token, i), blob in group_blobs.items()],
        } for group, group_blobs in zip(groups, blobs, strict=True)],
        "log": [[eid, [[f, v] for f, v in fields.items()]] for eid, fields in state.log],
        "hashes": state.hashes, "unapplied": state.unapplied,
        "group_accounted": {str(g): c for g, c in state.accounted.items()},
        "group_persisted": {str(g): c for g, c in state.persisted.items()},
        "applied_samples": [[eid, fields] for eid, fields in state.applied_samples],
        "applied_by": state.applied_by,
    }
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(data, fh)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    logger.info("job %s: checkpoint of version %s (%d logged updates, %d un-completed to fit the groups' cut, "
                "%d attempt(s)) saved to %s", job, version_name(version), len(state.log), state.uncompleted,
                attempt, path)
    return version


# -- restore ---------------------------------------------------------------------------------------

def _load(path: str) -> dict[str, Any]:
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        reason = str(exc).splitlines()[0]
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        older = (f" (it is {found}, written before a job's keys were split into one hash slot per shard group; "
                 "restore it with the streamtrain version that wrote it)" if isinstance(found, str)
                 and found.startswith("streamtrain-checkpoint-") else "")
        raise CheckpointError(f"{path} is not a {FORMAT} file{older}")
    return data


def _bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _restore_group(client: redis.Redis, job: str, meta: ModelMeta, group: int, saved: Mapping[str, Any]) -> None:
    """One MULTI/EXEC writing the group's slot (replacing what a failed restore may have left)."""
    gk, own, k = JobKeys(job).group(group), own_shards(meta.layout, meta.groups, group), slots(meta.optimizer)
    pipe = client.pipeline(transaction=True)
    pipe.delete(gk.version, gk.cursor, gk.persisted, gk.unaccounted, *(getattr(gk, h) for h in _GROUP_HASHES),
                *(gk.shard(i) for i in own), *(gk.deltas(i) for i in own),
                *(gk.optimizer_state(i, s) for i in own for s in range(k)))
    for i in own:
        pipe.set(gk.shard(i), _bytes(saved["shards"][str(i)]))
        for eid, blob in saved["deltas"][str(i)]:
            pipe.xadd(gk.deltas(i), {"d": blob}, id=eid)
    for name in _GROUP_HASHES:
        if saved["hashes"][name]:
            pipe.hset(getattr(gk, name), mapping=saved["hashes"][name])
    for slot, t in saved["optimizer"].items():
        i, s = slot.split(":")
        pipe.set(gk.optimizer_state(int(i), int(s)), _bytes(t))
    for token, i, blob in saved["blobs"]:
        pipe.set(gk.update_blob(token, i), blob)
    for key, value in ((gk.cursor, saved["cursor"]), (gk.persisted, saved["persisted"]),
                       (gk.unaccounted, saved["unaccounted"])):
        if value:
            pipe.set(key, value)
    pipe.set(gk.version, saved["version"])
    pipe.execute()


def _restore_job(client: redis.Redis, job: str, data: Mapping[str, Any]) -> None:
    """One MULTI/EXEC writing the job's slot, the meta last."""
    keys = JobKeys(job)
    log = data["log"]
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.update_log, keys.unapplied, keys.group_accounted, keys.group_persisted, keys.applied_samples,
                *(getattr(keys, name) for name in _JOB_HASHES), *(keys.applied_by(eid) for eid, _ in log))
    for name in _JOB_HASHES:
        if data["hashes"][name]:
            pipe.hset(getattr(keys, name), mapping=data["hashes"][name])
    for key, mapping in ((keys.group_accounted, data["group_accounted"]),
                         (keys.group_persisted, data["group_persisted"])):
        if mapping:
            pipe.hset(key, mapping=mapping)
    for eid, fields in log:
        pipe.xadd(keys.update_log, dict(fields), id=eid)
    for eid, fields in data["applied_samples"]:
        pipe.xadd(keys.applied_samples, fields, id=eid)
    for eid, verdicts in data["applied_by"].items():
        pipe.hset(keys.applied_by(eid), mapping=verdicts)
    pipe.set(keys.unapplied, data["unapplied"])
    pipe.set(keys.meta, data["meta"])
    pipe.execute()


def restore_checkpoint(client: redis.Redis, path: str, *, job: str | None = None) -> tuple[int, ...]:
    """Restore the checkpoint at ``path`` into a Redis that has no model for the job.

    ``job`` restores under another job name (default: the checkpoint's).

    Returns:
        The restored model version (each group's version).

    Raises:
        CheckpointError: unreadable file, another format, the job already has a model, or
            another writer is creating it.
    """
    data = _load(path)
    job = job or data["job"]
    keys = JobKeys(job)
    meta = ModelMeta.from_json(data["meta"])
    token = uuid.uuid4().hex
    if not client.set(keys.init_lock, token, nx=True, px=_RESTORE_LOCK_MS):
        raise CheckpointError(f"job {job}: another writer is creating its model (init lock {keys.init_lock})")
    try:
        if client.exists(keys.meta):
            raise CheckpointError(f"job {job} already has a model in this Redis; restore into an empty one")
        for g, saved in enumerate(data["groups"]):
            _restore_group(client, job, meta, g, saved)
        _restore_job(client, job, data)
    finally:
        if client.get(keys.init_lock) == token.encode():
            client.delete(keys.init_lock)
    version = tuple(int(v) for v in data["version"])
    logger.info("job %s: restored version %s from %s (%d logged updates, %d unapplied)", job,
                version_name(version), path, len(data["log"]), data["unapplied"])
    return version
