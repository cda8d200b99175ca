"""Reading a group's embedding tables in pieces: as they are (an export), or as of a checkpoint's cut
while the servers go on applying (copy-on-write shadows).

A table is read one HSCAN step at a time (``lua/rows_scan.lua``) and handed on in pieces (:func:`scan_pieces`,
:func:`live_pieces`), since it may be far larger than one script may read or the saver's memory. A cut
(:func:`take_call`, :func:`keep_cut`, :func:`drop_cut`) makes the applies and sweeps shadow what they change,
so :func:`cut_pieces` yields the table as of the cut's version.
See docs/embeddings.md, *Checkpoints: a cut of the rows while the servers apply*.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import redis

from common.keys import JobKeys

from ..scripts import RowsScanCall, TableCutCall, execute_with_script
from ..tables.rows import SEEN_DTYPE, pull_dtype, row_dtype
from ..tables.spec import TableSpec

__all__ = ["CUT_TTL_MS", "Piece", "scan_pieces", "cut_pieces", "live_pieces", "take_call", "keep_cut", "drop_cut",
           "CutBusy"]

CUT_TTL_MS = 60_000
"""A cut not renewed within this expires (its save died): the applies stop copying old records."""

_SCAN_COUNT = 1000
"""Entries one scan step looks at (at most ``rows_per_piece``)."""


@dataclass(frozen=True)
class Piece:
    """Up to ``rows_per_piece`` entries of one table of one group, as read."""

    ids: np.ndarray
    """int64 IDs."""
    records: np.ndarray
    """``uint8 [len(ids), bytes]``: each ID's record (or its prefix)."""
    version: int
    """The group's version when the last scan step of the piece ran."""


class CutBusy(Exception):
    """Another save holds the group's cut."""

    def __init__(self, group: int, key: str, held: str, pttl_ms: int) -> None:
        super().__init__(f"group {group}: another checkpoint holds the cut of its tables ({key} = {held!r}, "
                         f"for {pttl_ms} ms more unless it renews it)")
        self.pttl_ms = pttl_ms
        """How long the other save's cut lasts unless renewed."""


def take_call(job: str, group: int, tables: Sequence[TableSpec], owner: str, *, blobs: bool = True) -> TableCutCall:
    """The call that takes ``group``'s cut for the save ``owner`` (queued in the MULTI/EXEC that reads
    the group's dense cut); its reply goes to :func:`took`."""
    return TableCutCall(JobKeys(job).group(group), [t.name for t in tables], "take", owner, CUT_TTL_MS, blobs)


def took(reply: Sequence, job: str, group: int) -> int:
    """The cut's version from a ``take`` reply.

    Raises:
        CutBusy: another save holds it.
    """
    if reply[0] == b"BUSY":
        held = reply[2].decode() if isinstance(reply[2], bytes) else str(reply[2])
        raise CutBusy(group, JobKeys(job).group(group).table_cut, held, int(reply[1]))
    return int(reply[1])


def _run(client: redis.Redis, call: TableCutCall) -> list:
    return execute_with_script(client, call.SCRIPT, call.queue)[-1]


def keep_cut(client: redis.Redis, job: str, group: int, tables: Sequence[TableSpec], owner: str, *,
             blobs: bool = False) -> bool:
    """Renew ``owner``'s cut of ``group`` (``blobs``: the applies go on copying the row-gradient blobs
    they delete; without it the copies so far are deleted). False when it is no longer ``owner``'s
    (expired, or taken by another save): the shadows cannot be trusted."""
    call = TableCutCall(JobKeys(job).group(group), [t.name for t in tables], "keep", owner, CUT_TTL_MS, blobs)
    return _run(client, call)[0] == b"OK"


def drop_cut(client: redis.Redis, job: str, group: int, tables: Sequence[TableSpec], owner: str) -> bool:
    """Let go of ``owner``'s cut of ``group`` and delete its shadows. False when it was no longer ours."""
    call = TableCutCall(JobKeys(job).group(group), [t.name for t in tables], "drop", owner)
    return _run(client, call)[0] == b"OK"


def _steps(client: redis.Redis, call: RowsScanCall) -> Iterator[tuple[bytes, bytes, int]]:
    """Each step of a scan: (IDs, records, group version)."""
    cursor: bytes | str = "0"
    while True:
        step = dataclasses.replace(call, cursor=cursor)
        cursor, version, ids, records = execute_with_script(client, step.SCRIPT, step.queue)[-1]
        yield ids, records, int(version)
        if cursor in (b"0", "0"):
            return


def scan_pieces(client: redis.Redis, scans: Sequence[RowsScanCall], rows_per_piece: int) -> Iterator[Piece]:
    """The entries ``scans`` return, one after the other, in pieces of ``rows_per_piece`` (the last
    may be smaller; none is empty). At most one piece and one scan step are in memory at a time."""
    if rows_per_piece < 1:
        raise ValueError(f"rows_per_piece must be >= 1, got {rows_per_piece!r}")
    ids: list[bytes] = []
    records: list[bytes] = []
    held, version = 0, 0
    for scan in scans:
        width = scan.prefix
        for step_ids, step_records, step_version in _steps(client, scan):
            version = max(version, step_version)
            at = 0
            n = len(step_ids) // 8
            while at < n:
                take = min(rows_per_piece - held, n - at)
                ids.append(step_ids[8 * at:8 * (at + take)])
                records.append(step_records[width * at:width * (at + take)])
                held, at = held + take, at + take
                if held == rows_per_piece:
                    yield _piece(ids, records, width, version)
                    ids, records, held = [], [], 0
    if held:
        yield _piece(ids, records, scans[-1].prefix, version)


def _piece(ids: list[bytes], records: list[bytes], width: int, version: int) -> Piece:
    out_ids = np.frombuffer(b"".join(ids), dtype="<i8")
    out = np.frombuffer(b"".join(records), dtype=np.uint8).reshape(out_ids.size, width)
    return Piece(out_ids, out, version)


def _count(rows_per_piece: int) -> int:
    return max(1, min(_SCAN_COUNT, rows_per_piece))


def cut_pieces(client: redis.Redis, job: str, group: int, spec: TableSpec, version: int, kind: str,
               rows_per_piece: int) -> Iterator[Piece]:
    """``group``'s rows (``kind`` ``"rows"``: whole ``row_dtype`` records) or sighting records
    (``"seen"``: ``SEEN_DTYPE`` records) of table ``spec`` as of the cut at ``version`` (held by the
    caller while it iterates), in pieces."""
    gk = JobKeys(job).group(group)
    count = _count(rows_per_piece)
    if kind == "rows":
        width = row_dtype(spec).itemsize
        scans = [RowsScanCall(gk, gk.table_rows(spec.name), "0", count, width, width, newest=version),
                 RowsScanCall(gk, gk.table_shadow(spec.name), "0", count, width, width)]
    elif kind == "seen":
        width = SEEN_DTYPE.itemsize
        scans = [RowsScanCall(gk, gk.table_seen(spec.name), "0", count, width, width, skip=gk.seen_shadow(spec.name)),
                 RowsScanCall(gk, gk.seen_shadow(spec.name), "0", count, width, width)]
    else:
        raise ValueError(f"kind must be 'rows' or 'seen', got {kind!r}")
    return scan_pieces(client, scans, rows_per_piece)


def live_pieces(client: redis.Redis, job: str, group: int, spec: TableSpec, rows_per_piece: int) -> Iterator[Piece]:
    """``group``'s rows of table ``spec`` as they are (each as its group last wrote it), in pieces; each
    record is the row's version and values (``pull_dtype``)."""
    gk = JobKeys(job).group(group)
    call = RowsScanCall(gk, gk.table_rows(spec.name), "0", _count(rows_per_piece), row_dtype(spec).itemsize,
                        pull_dtype(spec).itemsize)
    return scan_pieces(client, [call], rows_per_piece)
