"""Record formats of the training topic, as pure encode/decode functions.

Three formats share one topic (see ``docs/records.md``):

* **shard** (version 1): a msgpack map holding a mini-batch — features ``x``
  and labels ``y`` as ``{"dtype", "shape", "data"}`` with the raw little-endian
  bytes, the producer's id, the sequence number of its first record, the
  record count and the produce timestamp. Written by our producer.
* **JSON record**: ``{"x": [numbers], "y": number}`` as UTF-8 JSON, so any
  Kafka client (kcat, a Java or Go service) can feed training data.
* **msgpack record**: the same map, msgpack-encoded.

:func:`decode_record` turns any of them into :class:`Records` (numpy views on
the message bytes where the bytes allow, no per-record Python work for shards)
or raises :class:`DecodeError` whose ``reason`` is one of :data:`REASONS`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES", "DTYPES", "DecodeError", "LABEL_KINDS", "MAX_FEATURES",
    "REASONS", "Records", "SHARD_VERSION", "decode_record", "encode_json_record",
    "encode_msgpack_record", "encode_shard", "label_kind_of",
]

SHARD_VERSION = 1
"""Version written into every shard; a shard with any other version is rejected."""

DEFAULT_MAX_RECORD_BYTES = 8 * 1024 * 1024
"""Largest Kafka message value accepted by default (bytes)."""

MAX_FEATURES = 1 << 20
"""Largest feature dimension accepted in any record."""

DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<") for name in (
        "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64")}
"""Dtype names allowed in shards; the bytes are always little-endian."""

LABEL_KINDS = ("classification", "regression")
"""Label kinds: integer class ids (int64) or real targets (float32)."""

REASONS = ("too_large", "truncated", "bad_msgpack", "bad_json", "unknown_version",
           "bad_schema", "wrong_shape", "wrong_dtype", "non_finite")
"""Why a record was rejected (the ``reason`` of :class:`DecodeError` and the DLQ header)."""


class DecodeError(ValueError):
    """A Kafka message is not a valid training record.

    Attributes:
        reason: one of :data:`REASONS`.
        producer_id, first_seq, count: what the record claimed about itself,
            when that much could be read (shards), else ``None`` / 1.
    """

    def __init__(self, reason: str, message: str, *, producer_id: str | None = None,
                 first_seq: int | None = None, count: int = 1) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown decode-error reason {reason!r}")
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.producer_id = producer_id
        self.first_seq = first_seq
        self.count = count


@dataclass(frozen=True)
class Records:
    """The records of one Kafka message, decoded."""

    x: np.ndarray
    """Features ``[n, d]``, any dtype of :data:`DTYPES` (often a read-only view on the message)."""
    y: np.ndarray
    """Labels ``[n]``: an integer dtype for classification, a float dtype for regression."""
    producer_id: str | None
    """The shard's producer id; ``None`` for single records (the consumer names them)."""
    first_seq: int | None
    """Sequence number of the first record; ``None`` for single records."""
    ts_ms: int | None
    """Produce timestamp written in the shard (ms since the epoch); ``None`` for single records."""
    kind: str
    """``"shard"``, ``"json"`` or ``"msgpack"``."""

    @property
    def count(self) -> int:
        """Number of records."""
        return int(self.x.shape[0])


def label_kind_of(y: np.ndarray) -> str:
    """``"classification"`` for integer labels, ``"regression"`` for float labels."""
    return "classification" if y.dtype.kind in "iu" else "regression"


def _array_field(arr: np.ndarray) -> dict[str, Any]:
    name = arr.dtype.name
    if name not in DTYPES:
        raise ValueError(f"dtype {name} cannot go into a shard; use one of {', '.join(DTYPES)}")
    data = np.ascontiguousarray(arr, dtype=DTYPES[name])
    return {"dtype": name, "shape": list(arr.shape), "data": data.tobytes()}


def encode_shard(x: np.ndarray, y: np.ndarray, *, producer_id: str, first_seq: int,
                 ts_ms: int | None = None) -> bytes:
    """Pack a mini-batch ``x [n, d]``, ``y [n]`` into a version-1 shard.

    Raises:
        ValueError: shapes disagree, the batch is empty, or a dtype is not in :data:`DTYPES`.
    """
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"a shard needs x [n, d] and y [n] with n > 0; got x {x.shape}, y {y.shape}")
    if first_seq < 0:
        raise ValueError(f"first_seq must be >= 0, got {first_seq}")
    return msgpack.packb({
        "v": SHARD_VERSION, "producer": producer_id, "seq": int(first_seq), "n": int(x.shape[0]),
        "ts": int(time.time() * 1000) if ts_ms is None else int(ts_ms),
        "x": _array_field(x), "y": _array_field(y)})


def encode_json_record(x: list[float] | np.ndarray, y: float | int) -> bytes:
    """One record in the single-record JSON format."""
    return json.dumps({"x": [float(v) for v in x], "y": y}).encode()


def encode_msgpack_record(x: list[float] | np.ndarray, y: float | int) -> bytes:
    """One record in the single-record msgpack format."""
    return msgpack.packb({"x": [float(v) for v in x], "y": y})


def _unpacker(value: bytes, max_bytes: int) -> msgpack.Unpacker:
    unpacker = msgpack.Unpacker(
        raw=False, max_buffer_size=max(len(value), 1), max_bin_len=max_bytes,
        max_str_len=64 * 1024, max_array_len=MAX_FEATURES, max_map_len=64, max_ext_len=0,
        strict_map_key=True)
    unpacker.feed(value)
    return unpacker


def _salvage(value: bytes, max_bytes: int) -> dict[str, Any]:
    """What a truncated shard says about itself: its header fields come before the arrays."""
    unpacker, found = _unpacker(value, max_bytes), {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in ("x", "y"):
                break
            found[key] = unpacker.unpack()
    except (msgpack.UnpackException, ValueError, TypeError):  # truncated or damaged: keep what was read
        pass
    producer, seq, n = found.get("producer"), found.get("seq"), found.get("n")
    if not (isinstance(producer, str) and type(seq) is int and type(n) is int and n > 0):
        return {}
    return {"producer_id": producer, "first_seq": seq, "count": n}


def _unpack(value: bytes, max_bytes: int) -> Any:
    unpacker = _unpacker(value, max_bytes)
    try:
        obj = unpacker.unpack()
    except msgpack.OutOfData:
        raise DecodeError("truncated", f"msgpack payload ends early ({len(value)} bytes)",
                          **_salvage(value, max_bytes)) from None
    except (ValueError, TypeError) as exc:  # FormatError, StackError, limits, bad map keys
        raise DecodeError("bad_msgpack", f"not valid msgpack: {str(exc) or type(exc).__name__}") from None
    if unpacker.tell() != len(value):
        raise DecodeError("bad_msgpack", f"{len(value) - unpacker.tell()} bytes after the msgpack value")
    return obj


def _shard_array(field: str, spec: Any, ctx: dict[str, Any]) -> np.ndarray:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data"}:
        raise DecodeError("bad_schema", f"shard field {field!r} must be a map of dtype, shape, data", **ctx)
    dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise DecodeError("wrong_dtype", f"shard field {field!r} has dtype {spec['dtype']!r}; "
                          f"allowed: {', '.join(DTYPES)}", **ctx)
    shape, data = spec["shape"], spec["data"]
    if (not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape)
            or not isinstance(data, bytes)):
        raise DecodeError("bad_schema", f"shard field {field!r} needs a list of sizes and bytes", **ctx)
    expected = math.prod(shape) * dtype.itemsize
    if len(data) < expected:
        raise DecodeError("truncated", f"shard field {field!r} holds {len(data)} bytes, "
                          f"shape {shape} of {spec['dtype']} needs {expected}", **ctx)
    if len(data) > expected:
        raise DecodeError("wrong_shape", f"shard field {field!r} holds {len(data)} bytes, "
                          f"more than shape {shape} of {spec['dtype']} ({expected})", **ctx)
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _decode_shard(obj: dict[str, Any]) -> Records:
    version = obj.get("v")
    if version != SHARD_VERSION:
        raise DecodeError("unknown_version", f"shard version {version!r}; this reader knows {SHARD_VERSION}")
    missing = {"producer", "seq", "n", "ts", "x", "y"} - set(obj)
    if missing:
        raise DecodeError("bad_schema", f"shard lacks {', '.join(sorted(missing))}")
    producer, seq, n, ts = obj["producer"], obj["seq"], obj["n"], obj["ts"]
    if not isinstance(producer, str) or type(seq) is not int or type(n) is not int or type(ts) is not int \
            or seq < 0 or n <= 0:
        raise DecodeError("bad_schema", "shard producer must be a string, seq/n/ts integers, n > 0")
    ctx = {"producer_id": producer, "first_seq": seq, "count": n}
    x = _shard_array("x", obj["x"], ctx)
    y = _shard_array("y", obj["y"], ctx)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != n or y.shape[0] != n:
        raise DecodeError("wrong_shape", f"shard of {n} records has x {list(x.shape)}, y {list(y.shape)}; "
                          f"expected [{n}, d] and [{n}]", **ctx)
    return Records(x=x, y=y, producer_id=producer, first_seq=seq, ts_ms=ts, kind="shard")


def _decode_single(obj: Any, kind: str) -> Records:
    if not isinstance(obj, dict) or set(obj) != {"x", "y"}:
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise DecodeError("bad_schema", f"a single record is a map with exactly x and y; got {keys}")
    x, y = obj["x"], obj["y"]
    if not isinstance(x, list) or not x or len(x) > MAX_FEATURES:
        raise DecodeError("wrong_shape", f"x must be a non-empty list of at most {MAX_FEATURES} numbers")
    if not all(type(v) in (int, float) for v in x):
        raise DecodeError("wrong_dtype", "x must hold only numbers")
    if type(y) is int:
        y_arr = np.array([y], dtype=np.int64)
    elif type(y) is float:
        y_arr = np.array([y], dtype=np.float64)
    else:
        raise DecodeError("wrong_dtype", f"y must be a number, got {type(y).__name__}")
    return Records(x=np.array([x], dtype=np.float64), y=y_arr, producer_id=None, first_seq=None,
                   ts_ms=None, kind=kind)


def _check(rec: Records, feature_dim: int | None, label_kind: str | None,
           ctx: dict[str, Any]) -> Records:
    d = rec.x.shape[1]
    if feature_dim is not None and d != feature_dim:
        raise DecodeError("wrong_shape", f"records have {d} features; this stream has {feature_dim}", **ctx)
    y = rec.y
    if label_kind == "classification" and y.dtype.kind == "f":
        if not (np.isfinite(y).all() and (y == np.round(y)).all()):
            raise DecodeError("wrong_dtype", "classification labels must be integers", **ctx)
        rec = Records(x=rec.x, y=y.astype(np.int64), producer_id=rec.producer_id,
                      first_seq=rec.first_seq, ts_ms=rec.ts_ms, kind=rec.kind)
    if rec.x.dtype.kind == "f" and not np.isfinite(rec.x).all():
        raise DecodeError("non_finite", "features contain NaN or infinity", **ctx)
    if rec.y.dtype.kind == "f" and not np.isfinite(rec.y).all():
        raise DecodeError("non_finite", "labels contain NaN or infinity", **ctx)
    return rec


def decode_record(value: bytes | None, *, feature_dim: int | None = None, label_kind: str | None = None,
                  max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Records:
    """Decode one Kafka message value in any of the three formats.

    Args:
        value: the message value.
        feature_dim: the stream's feature dimension, checked when given.
        label_kind: ``"classification"`` or ``"regression"``, checked when given
            (integral float labels are accepted as classes; integer labels as
            regression targets).
        max_bytes: largest accepted value.

    Raises:
        DecodeError: the value is not a valid record; ``reason`` says why.
    """
    if label_kind is not None and label_kind not in LABEL_KINDS:
        raise ValueError(f"label_kind must be one of {LABEL_KINDS}, got {label_kind!r}")
    if value is None or len(value) == 0:
        raise DecodeError("truncated", "empty message value")
    if len(value) > max_bytes:
        raise DecodeError("too_large", f"message of {len(value)} bytes exceeds the limit of {max_bytes}")
    first = value[:1]
    if first in (b"{", b"[", b" ", b"\n", b"\t", b"\r"):
        try:
            obj = json.loads(value)
        except UnicodeDecodeError as exc:
            raise DecodeError("bad_json", f"not UTF-8: {exc}") from None
        except json.JSONDecodeError as exc:
            reason = "truncated" if exc.pos >= len(exc.doc.rstrip()) else "bad_json"
            raise DecodeError(reason, f"not valid JSON: {exc}") from None
        return _check(_decode_single(obj, "json"), feature_dim, label_kind, {})
    obj = _unpack(value, max_bytes)
    if isinstance(obj, dict) and "v" in obj:
        rec = _decode_shard(obj)
        ctx = {"producer_id": rec.producer_id, "first_seq": rec.first_seq, "count": rec.count}
    else:
        rec, ctx = _decode_single(obj, "msgpack"), {}
    return _check(rec, feature_dim, label_kind, ctx)
