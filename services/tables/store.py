"""Reading rows from Redis by ID: a trainer's pull and a server's load (one round trip per group).

A trainer's pull (:func:`pull_rows`) is one MULTI/EXEC in each group's slot:
the group's version and one native ``HMGET`` per table of whole records, so
every row is as of that version (a transaction runs atomically) and Redis does
no per-row work but the lookup (a script's per-row Lua cost Redis about three
times as much CPU). hiredis parses the replies; numpy takes each row's version
and values from the records joined (their optimizer state travels too, and is
dropped). An ID without a row reads as its initial value (``rows.initial_rows``).
A server (:func:`load_rows`) reads whole records of its own group's rows, and
the sighting records of IDs not admitted yet, with plain HMGETs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from common.keys import JobKeys

from ..errors import LayoutError
from ..resp import PackedArgs, id_args
from ..scripts import DEFAULT_FEED_ENTRIES, RowsSweepCall, execute_with_script
from .rows import SEEN_DTYPE, decode_values, group_of_ids, initial_rows, row_dtype
from .spec import TableSpec

__all__ = ["PulledRows", "RowPull", "LoadedRows", "pull_rows", "load_rows", "SweepStep", "sweep_rows"]


@dataclass(frozen=True)
class PulledRows:
    """The rows of one table a pull read, in the order asked."""

    ids: np.ndarray
    """The IDs asked (int64)."""
    values: np.ndarray
    """``[len(ids), dim]`` float32: each row's values, or its initial value when it has no row."""
    versions: np.ndarray
    """uint64: the group version that last wrote each row (0 for an ID without a row)."""
    present: np.ndarray
    """bool: the ID has a row (it was admitted and not expired or evicted since)."""


@dataclass(frozen=True)
class RowPull:
    """What one pull of rows read."""

    tables: dict[str, PulledRows]
    """Table -> its rows."""
    group_versions: dict[int, int]
    """Version of each group read (every row of group g is as group version g left it)."""
    wire_bytes: int
    """Bytes of the records the pull read from Redis (whole records: version, values, optimizer state)."""


@dataclass(frozen=True)
class LoadedRows:
    """One table's rows, as a server of their group loads them before an apply."""

    ids: np.ndarray
    """The IDs asked (int64)."""
    present: np.ndarray
    """bool: the ID has a row."""
    records: np.ndarray
    """``row_dtype`` records of the IDs with a row (in order: ``ids[present]``)."""
    seen: np.ndarray
    """bool: the ID has no row but a sighting record."""
    seen_records: np.ndarray
    """``SEEN_DTYPE`` records of those IDs (in order: ``ids[seen]``)."""


def _read(client: redis.Redis, job: str, group: int, asks: Sequence[tuple[TableSpec, np.ndarray]]
          ) -> tuple[int, list[list[bytes | None]]]:
    """One MULTI/EXEC in ``group``'s slot: its version, then per ask (table, IDs) the HMGET reply of the
    table's rows hash (a whole record or None per ID)."""
    gk = JobKeys(job).group(group)
    pipe = client.pipeline(transaction=True)
    pipe.get(gk.version)
    for spec, ids in asks:
        pipe.execute_command("HMGET", gk.table_rows(spec.name), *_spread(id_args(client, ids)))
    res = pipe.execute()
    return int(res[0] or 0), res[1:]


def pull_rows(client: redis.Redis, job: str, tables: Mapping[str, TableSpec], groups: int,
              wanted: Mapping[str, np.ndarray], *, owners: Mapping[str, np.ndarray] | None = None) -> RowPull:
    """The version and values of each row of ``wanted`` (table -> int64 IDs), one round trip per
    group that owns any of them. An ID without a row reads as its initial value. ``owners``: each
    ID's group, when the caller has it (``rows.group_of_ids``).

    Raises:
        LayoutError: a table is not in ``tables``, or a reply does not fit what was asked.
    """
    for name in wanted:
        if name not in tables:
            raise LayoutError(f"job {job}: no embedding table {name!r} (tables: {sorted(tables)})")
    if owners is None:
        owners = {name: group_of_ids(np.asarray(ids, dtype=np.int64), groups) for name, ids in wanted.items()}
    out = {name: PulledRows(ids, np.empty((len(ids), tables[name].dim), dtype=np.float32),
                            np.zeros(len(ids), dtype=np.uint64), np.zeros(len(ids), dtype=bool))
           for name, ids in wanted.items()}
    versions: dict[int, int] = {}
    wire = 0
    for g in range(groups):
        wire += _pull_group(client, job, g, tables, wanted, owners, out, versions)
    for name, got in out.items():  # IDs without a row: their initial values, one pass per table
        absent = np.flatnonzero(~got.present)
        if absent.size:
            got.values[absent] = initial_rows(tables[name], got.ids[absent])
    return RowPull(out, versions, wire)


def _pull_group(client: redis.Redis, job: str, g: int, tables: Mapping[str, TableSpec],
                wanted: Mapping[str, np.ndarray], owners: Mapping[str, np.ndarray], out: dict[str, PulledRows],
                versions: dict[int, int]) -> int:
    """Group ``g``'s rows of ``wanted`` into ``out`` and its version into ``versions``; returns the bytes
    read."""
    asks, picks = [], []
    for name in wanted:
        pick = np.flatnonzero(owners[name] == g)
        if pick.size:
            asks.append((tables[name], wanted[name][pick]))
            picks.append((name, pick))
    if not asks:
        return 0
    versions[g], replies = _read(client, job, g, asks)
    nbytes = 0
    for (spec, ids), (name, pick), got in zip(asks, picks, replies, strict=True):
        if len(got) != len(ids):
            raise LayoutError(f"job {job}: table {name}: {len(got)} replies for {len(ids)} IDs")
        found, records = _records(got, row_dtype(spec), f"job {job}: table {name}")
        nbytes += records.nbytes
        dest = out[name]
        at = pick[found]
        dest.values[at] = decode_values(spec, records["values"])
        dest.versions[at] = records["version"]
        dest.present[at] = True
    return nbytes


def _records(got: list[bytes | None], dtype: np.dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(mask of the fields found, their records) of an HMGET reply."""
    present = np.fromiter((v is not None for v in got), dtype=bool, count=len(got))
    blob = b"".join([v for v in got if v is not None])
    if len(blob) != int(present.sum()) * dtype.itemsize:
        raise LayoutError(f"{what}: records of {len(blob)} bytes in all for {int(present.sum())} found, "
                          f"{dtype.itemsize} bytes each")
    return present, np.frombuffer(blob, dtype=dtype)


def _spread(fields: PackedArgs | list[bytes]) -> list[Any]:
    return [fields] if isinstance(fields, PackedArgs) else fields


def load_rows(client: redis.Redis, job: str, group: int, tables: Mapping[str, TableSpec],
              wanted: Mapping[str, np.ndarray]) -> dict[str, LoadedRows]:
    """Whole records of ``group``'s rows of ``wanted`` (table -> int64 IDs the group owns), and the
    sighting records of those without a row where the table admits after more than one sighting;
    one round trip of plain HMGETs (a server reads its own group's rows: the compare-and-set of its
    write, not an atomic read, keeps it exactly once; Redis spends a few microseconds a row, a
    script many times that). Returns table -> rows."""
    gk = JobKeys(job).group(group)
    asks = [(tables[name], ids, id_args(client, ids)) for name, ids in wanted.items()]
    if not asks:
        return {}
    pipe = client.pipeline(transaction=False)
    for spec, ids, fields in asks:
        if ids.size:
            pipe.execute_command("HMGET", gk.table_rows(spec.name), *_spread(fields))
            if spec.admit_after > 1:
                pipe.execute_command("HMGET", gk.table_seen(spec.name), *_spread(fields))
    replies = iter(pipe.execute())
    out = {}
    for spec, ids, _ in asks:
        what = f"job {job} group {group}: table {spec.name}"
        if not ids.size:
            empty = np.zeros(0, dtype=bool)
            out[spec.name] = LoadedRows(ids, empty, np.zeros(0, row_dtype(spec)), empty, np.zeros(0, SEEN_DTYPE))
            continue
        present, records = _records(next(replies), row_dtype(spec), what)
        seen = np.zeros(ids.size, dtype=bool)
        seen_records = np.zeros(0, dtype=SEEN_DTYPE)
        if spec.admit_after > 1:
            sighted, found = _records(next(replies), SEEN_DTYPE, what)
            seen = sighted & ~present
            seen_records = found[~present[sighted]]
        out[spec.name] = LoadedRows(ids, present, records, seen, seen_records)
    return out


@dataclass(frozen=True)
class SweepStep:
    """What one step of a table's sweep did (``lua/rows_sweep.lua``)."""

    cursor: str
    """Where the next step of the rows scan starts (``'0'``: the pass is complete)."""
    seen_cursor: str
    """Where the next step of the seen scan starts."""
    expired: int
    """Rows removed for age."""
    evicted: int
    """Rows evicted beyond the cap."""
    seen_expired: int
    """Sighting records removed for age."""
    rows: int
    """Rows of the table the group holds now."""


def _offset(dtype: np.dtype, name: str) -> int:
    """Byte offset of field ``name`` of a packed record."""
    fields = dtype.fields
    assert fields is not None, "a record dtype has fields"
    return int(fields[name][1])


def sweep_rows(client: redis.Redis, job: str, group: int, spec: TableSpec, groups: int, *, now_ms: int,
               cursor: str = "0", seen_cursor: str = "0", count: int = 1000, most_evicted: int = 10000,
               feed_entries: int = DEFAULT_FEED_ENTRIES) -> SweepStep:
    """One step of keeping ``group``'s part of table ``spec`` bounded: expire what was not written
    (sighted) for ``spec.expire_after_s`` over ``count`` entries of each scan, and evict the least
    recently written rows beyond the group's share of ``spec.max_rows`` (at most ``most_evicted``).
    A step that removed rows appends their IDs to the group's feed (which keeps ``feed_entries``)."""
    cutoff = now_ms - round(spec.expire_after_s * 1000) if spec.expire_after_s > 0 else 0
    cap = -(-spec.max_rows // groups) if spec.max_rows else 0
    call = RowsSweepCall(JobKeys(job).group(group), spec.name, written_at=_offset(row_dtype(spec), "written_ms") + 1,
                         cutoff_ms=max(cutoff, 0), cursor=cursor, seen_cursor=seen_cursor, count=count, cap=cap,
                         most_evicted=most_evicted, feed_entries=feed_entries)
    res = execute_with_script(client, call.SCRIPT, call.queue)[-1]
    text = [x.decode() if isinstance(x, bytes) else str(x) for x in res[:2]]
    return SweepStep(text[0], text[1], int(res[2]), int(res[3]), int(res[4]), int(res[5]))
