"""A checkpoint's embedding tables: streamed in pieces into a folder beside the checkpoint file, and back.

:func:`save_tables` writes each table of each group as of the group's cut (``services.snapshot.table_cut``)
into ``<checkpoint>.tables/`` (:func:`tables_folder`): safetensors pieces of records exactly as Redis stores
them, and a manifest that carries the save's token. :func:`check_tables` checks the whole folder before
:func:`restore_tables` writes anything back, a piece at a time.
See docs/embeddings.md, *Checkpoints: a cut of the rows while the servers apply*.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from common.keys import JobKeys

from ..errors import CheckpointError
from ..store import ModelMeta
from ..tables.rows import SEEN_DTYPE, row_dtype
from ..tables.spec import TableSpec
from .pieces import piece_header, read_manifest, read_piece, write_manifest, write_piece
from .table_cut import cut_pieces, drop_cut, keep_cut

logger = logging.getLogger(__name__)

__all__ = ["TABLES_FORMAT", "KINDS", "SavedPiece", "tables_folder", "save_tables", "check_tables", "restore_tables"]

TABLES_FORMAT = "streamtrain-checkpoint-4-tables"
"""Format tag of a checkpoint's tables folder (its manifest)."""

KINDS = ("rows", "seen")
"""What a table's pieces hold: rows, or sighting records of IDs not admitted yet."""

_HSET_CHUNK = 1000
"""Entries per HSET of a restore (a piece is one pipeline of them)."""


@dataclass(frozen=True)
class SavedPiece:
    """One piece a save wrote (what ``save_checkpoint``'s ``progress`` is called with)."""

    group: int
    """Shard group."""
    table: str
    """Table name."""
    kind: str
    """One of :data:`KINDS`."""
    file: str
    """Its file name in the tables folder."""
    records: int
    """Records in it."""


def tables_folder(path: str) -> str:
    """The tables folder of the checkpoint file ``path``."""
    return f"{path}.tables"


def _record(kind: str, spec: TableSpec) -> np.dtype:
    return row_dtype(spec) if kind == "rows" else SEEN_DTYPE


def _layout(dtype: np.dtype, spec: TableSpec | None = None) -> str:
    """A record's fields, for a piece's metadata: ``version <u8 | values <f4[4] | ...``; a row's values
    or state kept as bfloat16 (``spec``'s types) read ``bfloat16``, not the ``<u2`` that holds them."""
    out = []
    fields = dtype.fields
    assert dtype.names is not None and fields is not None, "a record dtype has fields"
    named = {"values": spec.value_dtype, "state": spec.state_dtype} if spec is not None else {}
    for name in dtype.names:
        sub = fields[name][0]
        shape = f"[{', '.join(map(str, sub.shape))}]" if sub.shape else ""
        kind = "bfloat16" if named.get(name) == "bfloat16" else sub.base.str
        out.append(f"{name} {kind}{shape}")
    return " | ".join(out)


def save_tables(client: redis.Redis, job: str, meta: ModelMeta, versions: Sequence[int], owner: str, folder: str,
                *, rows_per_piece: int, progress: Callable[[SavedPiece], None] | None = None) -> dict[str, Any]:
    """Write every table of every group as of the group's cut (at ``versions[g]``, held by ``owner``)
    into ``folder``, piece by piece, and its manifest; each group's cut is renewed after every piece
    and let go once its tables are written. Returns the manifest.

    Raises:
        CheckpointError: a cut was lost meanwhile (it expired: the save stalled longer than its
            expiry, or another save took it), so the shadows no longer hold what the cut needs.
    """
    entries = []
    held = list(range(len(versions)))

    def renew() -> None:
        for g in held:
            if not keep_cut(client, job, g, meta.tables, owner):
                raise CheckpointError(f"job {job}: the cut of group {g}'s tables was lost while saving them "
                                      f"(expired, or taken by another save); save again")

    for g, version in enumerate(versions):
        for spec in meta.tables:
            entry: dict[str, Any] = {"table": spec.name, "group": g, "version": version}
            for kind in KINDS:
                dtype = _record(kind, spec)
                pieces = []
                for n, piece in enumerate(cut_pieces(client, job, g, spec, version, kind, rows_per_piece)):
                    name = f"{spec.name}-{g}-{kind}-{n}.safetensors"
                    write_piece(os.path.join(folder, name), {"ids": piece.ids, "records": piece.records},
                                {"streamtrain.job": job, "streamtrain.table": spec.name, "streamtrain.group": g,
                                 "streamtrain.kind": kind, "streamtrain.version": version,
                                 "streamtrain.record": _layout(dtype, spec if kind == "rows" else None)})
                    pieces.append({"file": name, "records": int(piece.ids.size)})
                    renew()
                    if progress is not None:
                        progress(SavedPiece(g, spec.name, kind, name, int(piece.ids.size)))
                entry[kind] = {"record_bytes": dtype.itemsize, "records": sum(p["records"] for p in pieces),
                               "pieces": pieces}
            entries.append(entry)
        renew()  # nothing the cut needs was lost while this group's tables were read
        held.remove(g)
        drop_cut(client, job, g, meta.tables, owner)
    manifest = {"format": TABLES_FORMAT, "save": owner, "job": job, "rows_per_piece": rows_per_piece,
                "tables": entries}
    write_manifest(folder, manifest)
    return manifest


def check_tables(path: str, saved: Mapping[str, Any], meta: ModelMeta, versions: Sequence[int]) -> dict[str, Any]:
    """The manifest of checkpoint ``path``'s tables folder (``saved``: what the file says of it),
    checked whole without reading the data: every (group, table) of the model listed once at the
    group's version, every piece there with the records the manifest gives.

    Raises:
        CheckpointError: naming what is missing or disagrees.
    """
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), saved["folder"])
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint {path}: its tables folder {folder} is missing (copy it with the file)")
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read the manifest of {folder}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != TABLES_FORMAT:
        raise CheckpointError(f"checkpoint {path}: {folder} is not a {TABLES_FORMAT} folder")
    if manifest.get("save") != saved["save"]:
        raise CheckpointError(f"checkpoint {path}: {folder} holds the tables of another save (its token "
                              f"{manifest.get('save')!r}, the file's {saved['save']!r})")
    specs = {t.name: t for t in meta.tables}
    want = {(g, t) for g in range(meta.groups) for t in specs}
    listed = [(e.get("group"), e.get("table")) for e in manifest.get("tables", [])]
    if sorted(listed, key=str) != sorted(want, key=str):
        raise CheckpointError(f"checkpoint {path}: the manifest of {folder} lists (group, table) "
                              f"{sorted(listed, key=str)}, the model has {sorted(want)}")
    for entry in manifest["tables"]:
        g, spec = entry["group"], specs[entry["table"]]
        if entry.get("version") != versions[g]:
            raise CheckpointError(f"checkpoint {path}: table {spec.name} of group {g} is saved at version "
                                  f"{entry.get('version')}, the group's cut at {versions[g]}")
        for kind in KINDS:
            _check_kind(path, folder, entry, kind, spec)
    return manifest


def _check_kind(path: str, folder: str, entry: Mapping[str, Any], kind: str, spec: TableSpec) -> None:
    what = f"table {spec.name} of group {entry['group']} ({kind})"
    part = entry.get(kind)
    width = _record(kind, spec).itemsize
    if not isinstance(part, dict) or part.get("record_bytes") != width:
        raise CheckpointError(f"checkpoint {path}: {what}: the manifest gives no pieces of {width}-byte records")
    total = 0
    for piece in part.get("pieces", []):
        file = os.path.join(folder, piece["file"])
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path}: {what}: piece {piece['file']} is missing from {folder}")
        try:
            shapes, _ = piece_header(file)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"checkpoint {path}: {what}: cannot read piece {piece['file']}: {exc}") from None
        n = piece["records"]
        if shapes.get("ids") != (n,) or shapes.get("records") != (n, width):
            raise CheckpointError(f"checkpoint {path}: {what}: piece {piece['file']} holds ids {shapes.get('ids')} "
                                  f"and records {shapes.get('records')}, the manifest says {n} records of "
                                  f"{width} bytes")
        total += n
    if total != part.get("records"):
        raise CheckpointError(f"checkpoint {path}: {what}: its pieces hold {total} records, the manifest says "
                              f"{part.get('records')}")


def restore_tables(client: redis.Redis, job: str, group: int, folder: str, manifest: Mapping[str, Any],
                   between: Callable[[], None] = lambda: None) -> int:
    """Write group ``group``'s pieces of every table back (a piece per pipeline of HSETs), calling
    ``between`` after each. Returns the records written."""
    gk = JobKeys(job).group(group)
    written = 0
    for entry in manifest["tables"]:
        if entry["group"] != group:
            continue
        for kind in KINDS:
            key = gk.table_rows(entry["table"]) if kind == "rows" else gk.table_seen(entry["table"])
            for piece in entry[kind]["pieces"]:
                tensors = read_piece(os.path.join(folder, piece["file"]))
                ids = np.ascontiguousarray(tensors["ids"], dtype="<i8").tobytes()
                records = np.ascontiguousarray(tensors["records"])
                width = records.shape[1]
                flat = records.tobytes()
                n = len(ids) // 8
                pipe = client.pipeline(transaction=False)
                for i in range(0, n, _HSET_CHUNK):
                    args: list[bytes] = []
                    for j in range(i, min(i + _HSET_CHUNK, n)):
                        args += [ids[8 * j:8 * j + 8], flat[width * j:width * (j + 1)]]
                    pipe.execute_command("HSET", key, *args)
                pipe.execute()
                written += n
                between()
    return written
