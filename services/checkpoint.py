"""Checkpoints: a consistent snapshot of a job's parameter plane to one file, and back.

The snapshot is read in one MULTI/EXEC, so parameters, optimizer state, model
version, committed offsets, clocks and the not-yet-applied updates of the log
all belong to the same instant. Restoring them into an empty Redis resumes
training exactly: trainers restart at the committed offsets, and the pending
updates (whose offsets are already committed) are applied by the servers.

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

from streamtrain.keys import JobKeys

from .errors import LayoutError, ParameterPlaneError
from .optim import slots
from .store import ModelMeta
from .updates import blob_keys, parse_entry

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "restore_checkpoint", "CheckpointError", "FORMAT"]

FORMAT = "streamtrain-checkpoint-1"
"""Format tag stored in every checkpoint."""

_ATTEMPTS = 20

_HASHES = ("versions", "optimizer_steps", "offsets", "clocks", "applied_clocks", "apply_progress")


class CheckpointError(ParameterPlaneError):
    """A checkpoint file is unreadable or of another format, or the target Redis is not empty."""


def _b2s(d: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in d.items()}


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
        pending = {eid: blob_keys(job, parse_entry(eid, fields)) for eid, fields in before}
        wanted = [k for ks in pending.values() for k in ks]
        pipe = client.pipeline(transaction=True)
        pipe.get(keys.meta)
        pipe.get(keys.model_version)
        pipe.mget([keys.shard(i) for i in range(n)])
        if k:
            pipe.mget([keys.optimizer_state(i, s) for i in range(n) for s in range(k)])
        for name in _HASHES:
            pipe.hgetall(getattr(keys, name))
        pipe.mget([keys.ps_cursor(g) for g in range(meta.groups)])
        pipe.xrange(keys.update_log)
        if wanted:
            pipe.mget(wanted)
        res = pipe.execute()
        entries = res[4 + (1 if k else 0) + len(_HASHES)]
        if all(eid in pending for eid, _ in entries):
            break
    else:
        raise CheckpointError(f"job {job}: the update log kept moving; no consistent checkpoint "
                              f"in {_ATTEMPTS} attempts")
    blobs = dict(zip(wanted, res[-1], strict=True)) if wanted else {}
    meta_now, version, shards = res[0], int(res[1] or 0), res[2]
    if meta_now != raw_meta:
        raise CheckpointError(f"job {job}: model meta changed while checkpointing; retry")
    pos = 3
    opt = res[pos] if k else []
    pos += 1 if k else 0
    hashes = {name: _b2s(res[pos + j]) for j, name in enumerate(_HASHES)}
    pos += len(_HASHES)
    cursors = [(c or b"").decode() for c in res[pos]]
    log = [[eid.decode(), [[f, v] for f, v in fields.items()],
            [[key, blobs[key]] for key in pending[eid]]] for eid, fields in entries]
    data: dict[str, Any] = {
        "format": FORMAT, "job": job, "meta": raw_meta.decode(), "version": version,
        "shards": [torch.frombuffer(bytearray(b), dtype=torch.float32) for b in shards],
        "optimizer": [torch.frombuffer(bytearray(b), dtype=torch.float32) if b is not None else None
                      for b in opt],
        "hashes": hashes, "cursors": cursors, "log": log,
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
    for g, cursor in enumerate(data["cursors"]):
        if cursor:
            pipe.set(keys.ps_cursor(g), cursor)
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
