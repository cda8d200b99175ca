"""Exporting a job's embedding tables in pieces: safetensors files of IDs and values, and a manifest.

``streamtrain export --tables-dir DIR`` writes, beside the dense part, each table group by group, read with
HSCAN while training goes on: each row as its group last wrote it, no cut (a checkpoint is one). The
manifest records each group's feed position before the read, so a copy loaded from the export and brought
up to date by the feed holds exactly the rows Redis holds. See docs/embeddings.md, *Export*.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from ..errors import ParameterPlaneError
from ..slot_types import VersionVector
from ..slots import read_meta
from ..tables.feed import feed_heads
from ..tables.rows import decode_values, pull_dtype
from .pieces import (
    MANIFEST,
    install_folder,
    new_folder,
    read_manifest,
    remove_folder,
    write_manifest,
    write_piece,
)
from .table_cut import live_pieces

logger = logging.getLogger(__name__)

__all__ = ["TABLES_EXPORT_FORMAT", "TablesExported", "export_tables"]

TABLES_EXPORT_FORMAT = "streamtrain-tables-1"
"""Format tag of an export's ``manifest.json``."""


@dataclass(frozen=True)
class TablesExported:
    """What :func:`export_tables` wrote."""

    tables: int
    """Tables exported."""
    rows: int
    """Rows in all."""
    pieces: int
    """Piece files."""


def _replaceable(folder: str) -> bool:
    """``folder`` is absent, empty, or an earlier export of tables."""
    if not os.path.lexists(folder):
        return True
    if not os.path.isdir(folder):
        return False
    if not os.listdir(folder):
        return True
    try:
        return read_manifest(folder).get("format") == TABLES_EXPORT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def export_tables(client: redis.Redis, job: str, folder: str, *, rows_per_piece: int = 65536) -> TablesExported:
    """Write every embedding table of ``job`` to ``folder`` in pieces (docs/embeddings.md, *Export*).

    Raises:
        NoModelError: the job has no model (a LayoutError).
        ParameterPlaneError: ``folder`` holds something other than an earlier export.
        OSError: it cannot be written.
    """
    if rows_per_piece < 1:
        raise ValueError(f"rows_per_piece must be >= 1, got {rows_per_piece!r}")
    meta = read_meta(client, job)
    if not _replaceable(folder):
        raise ParameterPlaneError(f"{folder} exists and is not an earlier export of tables (no {MANIFEST} of "
                                  f"{TABLES_EXPORT_FORMAT}): choose another --tables-dir")
    # each group's feed position before any of its rows is read: every change after it is in the feed,
    # and a row no entry after it names has not changed since (its value read here is current), so the
    # export plus the feed followed from these positions is exact
    feed = feed_heads(client, job, meta.groups)
    tmp = new_folder(folder)
    try:
        tables, rows, pieces = [], 0, 0
        for spec in meta.tables:
            listed: list[dict[str, Any]] = []
            for g in range(meta.groups):
                for n, piece in enumerate(live_pieces(client, job, g, spec, rows_per_piece)):
                    name = f"{spec.name}-{g}-{n}.safetensors"
                    records = piece.records.view(pull_dtype(spec)).reshape(-1)
                    write_piece(os.path.join(tmp, name), {"ids": piece.ids,
                                                          "values": decode_values(spec, records["values"]),
                                                          "versions": np.ascontiguousarray(records["version"])},
                                {"streamtrain.job": job, "streamtrain.table": spec.name, "streamtrain.dim": spec.dim,
                                 "streamtrain.group": g, "streamtrain.version": piece.version})
                    listed.append({"file": name, "group": g, "rows": int(piece.ids.size), "version": piece.version})
            count = sum(p["rows"] for p in listed)
            tables.append({"table": spec.name, "dim": spec.dim, "rows": count, "pieces": listed})
            rows, pieces = rows + count, pieces + len(listed)
        write_manifest(tmp, {"format": TABLES_EXPORT_FORMAT, "job": job, "groups": meta.groups,
                             "feed_position": VersionVector(feed).name(), "tables": tables})
        old = install_folder(tmp, folder)
    except BaseException:
        remove_folder(tmp)
        raise
    remove_folder(old)
    logger.info("job %s: %d table(s), %d row(s) exported to %s in %d piece(s)", job, len(tables), rows, folder,
                pieces)
    return TablesExported(len(tables), rows, pieces)
