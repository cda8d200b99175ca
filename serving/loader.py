"""How a replica gets its first state, and a new one after the feed moved past it: the tables of an
export (a ``streamtrain export --tables-dir`` folder, or one the replica takes from Redis itself) at the
feed position the export names, with the dense part read from the coordinator.

Either state is exact once the feed is followed from its position: every change after it is in the
feed, and a row no entry after it names has not changed since it was read (docs/embeddings.md, *Export*).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import numpy as np
import redis
import torch

from services.slot_types import VersionVector
from services.slots import ModelMeta
from services.snapshot.pieces import read_manifest, read_piece
from services.snapshot.table_cut import live_pieces
from services.tables.feed import feed_heads
from services.tables.rows import decode_values, pull_dtype

from .rowstore import RowStore
from .state import ModuleFactory, ServedState

logger = logging.getLogger(__name__)

__all__ = ["ExportFolderError", "feed_position", "state_from_redis", "state_from_folder"]

_PIECE_ROWS = 65536


class ExportFolderError(ValueError):
    """An export folder the replica cannot start from (the message names why)."""


def _state(meta: ModelMeta, module: torch.nn.Module, dense_version: str, position: str, max_rows: int
           ) -> ServedState:
    return ServedState(module=module, tables={t.name: RowStore(t.dim, max_rows=max_rows) for t in meta.tables},
                       specs={t.name: t for t in meta.tables}, position=position, version="",
                       dense_version=dense_version, bounded=max_rows > 0)


def _room(store: RowStore, n: int) -> int:
    """Rows of ``n`` a store may still take without evicting (all, unbounded)."""
    return n if not store.max_rows else max(0, min(n, store.max_rows - store.rows))


def _last_read(ids: np.ndarray) -> np.ndarray | None:
    """Positions of the last occurrence of each ID of a piece, in order; None when no ID repeats.

    A table is read with HSCAN, which may return an entry twice (a hash resized between two steps,
    as the applies add rows and the sweeps remove them), and an export written from such a scan holds
    it twice too; :meth:`RowStore.upsert` refuses an ID twice in one call. The later read is never older
    than the earlier one, so it is kept."""
    if ids.size < 2:
        return None
    _, first_from_end = np.unique(ids[::-1], return_index=True)
    if first_from_end.size == ids.size:
        return None
    return np.sort(ids.size - 1 - first_from_end)


def feed_position(client: redis.Redis, job: str, groups: int) -> str:
    """The feed position to read an export's rows after (each group's newest)."""
    return VersionVector(feed_heads(client, job, groups)).name()


def state_from_redis(client: redis.Redis, job: str, meta: ModelMeta, dense: Mapping[str, torch.Tensor],
                     dense_version: str, factory: ModuleFactory, *, position: str, max_rows: int = 0) -> ServedState:
    """A state of the job's tables as Redis holds them now (each row as its group last wrote it), at feed
    ``position`` (:func:`feed_position`, read before the rows and the dense part: every change after it is
    in the feed); with ``max_rows``, the first ``max_rows`` rows of each table."""
    state = _state(meta, factory(dense), dense_version, position, max_rows)
    for spec in meta.tables:
        store = state.tables[spec.name]
        for g in range(meta.groups):
            for piece in live_pieces(client, job, g, spec, _PIECE_ROWS):
                ids, raw = piece.ids, piece.records
                keep = _last_read(ids)
                if keep is not None:
                    ids, raw = ids[keep], raw[keep]
                take = _room(store, ids.size)
                if take == 0:
                    break
                records = raw[:take].view(pull_dtype(spec)).reshape(-1)
                store.upsert(ids[:take], np.ascontiguousarray(decode_values(spec, records["values"])),
                             records["version"].copy())
        state.loaded[spec.name] = store.rows
    logger.info("job %s: loaded %d row(s) of %d table(s) from Redis at feed position %s", job, state.rows,
                len(meta.tables), position)
    return state


def state_from_folder(folder: str, job: str, meta: ModelMeta, dense: Mapping[str, torch.Tensor],
                      dense_version: str, factory: ModuleFactory, *, max_rows: int = 0) -> ServedState:
    """A state of the tables a ``streamtrain export --tables-dir`` folder holds, at the feed position its
    manifest names (each row with the version its piece names; 0 in an export written before pieces held
    them: the feed's rows are newer).

    Raises:
        ExportFolderError: the folder is not an export of this job's tables (another job, another number
            of groups, no feed position, a table missing or of another width), or it cannot be read.
    """
    try:
        return _from_folder(folder, job, meta, dense, dense_version, factory, max_rows)
    except OSError as exc:
        raise ExportFolderError(f"{folder}: cannot read the export: {exc}") from None


def _from_folder(folder: str, job: str, meta: ModelMeta, dense: Mapping[str, torch.Tensor], dense_version: str,
                 factory: ModuleFactory, max_rows: int) -> ServedState:
    try:
        manifest = read_manifest(folder)
    except ValueError as exc:
        raise ExportFolderError(f"{folder}: its manifest is not JSON: {exc}") from None
    if manifest.get("job") != job:
        raise ExportFolderError(f"{folder}: an export of job {manifest.get('job')!r}, not {job!r}")
    if int(manifest.get("groups", -1)) != meta.groups:
        raise ExportFolderError(f"{folder}: exported with {manifest.get('groups')} shard group(s); the job has "
                                f"{meta.groups}")
    position = manifest.get("feed_position")
    if not isinstance(position, str):
        raise ExportFolderError(f"{folder}: the manifest names no feed_position (exported before the feed existed)")
    listed = {t["table"]: t for t in manifest.get("tables", [])}
    state = _state(meta, factory(dense), dense_version, position, max_rows)
    state.source = os.path.abspath(folder)
    for spec in meta.tables:
        entry = listed.get(spec.name)
        if entry is None or int(entry.get("dim", -1)) != spec.dim:
            raise ExportFolderError(f"{folder}: table {spec.name!r} (dim {spec.dim}) is not in the export")
        store = state.tables[spec.name]
        for piece in entry["pieces"]:
            t = read_piece(os.path.join(folder, piece["file"]))
            ids, values = t["ids"], t["values"]
            versions = t["versions"] if "versions" in t else np.zeros(ids.size, np.uint64)  # older exports: none
            keep = _last_read(ids)
            if keep is not None:
                ids, values, versions = ids[keep], values[keep], versions[keep]
            take = _room(store, ids.size)
            if take:
                store.upsert(ids[:take], values[:take], versions[:take])
        state.loaded[spec.name] = store.rows
    logger.info("job %s: loaded %d row(s) of %d table(s) from %s at feed position %s", job, state.rows,
                len(meta.tables), folder, position)
    return state
