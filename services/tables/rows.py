"""Rows as they are stored, placed and born (pure; no Redis).

The packed record of a row (:func:`row_dtype`; a pull reads only its :func:`pull_dtype` prefix, never the
optimizer state) and of a sighting (:data:`SEEN_DTYPE`), the group that owns an ID (:func:`group_of_ids`),
and a row's values before anyone wrote it (:func:`initial_rows`), which trainers and servers compute
alike from the table's name and the ID. A table's values and optimizer state are stored as its
``value_dtype`` and ``state_dtype`` say and computed on in float32: :func:`decode_values` and
:func:`encode_values` (and ``_state``) convert, vectorised, rounding to nearest even.
See docs/embeddings.md, *The data model*.
"""

from __future__ import annotations

import hashlib

import numpy as np

from common.hashing import mix64

from .spec import TableSpec

__all__ = ["row_dtype", "pull_dtype", "SEEN_DTYPE", "STORED_DTYPES", "encode", "decode", "encode_values",
           "decode_values", "encode_state", "decode_state", "round_stored", "group_of_ids", "initial_rows",
           "id_bytes", "ids_from_bytes"]

SEEN_DTYPE = np.dtype([("count", "<u4"), ("seen_ms", "<u8")])
"""A not-yet-admitted ID: in how many updates a gradient for it arrived, and when it last did."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_PLACEMENT = np.uint64(0x5EED_0F_9A7C0DE5)
"""Seed of the placement hash (independent of the initial values')."""


STORED_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"),
                                      "bfloat16": np.dtype("<u2")}
"""How each of ``spec.VALUE_DTYPES`` is kept in a record: numpy has no bfloat16, so it is the top 16 bits of
the float32, as a ``uint16``."""

_BF16_NAN = np.uint16(0x7FC0)
"""The bfloat16 every NaN encodes to (a quiet NaN, sign dropped: ``c10::BFloat16``'s)."""


def row_dtype(spec: TableSpec) -> np.dtype:
    """The packed record of one stored row of ``spec``."""
    return np.dtype([("version", "<u8"), ("values", STORED_DTYPES[spec.value_dtype], (spec.dim,)),
                     ("written_ms", "<u8"), ("state", STORED_DTYPES[spec.state_dtype], (spec.slots,))])


def pull_dtype(spec: TableSpec) -> np.dtype:
    """The prefix of a stored row that a pull returns: its version and values."""
    return np.dtype([("version", "<u8"), ("values", STORED_DTYPES[spec.value_dtype], (spec.dim,))])


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``x`` as ``dtype`` (one of ``spec.VALUE_DTYPES``) stores it, each value rounded to the
    nearest, ties to even; beyond the type's largest finite value, an infinity of the sign (IEEE's
    rounding; float16's largest is 65504), NaN stays NaN (bfloat16: ``0x7FC0``, as ``c10::BFloat16`` has it)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    if dtype != "bfloat16":
        raise ValueError(f"no stored type {dtype!r}: one of {', '.join(STORED_DTYPES)}")
    bits = x.view(np.uint32)
    # add half an ulp of bfloat16 less one, plus the kept part's lowest bit (ties to even), then cut;
    # a carry rounds up into the exponent (the largest finite values round to infinity)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
    return np.where(np.isnan(x), _BF16_NAN, rounded.astype(np.uint16))


def decode(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of :func:`encode`: the float32 of each stored value (exact: float32 holds every float16
    and bfloat16). A float32 table's own array comes back as it is."""
    if dtype == "float32":
        return np.asarray(stored, dtype=np.float32)
    if dtype == "float16":
        return np.asarray(stored, dtype=np.float16).astype(np.float32)
    if dtype != "bfloat16":
        raise ValueError(f"no stored type {dtype!r}: one of {', '.join(STORED_DTYPES)}")
    return (np.asarray(stored, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` (float32) as it reads back once stored as ``dtype``: ``decode(encode(x))``."""
    return x if dtype == "float32" else decode(encode(x, dtype), dtype)


def decode_values(spec: TableSpec, stored: np.ndarray) -> np.ndarray:
    """A record's ``values`` field (of :func:`row_dtype` or :func:`pull_dtype`) as float32."""
    return decode(stored, spec.value_dtype)


def encode_values(spec: TableSpec, values: np.ndarray) -> np.ndarray:
    """float32 ``values`` as a record of ``spec`` stores them."""
    return encode(values, spec.value_dtype)


def decode_state(spec: TableSpec, stored: np.ndarray) -> np.ndarray:
    """A record's ``state`` field as float32."""
    return decode(stored, spec.state_dtype)


def encode_state(spec: TableSpec, state: np.ndarray) -> np.ndarray:
    """float32 optimizer ``state`` as a record of ``spec`` stores it."""
    return encode(state, spec.state_dtype)


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
    """The values ``[len(ids), dim]`` (float32) each ID's row has before anyone wrote it. Whatever the
    table's ``value_dtype``, an ID without a row reads as these float32 values; a row, once born, is
    stored as its type has it (its first step is taken in float32 from these, then rounded)."""
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
