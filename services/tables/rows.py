"""Rows as they are stored, placed and born (pure; no Redis).

The packed record of a row (:func:`row_dtype`; a pull reads only its :func:`pull_dtype` prefix, never the
optimizer state) and of a sighting (:data:`SEEN_DTYPE`), the group that owns an ID (:func:`group_of_ids`),
and a row's values before anyone wrote it (:func:`initial_rows`), which trainers and servers compute
alike from the table's name and the ID. See docs/embeddings.md, *The data model*.
"""

from __future__ import annotations

import hashlib

import numpy as np

from common.hashing import mix64

from .spec import TableSpec

__all__ = ["row_dtype", "pull_dtype", "SEEN_DTYPE", "group_of_ids", "initial_rows", "id_bytes",
           "ids_from_bytes"]

SEEN_DTYPE = np.dtype([("count", "<u4"), ("seen_ms", "<u8")])
"""A not-yet-admitted ID: in how many updates a gradient for it arrived, and when it last did."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_PLACEMENT = np.uint64(0x5EED_0F_9A7C0DE5)
"""Seed of the placement hash (independent of the initial values')."""


def row_dtype(spec: TableSpec) -> np.dtype:
    """The packed record of one stored row of ``spec``."""
    return np.dtype([("version", "<u8"), ("values", "<f4", (spec.dim,)), ("written_ms", "<u8"),
                     ("state", "<f4", (spec.slots,))])


def pull_dtype(spec: TableSpec) -> np.dtype:
    """The prefix of a stored row that a pull returns: its version and values."""
    return np.dtype([("version", "<u8"), ("values", "<f4", (spec.dim,))])


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's step: the golden-ratio increment, then its finaliser (``common.hashing.mix64``)."""
    return mix64(x + _GOLDEN)


def _as_u64(ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype != np.int64:
        raise TypeError(f"IDs must be int64, got {ids.dtype}")
    return ids.view(np.uint64)


def group_of_ids(ids: np.ndarray, groups: int) -> np.ndarray:
    """The shard group (0..groups-1, int64) whose slot holds each ID's row."""
    if groups == 1:
        return np.zeros(len(ids), dtype=np.int64)
    return (_mix(_as_u64(ids) ^ _PLACEMENT) % np.uint64(groups)).astype(np.int64)


def _table_seed(name: str) -> np.uint64:
    return np.frombuffer(hashlib.blake2b(name.encode(), digest_size=8).digest(), dtype="<u8")[0]


def initial_rows(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """The values ``[len(ids), dim]`` (float32) each ID's row has before anyone wrote it."""
    base = _mix(_as_u64(ids) ^ _table_seed(spec.name))
    lanes = np.arange(spec.dim, dtype=np.uint64) * _GOLDEN
    bits = _mix(base[:, None] + lanes[None, :]) >> np.uint64(40)  # 24 random bits per value
    unit = bits.astype(np.float32) * np.float32(2.0 ** -24)  # [0, 1), exact in float32
    return (unit * np.float32(2.0) - np.float32(1.0)) * np.float32(spec.init_scale)


def id_bytes(ids: np.ndarray) -> bytes:
    """IDs as the hash fields store them: 8 little-endian bytes each, concatenated."""
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def ids_from_bytes(blob: bytes) -> np.ndarray:
    """Inverse of :func:`id_bytes` (a read-only view)."""
    return np.frombuffer(blob, dtype="<i8")
