"""The atomic write of a batch of applied updates (``lua/apply.lua``), shared by every server group.

A server applies the pending updates it read one after another in memory and
then writes the result once: for every shard it changed, the coordinates the
batch changed and their new values as a versioned *delta* (and, when the
shard is due for compaction, its full bytes); for *each* update of the
batch, what a single apply records (``apply_progress``; for the group that
completes the update: ``applied_clocks``, the ``applied_samples`` entry and
the ``unapplied`` count); and, when the server persists its optimizer state,
that state, the step counts, the group's persisted cursor, and the removal
of the log entries (and gradient blobs) every group's persisted state now
includes; and, every few seconds, the server's :class:`Housekeeping` (trim
``applied_samples`` past its horizon, raising the audit floor; drop the
per-member fields of departed members). This module builds that MULTI/EXEC;
:mod:`services.server` decides what goes into it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import redis
import torch

from common.keys import JobKeys

from .scripts import execute_with_script
from .updates import Update
from .wire import pack

__all__ = ["Outcome", "ShardWrite", "Persist", "Housekeeping", "WriteResult", "write_batch"]


@dataclass(frozen=True)
class Outcome:
    """The verdict on one update of a batch, as its ``applied_samples`` entry records it."""

    update: Update
    """The update (its ``shards`` name the gradient blobs to delete; ``log_id`` is set)."""
    status: str
    """``applied`` or ``rejected``."""
    reason: str = ""
    """Why it was rejected (empty when applied)."""
    grad_bytes: int = 0
    """Bytes of its encoded gradients (what its trainer put on the wire)."""
    applied_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    """When the server applied (or refused) it, ms since the epoch."""

    def record(self) -> dict[str, str]:
        """Field/value pairs of its ``applied_samples`` entry."""
        u = self.update
        rec = {"update": u.log_id, "member": u.member_id, "generation": str(u.generation),
               "clock": str(u.clock), "status": self.status,
               "samples": json.dumps([list(s) for s in u.samples]),
               "offsets": json.dumps([[p, f, n] for p, (f, n) in sorted(u.offsets.items())]),
               "batch_size": str(u.batch_size), "produced_ts_ms": str(u.produced_ts_ms),
               "applied_ms": str(self.applied_ms), "grad_bytes": str(self.grad_bytes)}
        if self.reason:
            rec["reason"] = self.reason
        return rec


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
    """(update id, its gradient blob keys) of the updates applied since the group's previous
    persist: removed from the log once every group's persisted state includes them."""


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
    return memoryview(t.numpy()).cast("B")


def write_batch(client: redis.Redis, job: str, *, group: int, groups: int, cursor: str,
                outcomes: Sequence[Outcome], shards: Sequence[ShardWrite], persist: Persist | None = None,
                housekeeping: Housekeeping | None = None,
                before_exec: Callable[[], None] = lambda: None) -> WriteResult:
    """Write a batch's deltas, compactions, per-update records and (optionally) the group's
    persisted optimizer state and the :class:`Housekeeping` in one MULTI/EXEC, if nothing moved
    since ``cursor``.

    Full values are SET under staging keys in the same transaction and RENAMEd
    into place by the script (or deleted when the compare-and-set fails); deltas
    travel as script arguments. ``before_exec`` runs just before the EVALSHA is
    queued (fault injection). The cursor moves to the last update of ``outcomes``
    (it stays with none, e.g. a persist on its own); the model version is bumped
    once when any shard is written.
    """
    keys = JobKeys(job)
    fixed = [keys.ps_cursor(group), keys.versions, keys.model_version, keys.apply_progress,
             keys.applied_clocks, keys.applied_samples, keys.update_log, keys.optimizer_steps,
             keys.bases, keys.delta_floors, keys.unapplied, keys.ps_persisted(group),
             keys.members, keys.clocks, keys.staleness, keys.audit_floor,
             *(keys.ps_persisted(g) for g in range(groups))]
    token = uuid.uuid4().hex
    staged: list[tuple[str, memoryview]] = []
    renames: list[str] = []

    def stage(dest: str, value: torch.Tensor) -> None:
        key = keys.staging(token, len(staged))
        staged.append((key, _view(value)))
        renames.extend((key, dest))

    for w in shards:
        if w.full is not None:
            stage(keys.shard(w.index), w.full)
        elif w.delta is None:
            raise ValueError(f"shard {w.index}: a write needs a delta or the full values")
    if persist is not None:
        for index, slot, value in persist.state:
            stage(keys.optimizer_state(index, slot), value)
    streams = [keys.deltas(w.index) for w in shards]
    first_stream = len(fixed) + len(renames) + 1  # 1-based KEYS index
    args: list = []
    plan_shards = []
    for j, w in enumerate(shards):
        if w.delta is not None:
            args.append(w.delta)
        plan_shards.append([w.index, w.version_read, len(args) + 1 if w.delta is not None else 0,
                            int(w.full is not None), first_stream + j])
    plan_updates = []
    for o in outcomes:
        record = o.record()
        plan_updates.append([o.update.log_id, o.update.member_id, o.update.clock,
                             [x for kv in record.items() for x in kv]])
    trim_keys: list[str] = []
    plan: dict = {"cursor": cursor, "groups": groups, "renames": len(renames) // 2,
                  "shards": plan_shards, "updates": plan_updates, "persist": 0,
                  "housekeep": 0 if housekeeping is None else [housekeeping.horizon_ms, housekeeping.most]}
    if persist is not None:
        trims = []
        for uid, blobs in persist.covered:
            trims.append([uid, first_stream + len(streams) + len(trim_keys), len(blobs)])
            trim_keys += blobs
        plan["persist"] = {"steps": [x for kv in sorted(persist.steps.items()) for x in kv], "trim": trims}
    all_keys = [*fixed, *renames, *streams, *trim_keys]
    argv = [pack(plan), *args]

    def build(pipe: redis.client.Pipeline, sha: str) -> None:
        for key, value in staged:
            pipe.set(key, value)
        before_exec()
        pipe.evalsha(sha, len(all_keys), *all_keys, *argv)

    res = execute_with_script(client, "apply", build)[-1]
    tag = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
    if tag != "OK":
        return WriteResult(ok=False, conflict=" ".join(x.decode() if isinstance(x, bytes) else str(x)
                                                       for x in res))
    return WriteResult(ok=True, version=int(res[1]), trimmed=int(res[3]), more=bool(int(res[4])),
                       forgotten=int(res[5]))
