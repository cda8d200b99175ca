"""Record formats of the training topic, as pure encode/decode functions.

Shards (msgpack mini-batches: version 1 dense, version 2 with ``ids``), JSON records and msgpack
records share one topic. :func:`decode_record` turns any of them into :class:`Records` (views on the
message bytes where the bytes allow) or raises :class:`DecodeError` with one of :data:`REASONS`;
:func:`hash_id` makes string IDs 64-bit. See docs/records.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import numpy as np

from .jagged import Jagged

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES", "DENSE_SHARD_VERSION", "DTYPES", "DecodeError", "FEATURE_NAME",
    "LABEL_KINDS", "MAX_FEATURES", "MAX_IDS_PER_FEATURE", "MAX_ID_FEATURES", "REASONS", "Records",
    "SHARD_VERSION", "check_single_record", "decode_record", "encode_json_record", "encode_msgpack_record",
    "encode_shard", "hash_id", "label_kind_of", "parse_ids",
]

SHARD_VERSION = 2
"""Newest shard version: shards whose records carry categorical IDs (``ids``)."""

DENSE_SHARD_VERSION = 1
"""Version of shards without IDs; still written for them, so readers that predate IDs read them.
A reader of version 1 rejects a version-2 shard as ``unknown_version`` instead of dropping its IDs."""

SHARD_VERSIONS = (DENSE_SHARD_VERSION, SHARD_VERSION)
"""Shard versions this reader decodes; any other is rejected as ``unknown_version``."""

DEFAULT_MAX_RECORD_BYTES = 8 * 1024 * 1024
"""Largest Kafka message value accepted by default (bytes)."""

MAX_FEATURES = 1 << 20
"""Largest feature dimension accepted in any record."""

MAX_ID_FEATURES = 64
"""Most categorical features one record may name (in a shard, every feature of the shard counts)."""

MAX_IDS_PER_FEATURE = 1024
"""Most IDs one record may carry for one feature."""

FEATURE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
"""What a categorical feature's name must fully match: 1-64 letters, digits, ``_``, ``.``, ``-``."""

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_MAX_MAP_LEN = 2 * MAX_ID_FEATURES  # so one feature too many is "too_many_ids", not "bad_msgpack"

DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<") for name in (
        "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64")}
"""Dtype names allowed in shards; the bytes are always little-endian."""

LABEL_KINDS = ("classification", "regression")
"""Label kinds: integer class ids (int64) or real targets (float32)."""

REASONS = ("too_large", "truncated", "bad_msgpack", "bad_json", "unknown_version",
           "bad_schema", "wrong_shape", "wrong_dtype", "non_finite", "bad_ids", "too_many_ids")
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
    """Dense features ``[n, d]``, any dtype of :data:`DTYPES` (often a read-only view on the
    message); ``d`` is 0 for records that carry only IDs."""
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
    ids: dict[str, Jagged] = field(default_factory=dict)
    """Categorical features: name -> the IDs of the ``n`` records (``values`` a read-only view on
    a shard's bytes); empty when the records carry none. Only the features the message names."""
    w: np.ndarray | None = None
    """Sample weights, float32 ``[n]``, each finite and > 0 (a single record's ``w``, written for the
    negatives a joiner kept at rate r as ``1/r``); ``None``: every record weighs 1. Shards carry none."""

    @property
    def count(self) -> int:
        """Number of records."""
        return int(self.x.shape[0])


def hash_id(s: str) -> int:
    """The 64-bit ID of a string ID, the same in every process, on every machine and in every version.

    It is the 8-byte BLAKE2b digest (``digest_size=8``, no key, salt or person) of the string's
    UTF-8 bytes, read as a little-endian signed integer. ``hash_id("paris") ==
    1657316678316814225``.

    Raises:
        UnicodeEncodeError: the string holds a lone surrogate (it has no UTF-8 bytes).
    """
    digest = hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _one_id(feature: str, item: Any) -> int:
    if type(item) is int:
        if not _INT64_MIN <= item <= _INT64_MAX:
            raise DecodeError("bad_ids", f"ID {item} of feature {feature!r} does not fit a signed 64-bit integer")
        return item
    if type(item) is str:
        try:
            return hash_id(item)
        except UnicodeEncodeError:
            raise DecodeError("bad_ids", f"a string ID of feature {feature!r} is not valid Unicode") from None
    raise DecodeError("bad_ids", f"IDs of feature {feature!r} must be integers or strings, "
                                 f"got {type(item).__name__}")


_GOOD_NAMES: set[str] = set()
"""Feature names found good already (a stream has a few, checked once each; at most 4,096 kept)."""


def _check_name(name: Any, ctx: Mapping[str, Any]) -> None:
    if name in _GOOD_NAMES:  # a map's key: hashable
        return
    if not isinstance(name, str) or not FEATURE_NAME.fullmatch(name):
        raise DecodeError("bad_ids", f"feature name {name!r} is not 1-64 letters, digits, '_', '.' or '-'",
                          **ctx)
    if len(_GOOD_NAMES) < 4096:
        _GOOD_NAMES.add(name)


def parse_ids(obj: Any) -> dict[str, list[int]]:
    """The ``ids`` map of one single record: feature name -> its IDs (a single ID becomes a list of one).

    IDs are integers that fit a signed 64-bit integer, or strings (hashed by :func:`hash_id`);
    booleans, floats and anything else are refused. An empty list is a feature with no IDs.

    Raises:
        DecodeError: ``bad_ids`` (not a map, a bad name or ID) or ``too_many_ids``
            (over :data:`MAX_ID_FEATURES` features or :data:`MAX_IDS_PER_FEATURE` IDs of one).
    """
    if not isinstance(obj, dict):
        raise DecodeError("bad_ids", f"ids must be a map of feature name to IDs, got {type(obj).__name__}")
    if len(obj) > MAX_ID_FEATURES:
        raise DecodeError("too_many_ids", f"{len(obj)} features; at most {MAX_ID_FEATURES} per record")
    out: dict[str, list[int]] = {}
    for name, value in obj.items():
        _check_name(name, {})
        items = value if isinstance(value, list) else [value]
        if len(items) > MAX_IDS_PER_FEATURE:
            raise DecodeError("too_many_ids", f"feature {name!r} has {len(items)} IDs; "
                                              f"at most {MAX_IDS_PER_FEATURE} per record")
        out[name] = [_one_id(name, item) for item in items]
    return out


def label_kind_of(y: np.ndarray) -> str:
    """``"classification"`` for integer labels, ``"regression"`` for float labels."""
    return "classification" if y.dtype.kind in "iu" else "regression"


def _array_field(arr: np.ndarray) -> dict[str, Any]:
    name = arr.dtype.name
    if name not in DTYPES:
        raise ValueError(f"dtype {name} cannot go into a shard; use one of {', '.join(DTYPES)}")
    data = np.ascontiguousarray(arr, dtype=DTYPES[name])
    return {"dtype": name, "shape": list(arr.shape), "data": data.tobytes()}


def _ids_field(ids: Mapping[str, Jagged], n: int) -> dict[str, Any]:
    """``ids`` of a version-2 shard: the keys, and all features' values and lengths in two arrays."""
    if len(ids) > MAX_ID_FEATURES:
        raise ValueError(f"{len(ids)} ID features; a shard holds at most {MAX_ID_FEATURES}")
    for name, col in ids.items():
        if not isinstance(name, str) or not FEATURE_NAME.fullmatch(name):
            raise ValueError(f"feature name {name!r} is not 1-64 letters, digits, '_', '.' or '-'")
        if not isinstance(col, Jagged) or col.n != n:
            raise ValueError(f"feature {name!r} must be a Jagged of {n} records, got {col!r:.80}")
    cols = list(ids.values())
    lengths = np.diff(np.stack([col.offsets for col in cols]), axis=1)  # [features, n]
    if lengths.size and int(lengths.max()) > MAX_IDS_PER_FEATURE:
        raise ValueError(f"a record has {int(lengths.max())} IDs of one feature; at most {MAX_IDS_PER_FEATURE}")
    return {"keys": list(ids), "values": _array_field(np.concatenate([col.values for col in cols])),
            "lengths": _array_field(lengths.astype(np.int32))}


def encode_shard(x: np.ndarray, y: np.ndarray, *, producer_id: str, first_seq: int,
                 ts_ms: int | None = None, ids: Mapping[str, Jagged] | None = None) -> bytes:
    """Pack a mini-batch ``x [n, d]``, ``y [n]`` and its categorical ``ids`` into a shard.

    Without IDs (``ids`` ``None`` or empty) the shard is version :data:`DENSE_SHARD_VERSION`,
    byte for byte what readers that predate IDs read; with IDs it is :data:`SHARD_VERSION`.
    ``d`` may be 0 when the records carry only IDs.

    Raises:
        ValueError: shapes disagree, the batch is empty, a dtype is not in :data:`DTYPES`, or the
            IDs break a limit (:data:`MAX_ID_FEATURES`, :data:`MAX_IDS_PER_FEATURE`, names).
    """
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"a shard needs x [n, d] and y [n] with n > 0; got x {x.shape}, y {y.shape}")
    if first_seq < 0:
        raise ValueError(f"first_seq must be >= 0, got {first_seq}")
    n = int(x.shape[0])
    shard = {"v": SHARD_VERSION if ids else DENSE_SHARD_VERSION, "producer": producer_id,
             "seq": int(first_seq), "n": n, "ts": int(time.time() * 1000) if ts_ms is None else int(ts_ms),
             "x": _array_field(x), "y": _array_field(y)}
    if ids:
        shard["ids"] = _ids_field(ids, n)
    return msgpack.packb(shard)


def _single(x: Sequence[float] | np.ndarray | None, y: float | int,
            ids: Mapping[str, int | str | Sequence[int | str]] | None, w: float | None) -> dict[str, Any]:
    record: dict[str, Any] = {} if x is None else {"x": [float(v) for v in x]}
    record["y"] = y
    if ids is not None:
        record["ids"] = {name: v if isinstance(v, int | str) else list(v) for name, v in ids.items()}
    if w is not None:
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"a record's weight w must be a finite number > 0, got {w!r}")
        record["w"] = w
    return record


def encode_json_record(x: Sequence[float] | np.ndarray | None, y: float | int, *,
                       ids: Mapping[str, int | str | Sequence[int | str]] | None = None,
                       w: float | None = None) -> bytes:
    """One record in the single-record JSON format (``x=None`` leaves the dense features out; ``w``:
    its sample weight, left out when ``None``).

    Raises:
        ValueError: ``w`` is not a finite number > 0.
    """
    return json.dumps(_single(x, y, ids, w)).encode()


def encode_msgpack_record(x: Sequence[float] | np.ndarray | None, y: float | int, *,
                          ids: Mapping[str, int | str | Sequence[int | str]] | None = None,
                          w: float | None = None) -> bytes:
    """One record in the single-record msgpack format (``x=None`` leaves the dense features out; ``w``:
    its sample weight, left out when ``None``).

    Raises:
        ValueError: ``w`` is not a finite number > 0.
    """
    return msgpack.packb(_single(x, y, ids, w))


def _unpacker(value: bytes, max_bytes: int) -> msgpack.Unpacker:
    unpacker = msgpack.Unpacker(
        raw=False, max_buffer_size=max(len(value), 1), max_bin_len=max_bytes,
        max_str_len=64 * 1024, max_array_len=MAX_FEATURES, max_map_len=_MAX_MAP_LEN, max_ext_len=0,
        strict_map_key=True)
    unpacker.feed(value)
    return unpacker


def _salvage(value: bytes, max_bytes: int) -> dict[str, Any]:
    """What a truncated shard says about itself: its header fields come before the arrays."""
    unpacker, found = _unpacker(value, max_bytes), {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in ("x", "y", "ids"):
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


def _shard_ids(spec: Any, n: int, ctx: dict[str, Any]) -> dict[str, Jagged]:
    """The ``ids`` of a version-2 shard, checked for all features at once: each feature's ``values``
    is a view on the message, its ``offsets`` a slice of one ``cumsum`` of all lengths."""
    if not isinstance(spec, dict) or set(spec) != {"keys", "values", "lengths"}:
        raise DecodeError("bad_ids", "shard ids must be a map of keys, values and lengths", **ctx)
    keys = spec["keys"]
    if not isinstance(keys, list):
        raise DecodeError("bad_ids", f"shard ids keys must be a list of names, got {type(keys).__name__}", **ctx)
    if len(keys) > MAX_ID_FEATURES:
        raise DecodeError("too_many_ids", f"shard names {len(keys)} ID features; "
                                          f"at most {MAX_ID_FEATURES} per record", **ctx)
    for name in keys:
        _check_name(name, ctx)
    if len(set(keys)) != len(keys):
        raise DecodeError("bad_ids", f"shard ids keys repeat a name: {keys}", **ctx)
    values = _shard_array("ids.values", spec["values"], ctx)
    lengths = _shard_array("ids.lengths", spec["lengths"], ctx)
    f = len(keys)
    if values.dtype != np.int64 or values.ndim != 1:
        raise DecodeError("bad_ids", f"ids values must be int64 [nnz], got {values.dtype} {list(values.shape)}",
                          **ctx)
    if lengths.dtype.kind not in "iu" or lengths.shape != (f, n):
        raise DecodeError("bad_ids", f"ids lengths must be integers [{f}, {n}] (features, records), "
                                     f"got {lengths.dtype} {list(lengths.shape)}", **ctx)
    if lengths.size and int(lengths.min()) < 0:
        raise DecodeError("bad_ids", "ids lengths must be >= 0", **ctx)
    if lengths.size and int(lengths.max()) > MAX_IDS_PER_FEATURE:
        worst = int(np.argmax(lengths.max(axis=1)))
        raise DecodeError("too_many_ids", f"ID feature {keys[worst]!r} has a record of {int(lengths.max())} "
                                          f"IDs; at most {MAX_IDS_PER_FEATURE}", **ctx)
    offsets = np.zeros(f * n + 1, np.int64)
    np.cumsum(lengths.reshape(-1), dtype=np.int64, out=offsets[1:])
    if offsets[-1] != len(values):
        raise DecodeError("bad_ids", f"ids lengths add up to {int(offsets[-1])}, values hold {len(values)}", **ctx)
    out: dict[str, Jagged] = {}
    for i, name in enumerate(keys):
        lo, hi = int(offsets[i * n]), int(offsets[(i + 1) * n])
        own = offsets[i * n:(i + 1) * n + 1]
        out[name] = Jagged(values[lo:hi], own - lo if lo else own)
    return out


def _decode_shard(obj: dict[str, Any]) -> Records:
    version = obj.get("v")
    if type(version) is not int or version not in SHARD_VERSIONS:
        raise DecodeError("unknown_version", f"shard version {version!r}; this reader knows "
                                             f"{', '.join(map(str, SHARD_VERSIONS))}")
    required = {"producer", "seq", "n", "ts", "x", "y"} | ({"ids"} if version >= 2 else set())
    missing = required - set(obj)
    if missing:
        raise DecodeError("bad_schema", f"shard lacks {', '.join(sorted(missing))}")
    if version == DENSE_SHARD_VERSION and "ids" in obj:
        raise DecodeError("bad_schema", f"a version-{DENSE_SHARD_VERSION} shard cannot carry ids; "
                                        f"IDs need version {SHARD_VERSION}")
    if "w" in obj:
        raise DecodeError("bad_schema", "shards carry no sample weights (w); write weighted records as single records")
    extra = set(obj) - required - {"v"}
    if extra:
        raise DecodeError("bad_schema", f"shard has unknown keys {', '.join(sorted(map(str, extra)))}")
    producer, seq, n, ts = obj["producer"], obj["seq"], obj["n"], obj["ts"]
    if not isinstance(producer, str) or type(seq) is not int or type(n) is not int or type(ts) is not int \
            or seq < 0 or n <= 0:
        raise DecodeError("bad_schema", "shard producer must be a string, seq/n/ts integers, n > 0")
    ctx: dict[str, Any] = {"producer_id": producer, "first_seq": seq, "count": n}
    x = _shard_array("x", obj["x"], ctx)
    y = _shard_array("y", obj["y"], ctx)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != n or y.shape[0] != n:
        raise DecodeError("wrong_shape", f"shard of {n} records has x {list(x.shape)}, y {list(y.shape)}; "
                          f"expected [{n}, d] and [{n}]", **ctx)
    ids = _shard_ids(obj["ids"], n, ctx) if version >= 2 else {}
    return Records(x=x, y=y, producer_id=producer, first_seq=seq, ts_ms=ts, kind="shard", ids=ids)


_ONE_RECORD: dict[int, np.ndarray] = {}  # k -> read-only offsets [0, k] of one record of k IDs


def _single_ids(ids: dict[str, list[int]]) -> dict[str, Jagged]:
    """One record's columns: views on one array of all its IDs, with shared offsets."""
    values = np.fromiter((v for vs in ids.values() for v in vs), np.int64)
    out, lo = {}, 0
    for name, vs in ids.items():
        k = len(vs)
        offsets = _ONE_RECORD.get(k)
        if offsets is None:
            offsets = _ONE_RECORD[k] = np.array([0, k], np.int64)
            offsets.flags.writeable = False
        out[name] = Jagged(values[lo:lo + k], offsets)
        lo += k
    return out


def _single_weight(w: Any) -> np.ndarray:
    """A single record's ``w`` as float32 ``[1]``: a finite number > 0 (once in float32)."""
    if type(w) not in (int, float):
        raise DecodeError("wrong_dtype", f"w (sample weight) must be a number, got {type(w).__name__}")
    try:
        with np.errstate(over="ignore"):
            value = np.array([w], dtype=np.float32)
    except OverflowError:  # an integer beyond float range
        raise DecodeError("non_finite", "w (sample weight) is an integer too large for a float32") from None
    if not np.isfinite(value[0]):
        raise DecodeError("non_finite", f"w (sample weight) must be finite in float32, got {w!r}")
    if value[0] <= 0:
        raise DecodeError("wrong_dtype", f"w (sample weight) must be > 0 in float32, got {w!r}")
    return value


def _single_fields(obj: Any) -> tuple[dict[str, list[int]], list[Any], Any, np.ndarray | None]:
    """A single record's ``ids``, ``x``, ``y`` and ``w``, checked as :func:`decode_record` checks them (each
    ID, the features' count, types and finiteness, the label's type, the weight), without their arrays."""
    keys = set(obj) if isinstance(obj, dict) else set()
    if not isinstance(obj, dict) or "y" not in keys or not keys & {"x", "ids"} or keys - {"x", "y", "ids", "w"}:
        shown = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise DecodeError("bad_schema", f"a single record is a map of y and x, ids or both (and optionally w); "
                                        f"got {shown}")
    ids = parse_ids(obj["ids"]) if "ids" in obj else {}
    x, y = obj.get("x", []), obj["y"]
    if not isinstance(x, list) or len(x) > MAX_FEATURES or not (x or ids):
        raise DecodeError("wrong_shape", f"x must be a list of at most {MAX_FEATURES} numbers, "
                                         "non-empty unless the record has ids")
    if not all(type(v) in (int, float) for v in x):
        raise DecodeError("wrong_dtype", "x must hold only numbers")
    try:
        finite = all(math.isfinite(v) for v in x)
    except OverflowError:  # an integer beyond float range
        raise DecodeError("non_finite", "features hold an integer too large for a float") from None
    if not finite:
        raise DecodeError("non_finite", "features contain NaN or infinity")
    if type(y) not in (int, float):
        raise DecodeError("wrong_dtype", f"y must be a number, got {type(y).__name__}")
    w = _single_weight(obj["w"]) if "w" in obj else None
    return ids, x, y, w


def check_single_record(obj: Any, *, feature_dim: int | None = None) -> None:
    """Check a single record already parsed from JSON or msgpack (a map of ``x``, ``ids``, ``y``, ``w``) as
    :func:`decode_record` would, without building its arrays: what the joiner checks of each impression's
    features, so that it never writes a record a trainer would refuse.

    Raises:
        DecodeError: the record is not valid; ``reason`` says why (the reasons of :func:`decode_record`).
    """
    _, x, y, _ = _single_fields(obj)
    if feature_dim is not None and len(x) != feature_dim:
        raise DecodeError("wrong_shape", f"records have {len(x)} features; this stream has {feature_dim}")
    if type(y) is float and not math.isfinite(y):
        raise DecodeError("non_finite", "labels contain NaN or infinity")


def _decode_single(obj: Any, kind: str) -> Records:
    ids, x, y, w = _single_fields(obj)
    y_arr = np.array([y], dtype=np.int64 if type(y) is int else np.float64)
    return Records(x=np.array([x], dtype=np.float64).reshape(1, len(x)), y=y_arr, producer_id=None,
                   first_seq=None, ts_ms=None, kind=kind, ids=_single_ids(ids) if ids else {}, w=w)


def _check(rec: Records, feature_dim: int | None, label_kind: str | None,
           ctx: dict[str, Any]) -> Records:
    d = rec.x.shape[1]
    if feature_dim is not None and d != feature_dim:
        raise DecodeError("wrong_shape", f"records have {d} features; this stream has {feature_dim}", **ctx)
    y = rec.y
    if label_kind == "classification" and y.dtype.kind == "f":
        if not (np.isfinite(y).all() and (y == np.round(y)).all()):
            raise DecodeError("wrong_dtype", "classification labels must be integers", **ctx)
        rec = replace(rec, y=y.astype(np.int64))
    if rec.x.dtype.kind == "f" and not np.isfinite(rec.x).all():
        raise DecodeError("non_finite", "features contain NaN or infinity", **ctx)
    if rec.y.dtype.kind == "f" and not np.isfinite(rec.y).all():
        raise DecodeError("non_finite", "labels contain NaN or infinity", **ctx)
    return rec


def decode_record(value: bytes | None, *, feature_dim: int | None = None, label_kind: str | None = None,
                  max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Records:
    """Decode one Kafka message value in any of the three formats.

    IDs are checked against :data:`MAX_ID_FEATURES` and :data:`MAX_IDS_PER_FEATURE` in every
    record; a shard's ``values`` stay views on ``value``.

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
