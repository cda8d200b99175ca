"""Checkpoints: a consistent cut of a job's parameter plane to one file (and its embedding tables to a
folder beside it), and back.

The cut is :mod:`services.snapshot.cut` (each of the job's ``1 + G`` slots read in its own MULTI/EXEC,
the accounting rolled back in the file to each group's cut; the tables saved as of each group's cut by
``services.snapshot.checkpoint_tables``). A restore empties each group with ``services.slots.GroupSlot``
(the same list of keys as creating the model) and writes the job's slot with the meta last, so a reader
that sees the model finds everything in place. The format (``streamtrain-checkpoint-4``; ``-3`` files
still restore), what is saved and why it restores exactly: ``docs/parameter-plane.md`` (*Checkpoints*).
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import uuid
from collections.abc import Callable, Mapping
from typing import Any, cast

import redis
import torch

from common.keys import JobKeys

from ..errors import CheckpointError
from ..slot_types import VersionVector
from ..slots import JOB_HASHES, SHARD_HASHES, GroupSlot, JobSlot, ModelMeta
from .checkpoint_tables import TABLES_FORMAT, SavedPiece, check_tables, restore_tables, save_tables, tables_folder
from .cut import let_go, read_cut
from .pieces import install_folder, new_folder, read_manifest, remove_folder

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "restore_checkpoint", "CheckpointError", "SavedPiece", "FORMAT", "ROWS_PER_PIECE"]

FORMAT = "streamtrain-checkpoint-4"
"""Format tag stored in every checkpoint."""
_READABLE = ("streamtrain-checkpoint-3", FORMAT)
"""Formats a restore reads (3: before tables were saved; a file of it holds no table)."""
ROWS_PER_PIECE = 65536
"""Default entries per piece of a table (``save_checkpoint``'s ``rows_per_piece``)."""
_RESTORE_LOCK_MS = 600_000
"""How long a restore holds the job's init lock (renewed after each piece of a table)."""


# -- save ------------------------------------------------------------------------------------------

def _floats(blob: bytes | None) -> torch.Tensor | None:
    return None if blob is None else torch.frombuffer(bytearray(blob), dtype=torch.float32)


def save_checkpoint(client: redis.Redis, job: str, path: str, *, rows_per_piece: int = ROWS_PER_PIECE,
                    wait_s: float = 0.0, progress: Callable[[SavedPiece], None] | None = None) -> tuple[int, ...]:
    """Write a consistent cut of ``job`` to ``path``, and its embedding tables, in pieces of
    ``rows_per_piece`` entries, to the folder ``<path>.tables`` (atomically: both are written under
    temporary names, the folder renamed into place, the file last).

    ``wait_s``: how long to wait for another save that holds a group's cut of its tables (0: refuse at
    once). ``progress`` is called after each piece of a table is written.

    Returns:
        The model version it holds: each group's version (a ``VersionVector``).

    Raises:
        NoModelError: the job has no model (a LayoutError).
        CheckpointError: no consistent cut in ``_ATTEMPTS`` attempts, the slots contradict each
            other, another save holds a cut longer than ``wait_s``, a cut was lost while the
            tables were read, or ``<path>.tables`` is something else than a checkpoint's tables.
        OSError: the file or the folder cannot be written.
    """
    if rows_per_piece < 1:
        raise ValueError(f"rows_per_piece must be >= 1, got {rows_per_piece!r}")
    stored = JobSlot(client, job).read("meta")
    meta, raw_meta = stored.model(), cast(bytes, stored.meta)
    if meta.tables and os.path.lexists(tables_folder(path)) and not _ours(tables_folder(path)):
        raise CheckpointError(f"{tables_folder(path)} exists and is not a checkpoint's tables folder (no "
                              f"{TABLES_FORMAT} manifest): the tables of {path} go there; move it or save elsewhere")
    owner = uuid.uuid4().hex
    tmp_tables = None
    try:
        cut = read_cut(client, job, raw_meta, meta, owner, wait_s)
        groups, state = cut.groups, cut.state
        version = VersionVector(group.version for group in groups)
        data: dict[str, Any] = {
            "format": FORMAT, "job": job, "meta": raw_meta.decode(), "version": list(version),
            "groups": [{
                "version": group.version, "cursor": group.cursor, "persisted": group.persisted,
                "unaccounted": group.plan, "hashes": group.hashes,
                "shards": {str(i): _floats(b) for i, b in group.shards.items()},
                "optimizer": {f"{i}:{s}": _floats(b) for (i, s), b in group.optimizer.items() if b is not None},
                "deltas": {str(i): [[eid, blob] for eid, blob in stream] for i, stream in group.deltas.items()},
                "blobs": [[token, i, blob] for (token, i), blob in group_blobs.items()],
                "table_stats": group.table_stats,
                "row_blobs": [[token, blob] for token, blob in group_rows.items()],
            } for group, group_blobs, group_rows in zip(groups, cut.blobs, cut.row_blobs, strict=True)],
            "log": [[eid, [[f, v] for f, v in fields.items()]] for eid, fields in state.log],
            "hashes": state.hashes, "unapplied": state.unapplied,
            "group_accounted": {str(g): c for g, c in state.accounted.items()},
            "group_persisted": {str(g): c for g, c in state.persisted.items()},
            "applied_samples": [[eid, fields] for eid, fields in state.applied_samples],
            "applied_by": state.applied_by,
            "tables": None,
        }
        records = 0
        if meta.tables:
            tmp_tables = new_folder(tables_folder(path))
            manifest = save_tables(client, job, meta, version, owner, tmp_tables, rows_per_piece=rows_per_piece,
                                   progress=progress)
            records = sum(e[kind]["records"] for e in manifest["tables"] for kind in ("rows", "seen"))
            data["tables"] = {"folder": os.path.basename(tables_folder(path)), "save": owner}
    except BaseException:
        remove_folder(tmp_tables)
        raise
    finally:
        let_go(client, job, meta, owner)
    _write(path, data, tmp_tables)
    logger.info("job %s: checkpoint of version %s (%d logged updates, %d un-completed to fit the groups' cut, "
                "%d attempt(s); %d table record(s)) saved to %s", job, version.name(), len(state.log),
                state.uncompleted, cut.attempts, records, path)
    return version


def _write(path: str, data: Mapping[str, Any], tables: str | None) -> None:
    """``data`` to ``path`` via a temporary file, once the finished tables folder ``tables`` (None:
    the model has no tables) is renamed into place; a tables folder of an earlier save to ``path`` is
    deleted once the file no longer names it."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(data, fh)
    except BaseException:
        os.unlink(tmp)
        remove_folder(tables)
        raise
    dest = tables_folder(path)
    old = install_folder(tables, dest) if tables is not None else None
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        if tables is not None:  # put the earlier save's folder back: its file still names it
            remove_folder(dest)
            if old is not None:
                os.rename(old, dest)
        raise
    remove_folder(old)
    if tables is None and _ours(dest):
        remove_folder(dest)


def _ours(folder: str) -> bool:
    """``folder`` is a checkpoint's tables folder."""
    try:
        return read_manifest(folder).get("format") == TABLES_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# -- restore ---------------------------------------------------------------------------------------

def _load(path: str) -> dict[str, Any]:
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        reason = str(exc).splitlines()[0]
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}") from None
    if not isinstance(data, dict) or data.get("format") not in _READABLE:
        found = data.get("format") if isinstance(data, dict) else None
        older = (f" (it is {found}, written before a job's keys were split into one hash slot per shard group; "
                 "restore it with the streamtrain version that wrote it)" if isinstance(found, str)
                 and found.startswith("streamtrain-checkpoint-") else "")
        raise CheckpointError(f"{path} is not a {FORMAT} file{older}")
    return data


def _bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _restore_group(client: redis.Redis, job: str, meta: ModelMeta, group: int, saved: Mapping[str, Any]) -> None:
    """One MULTI/EXEC writing the group's slot (replacing what a failed restore may have left) but its
    tables' rows and sighting records, which it empties (:func:`restore_tables` writes them)."""
    slot = GroupSlot.of(client, job, meta, group)
    gk = slot.keys
    pipe = client.pipeline(transaction=True)
    # the feed starts over past every position before the restore (its rows were not recorded in it):
    # a consumer that follows it from before reads `gone` and reloads the tables
    slot.clear(pipe, restored=True)
    for i in slot.own:
        pipe.set(gk.shard(i), _bytes(saved["shards"][str(i)]))
        for eid, blob in saved["deltas"][str(i)]:
            pipe.xadd(gk.deltas(i), {"d": blob}, id=eid)
    for name in SHARD_HASHES:
        if saved["hashes"][name]:
            pipe.hset(getattr(gk, name), mapping=saved["hashes"][name])
    for slot, t in saved["optimizer"].items():
        i, s = slot.split(":")
        pipe.set(gk.optimizer_state(int(i), int(s)), _bytes(t))
    for token, i, blob in saved["blobs"]:
        pipe.set(gk.update_blob(token, i), blob)
    for token, blob in saved.get("row_blobs", []):
        pipe.set(gk.rows_blob(token), blob)
    if saved.get("table_stats"):
        pipe.hset(gk.table_stats, mapping=saved["table_stats"])
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
                *(getattr(keys, name) for name in JOB_HASHES), *(keys.applied_by(eid) for eid, _ in log))
    for name in JOB_HASHES:
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


def _tables(path: str, data: Mapping[str, Any], meta: ModelMeta) -> dict[str, Any] | None:
    """The checked manifest of the file's tables (None: the model has none).

    Raises:
        CheckpointError: a file of a format that did not save tables, of a model with tables; or the
            tables folder is incomplete or disagrees with the file (``check_tables``).
    """
    if not meta.tables:
        return None
    saved = data.get("tables")
    if not saved:
        raise CheckpointError(f"{path} is a {data['format']} file of a model with embedding tables "
                              f"{[t.name for t in meta.tables]}, but it holds none of their rows (written before "
                              f"checkpoints saved tables); restore it with the streamtrain version that wrote it")
    return check_tables(path, saved, meta, [int(v) for v in data["version"]])


def restore_checkpoint(client: redis.Redis, path: str, *, job: str | None = None) -> tuple[int, ...]:
    """Restore the checkpoint at ``path`` (and its tables folder) into a Redis that has no model for
    the job. The tables folder is checked whole before anything is written.

    ``job`` restores under another job name (default: the checkpoint's).

    Returns:
        The restored model version (each group's version).

    Raises:
        CheckpointError: unreadable file, another format, missing or disagreeing pieces of its
            tables (named), the job already has a model, or another writer is creating it.
    """
    data = _load(path)
    job = job or data["job"]
    keys = JobKeys(job)
    meta = ModelMeta.from_json(data["meta"])
    manifest = _tables(path, data, meta)
    token = uuid.uuid4().hex
    if not client.set(keys.init_lock, token, nx=True, px=_RESTORE_LOCK_MS):
        raise CheckpointError(f"job {job}: another writer is creating its model (init lock {keys.init_lock})")

    def still_ours() -> None:  # a large table takes a while: the lock is renewed after each piece
        if client.get(keys.init_lock) != token.encode() or not client.pexpire(keys.init_lock, _RESTORE_LOCK_MS):
            raise CheckpointError(f"job {job}: the init lock {keys.init_lock} expired while restoring; restore "
                                  "again")

    records = 0
    try:
        if client.exists(keys.meta):
            raise CheckpointError(f"job {job} already has a model in this Redis; restore into an empty one")
        for g, saved in enumerate(data["groups"]):
            _restore_group(client, job, meta, g, saved)
            if manifest is not None:
                folder = os.path.join(os.path.dirname(os.path.abspath(path)), data["tables"]["folder"])
                records += restore_tables(client, job, g, folder, manifest, between=still_ours)
        _restore_job(client, job, data)
    finally:
        if client.get(keys.init_lock) == token.encode():
            client.delete(keys.init_lock)
    version = VersionVector(int(v) for v in data["version"])
    logger.info("job %s: restored version %s from %s (%d logged updates, %d unapplied, %d table record(s))", job,
                version.name(), path, len(data["log"]), data["unapplied"], records)
    return version
