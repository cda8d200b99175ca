"""The atomic write of a batch of applied updates (``lua/apply.lua``), shared by every server group.

A server applies the pending updates it read one after another in memory and
then writes the result once: the final bytes of every shard it changed (and
their optimizer state) plus, for *each* update of the batch, what a single
apply records (``apply_progress``; for the group that completes the update:
``applied_clocks``, the ``applied_samples`` entry, the XDEL and the gradient
blob deletes). This module builds that MULTI/EXEC; :mod:`services.server`
decides what goes into it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis
import torch

from streamtrain.keys import JobKeys

from .scripts import execute_with_script
from .updates import Update, blob_keys

__all__ = ["Outcome", "ShardWrite", "WriteResult", "write_batch"]


@dataclass(frozen=True)
class Outcome:
    """The verdict on one update of a batch, as its ``applied_samples`` entry records it."""

    update: Update
    """The update (its ``shards`` name the gradient blobs to delete; ``log_id`` is set)."""
    status: str
    """``applied`` or ``rejected``."""
    reason: str = ""
    """Why it was rejected (empty when applied)."""
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
               "applied_ms": str(self.applied_ms)}
        if self.reason:
            rec["reason"] = self.reason
        return rec


@dataclass(frozen=True)
class ShardWrite:
    """One shard's final state after the batch."""

    index: int
    """Shard index."""
    version_read: int
    """Its version when the server loaded it (compare-and-set)."""
    step: int
    """Optimizer steps applied to it after the batch."""
    values: tuple[torch.Tensor, ...]
    """The shard's parameters, then its optimizer slots (contiguous float32, sent without a copy)."""


@dataclass(frozen=True)
class WriteResult:
    """What ``lua/apply.lua`` answered."""

    ok: bool
    """True when written; False when the cursor or a shard version had moved (nothing written)."""
    version: int = 0
    """Model version after the write (unchanged when no shard was written)."""
    conflict: str = ""
    """What moved, when not ok."""


def _view(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous float32 tensor (redis-py sends memoryviews as they are)."""
    return memoryview(t.numpy()).cast("B")


def write_batch(client: redis.Redis, job: str, *, group: int, groups: int, cursor: str,
                outcomes: Sequence[Outcome], shards: Sequence[ShardWrite], slots: int,
                before_exec: Callable[[], None] = lambda: None) -> WriteResult:
    """Write a batch's shards and per-update records in one MULTI/EXEC, if nothing moved since ``cursor``.

    The new values are SET under staging keys in the same transaction and
    RENAMEd into place by the script (or deleted when the compare-and-set fails).
    ``before_exec`` runs just before the EVALSHA is queued (fault injection).
    The cursor moves to the last update of ``outcomes``; the model version is
    bumped once when any shard is written.
    """
    keys = JobKeys(job)
    fixed = [keys.ps_cursor(group), keys.versions, keys.model_version, keys.apply_progress,
             keys.applied_clocks, keys.applied_samples, keys.update_log, keys.optimizer_steps]
    token = uuid.uuid4().hex
    staged: list[tuple[str, memoryview]] = []
    pair_keys: list[str] = []
    args: list = [cursor, groups, len(shards), slots, len(outcomes)]
    for w in shards:
        if len(w.values) != 1 + slots:
            raise ValueError(f"shard {w.index}: {len(w.values)} tensors, expected 1 + {slots} slots")
        dests = [keys.shard(w.index), *(keys.optimizer_state(w.index, s) for s in range(slots))]
        for dest, value in zip(dests, w.values, strict=True):
            stage = keys.staging(token, len(staged))
            staged.append((stage, _view(value)))
            pair_keys += [stage, dest]
        args += [w.index, w.version_read, w.step]
    blobs: list[str] = []
    for o in outcomes:
        own_blobs = blob_keys(job, o.update)
        record = o.record()
        args += [o.update.log_id, o.update.member_id, o.update.clock, len(own_blobs), len(record)]
        for name, value in record.items():
            args += [name, value]
        blobs += own_blobs
    all_keys = [*fixed, *pair_keys, *blobs]

    def build(pipe: redis.client.Pipeline, sha: str) -> None:
        for stage, value in staged:
            pipe.set(stage, value)
        before_exec()
        pipe.evalsha(sha, len(all_keys), *all_keys, *args)

    res = execute_with_script(client, "apply", build)[-1]
    tag = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
    if tag != "OK":
        return WriteResult(ok=False, conflict=" ".join(x.decode() if isinstance(x, bytes) else str(x)
                                                       for x in res))
    return WriteResult(ok=True, version=int(res[1]))
