"""Checkpoints: a consistent snapshot of a job's parameter plane to one file, and back.

The snapshot is read in one MULTI/EXEC, so the published parameters (full
shards and their deltas), the servers' persisted optimizer state, model
version, committed offsets, clocks, cursors and the updates the log still
holds all belong to the same instant. Restoring them into an empty Redis
resumes training exactly: trainers restart at the committed offsets, servers
replay the updates their persisted state lacks and apply the pending ones
(whose offsets are already committed).

Format: ``torch.save`` of a dict of tensors, strings and bytes, loaded with
``weights_only=True`` (no pickled code).
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from typing import Any

import redis
import torch

from common.keys import JobKeys

from .errors import LayoutError, ParameterPlaneError
from .optim import slots
from .store import ModelMeta
from .updates import blob_keys, parse_entry

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "restore_checkpoint", "CheckpointError", "FORMAT"]

FORMAT = "streamtrain-checkpoint-2"
"""Format tag stored in every checkpoint."""

_ATTEMPTS = 20

_HASHES = ("versions", "bases", "delta_floors", "optimizer_steps", "offsets", "clocks", "applied_clocks",
           "apply_progress")


class CheckpointError(ParameterPlaneError):
    """A checkpoint file is unreadable or of another format, or the target Redis is not empty."""


def _b2s(d: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in d.items()}


def _blob_keys(job: str, eid: bytes, fields: dict[bytes, bytes]) -> list[str]:
    """The gradient blob keys a log entry names (none for a malformed one, which was refused)."""
    try:
        return blob_keys(job, parse_entry(eid, fields))
    except ParameterPlaneError:
        return []


def save_checkpoint(client: redis.Redis, job: str, path: str) -> int:
    """Write a consistent snapshot of ``job`` to ``path`` (atomically via a temp file).

    Returns:
        The model version it holds.

    Raises:
        LayoutError: the job has no model.
    """
    keys = JobKeys(job)
    raw_meta = client.get(keys.meta)
    if raw_meta is None:
        raise LayoutError(f"job {job} has no model to checkpoint")
    meta = ModelMeta.from_json(raw_meta)
    n = len(meta.layout.shards)
    k = slots(meta.optimizer)
    for _ in range(_ATTEMPTS):
        # the log entries name their gradient blobs: read them first, then everything in one MULTI,
        # and accept when the MULTI saw no entry we had not named blobs for
        before = client.xrange(keys.update_log)
        pending = {eid: _blob_keys(job, eid, fields) for eid, fields in before}
        wanted = [k for ks in pending.values() for k in ks]
        pipe = client.pipeline(transaction=True)
        pipe.get(keys.meta)
        pipe.get(keys.model_version)
        pipe.get(keys.unapplied)
        pipe.mget([keys.shard(i) for i in range(n)])
        pipe.mget([keys.optimizer_state(i, s) for i in range(n) for s in range(k)] or [keys.meta])
        for name in _HASHES:
            pipe.hgetall(getattr(keys, name))
        pipe.mget([keys.ps_cursor(g) for g in range(meta.groups)])
        pipe.mget([keys.ps_persisted(g) for g in range(meta.groups)])
        for i in range(n):
            pipe.xrange(keys.deltas(i))
        pipe.xrange(keys.update_log)
        pipe.mget(wanted or [keys.meta])
        meta_now, raw_version, unapplied, shards, opt, *rest = pipe.execute()
        hashes = {name: _b2s(h) for name, h in zip(_HASHES, rest[:len(_HASHES)])}
        cursors, persisted = rest[len(_HASHES)], rest[len(_HASHES) + 1]
        deltas = rest[len(_HASHES) + 2:len(_HASHES) + 2 + n]
        entries, blob_values = rest[-2], rest[-1]
        if all(eid in pending for eid, _ in entries):
            break
    else:
        raise CheckpointError(f"job {job}: the update log kept moving; no consistent checkpoint "
                              f"in {_ATTEMPTS} attempts")
    blobs = dict(zip(wanted, blob_values, strict=True)) if wanted else {}
    if meta_now != raw_meta:
        raise CheckpointError(f"job {job}: model meta changed while checkpointing; retry")
    version = int(raw_version or 0)
    log = [[eid.decode(), [[f, v] for f, v in fields.items()],
            [[key, blobs[key]] for key in pending[eid]]] for eid, fields in entries]
    data: dict[str, Any] = {
        "format": FORMAT, "job": job, "meta": raw_meta.decode(), "version": version,
        "unapplied": int(unapplied or 0),
        "shards": [torch.frombuffer(bytearray(b), dtype=torch.float32) for b in shards],
        "optimizer": [torch.frombuffer(bytearray(b), dtype=torch.float32) if b is not None else None
                      for b in opt] if k else [],
        "hashes": hashes, "cursors": [(c or b"").decode() for c in cursors],
        "persisted": [(c or b"").decode() for c in persisted],
        "deltas": [[[eid.decode(), fields[b"d"]] for eid, fields in stream] for stream in deltas],
        "log": log,
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
    logger.info("job %s: checkpoint of version %d (%d pending updates) saved to %s", job, version, len(log), path)
    return version


def restore_checkpoint(client: redis.Redis, path: str, *, job: str | None = None) -> int:
    """Restore the checkpoint at ``path`` into a Redis that has no model for the job.

    ``job`` restores under another job name (default: the checkpoint's).

    Returns:
        The restored model version.

    Raises:
        CheckpointError: unreadable file, wrong format, or the job already has a model.
    """
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        reason = str(exc).splitlines()[0]
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    job = job or data["job"]
    keys = JobKeys(job)
    if client.exists(keys.meta):
        raise CheckpointError(f"job {job} already has a model in this Redis; restore into an empty one")
    meta = ModelMeta.from_json(data["meta"])
    k = slots(meta.optimizer)
    pipe = client.pipeline(transaction=True)
    for i, t in enumerate(data["shards"]):
        pipe.set(keys.shard(i), t.numpy().tobytes())
    for j, t in enumerate(data["optimizer"]):
        if t is not None:
            pipe.set(keys.optimizer_state(j // k, j % k), t.numpy().tobytes())
    for name, mapping in data["hashes"].items():
        if mapping:
            pipe.hset(getattr(keys, name), mapping=mapping)
    for g, (cursor, persisted) in enumerate(zip(data["cursors"], data["persisted"], strict=True)):
        if cursor:
            pipe.set(keys.ps_cursor(g), cursor)
        if persisted:
            pipe.set(keys.ps_persisted(g), persisted)
    for i, stream in enumerate(data["deltas"]):
        for eid, blob in stream:
            pipe.xadd(keys.deltas(i), {"d": blob}, id=eid)
    pipe.set(keys.unapplied, data["unapplied"])
    old = JobKeys(data["job"])
    for eid, fields, blobs in data["log"]:
        for key, blob in blobs:  # blob keys carry the job name: re-key them for a renamed job
            pipe.set(keys.key(*str(key).split(":")[2:]) if old != keys else key, blob)
        pipe.xadd(keys.update_log, dict(fields), id=eid)
    pipe.set(keys.model_version, data["version"])
    pipe.set(keys.meta, data["meta"])
    pipe.execute()
    logger.info("job %s: restored version %d from %s (%d pending updates)", job, data["version"], path,
                len(data["log"]))
    return int(data["version"])
