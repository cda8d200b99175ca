"""The record codecs as pure functions: every format, every rejection reason."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from datastream.records import (
    REASONS,
    SHARD_VERSION,
    DecodeError,
    check_single_record,
    decode_record,
    encode_json_record,
    encode_msgpack_record,
    encode_shard,
    label_kind_of,
)


def _shard(n: int = 5, d: int = 3, **kw) -> bytes:
    x = np.arange(n * d, dtype=np.float32).reshape(n, d)
    y = np.arange(n, dtype=np.int64)
    return encode_shard(x, y, producer_id="p1", first_seq=10, ts_ms=1234, **kw)


def _reason(value: bytes | None, **kw) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode_record(value, **kw)
    assert info.value.reason in REASONS
    assert str(info.value).startswith(info.value.reason + ":")
    return info.value


def test_shard_round_trip_is_a_view_on_the_bytes() -> None:
    rec = decode_record(_shard(), feature_dim=3, label_kind="classification")
    assert rec.kind == "shard" and rec.count == 5
    assert rec.producer_id == "p1" and rec.first_seq == 10 and rec.ts_ms == 1234
    np.testing.assert_array_equal(rec.x, np.arange(15, dtype=np.float32).reshape(5, 3))
    np.testing.assert_array_equal(rec.y, np.arange(5))
    assert rec.x.dtype == np.float32 and rec.y.dtype == np.int64
    assert not rec.x.flags.owndata  # a view on the msgpack bin, no copy


@pytest.mark.parametrize("x_dtype,y_dtype,kind", [
    (np.float64, np.float32, "regression"), (np.uint8, np.int32, "classification"),
    (np.float16, np.float64, "regression")])
def test_shard_dtypes(x_dtype, y_dtype, kind) -> None:
    x = np.ones((4, 2), dtype=x_dtype)
    y = np.arange(4).astype(y_dtype)
    rec = decode_record(encode_shard(x, y, producer_id="p", first_seq=0))
    assert rec.x.dtype == x_dtype and rec.y.dtype == y_dtype and label_kind_of(rec.y) == kind


def test_encode_shard_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="x \\[n, d\\]"):
        encode_shard(np.ones((3,)), np.ones(3), producer_id="p", first_seq=0)
    with pytest.raises(ValueError, match="cannot go into a shard"):
        encode_shard(np.ones((3, 2), dtype=np.complex64), np.ones(3), producer_id="p", first_seq=0)
    with pytest.raises(ValueError, match="first_seq"):
        encode_shard(np.ones((3, 2)), np.ones(3), producer_id="p", first_seq=-1)


def test_json_and_msgpack_single_records() -> None:
    for value, kind in ((encode_json_record([1, 2.5], 3), "json"),
                        (encode_msgpack_record([1, 2.5], 3), "msgpack"),
                        (b'  {"y": 3, "x": [1, 2.5]}\n', "json")):
        rec = decode_record(value, feature_dim=2)
        assert rec.kind == kind and rec.count == 1 and rec.producer_id is None
        np.testing.assert_array_equal(rec.x, [[1.0, 2.5]])
        assert rec.y.tolist() == [3] and label_kind_of(rec.y) == "classification"
    rec = decode_record(json.dumps({"x": [0.5], "y": 0.25}).encode(), label_kind="regression")
    assert label_kind_of(rec.y) == "regression" and rec.y.tolist() == [0.25]
    rec = decode_record(json.dumps({"x": [0.5], "y": 2.0}).encode(), label_kind="classification")
    assert rec.y.dtype == np.int64 and rec.y.tolist() == [2]


def _shard_map(**changes) -> bytes:
    obj = msgpack.unpackb(_shard())
    obj.update(changes)
    return msgpack.packb(obj)


BAD = {
    "truncated": [_shard()[:-7], _shard()[:20], b'{"x": [1, 2], "y":', b"",
                  _shard_map(x={"dtype": "float32", "shape": [5, 3], "data": b"\0" * 12})],
    "bad_msgpack": [b"\xc1", msgpack.packb({"x": [1.0], "y": 1}) + b"\x00", b"\x81\x01\x02junk"],
    "bad_json": [b'{"x": [1, 2], "y": 1,,}', b"{\xff\xfe}"],
    "unknown_version": [_shard_map(v=SHARD_VERSION + 1), _shard_map(v="1")],
    "bad_schema": [msgpack.packb({"x": [1.0]}), b'{"x": [1], "y": 1, "z": 0}', b"[1, 2]",
                   _shard_map(n="five"), msgpack.packb({"v": 1, "x": 1}),
                   _shard_map(x={"dtype": "float32", "shape": "5x3", "data": b""})],
    "wrong_shape": [b'{"x": [], "y": 1}', _shard_map(n=4), b'{"x": 1, "y": 1}',
                    _shard_map(x={"dtype": "float32", "shape": [5, 2], "data": b"\0" * 60})],
    "wrong_dtype": [b'{"x": ["a"], "y": 1}', b'{"x": [1], "y": "cat"}', b'{"x": [1], "y": true}',
                    _shard_map(x={"dtype": "complex64", "shape": [5, 3], "data": b"\0" * 120})],
    "non_finite": [b'{"x": [NaN], "y": 1}', b'{"x": [Infinity, 1], "y": 1}',
                   encode_shard(np.array([[1.0], [np.inf]], np.float32), np.zeros(2, np.int64),
                                producer_id="p", first_seq=0),
                   b'{"x": [1], "y": NaN}', b'{"x": [1%s], "y": 1}' % (b"0" * 400)],
    "bad_ids": [b'{"x": [1], "y": 1, "ids": {"u": 1.5}}', b'{"y": 1, "ids": {"no space": 1}}',
                msgpack.packb({"x": [1.0], "y": 1, "ids": {"u": 1 << 63}})],
    "too_many_ids": [json.dumps({"y": 1, "ids": {"u": list(range(2000))}}).encode(),
                     msgpack.packb({"y": 1, "ids": {f"f{i}": 1 for i in range(100)}})],
}


@pytest.mark.parametrize("reason,value", [(r, v) for r, vs in BAD.items() for v in vs])
def test_bad_records_are_rejected_with_their_reason(reason: str, value: bytes) -> None:
    assert _reason(value).reason == reason


def _single(value: bytes) -> dict | None:
    """``value`` parsed, when it parses to a single record's map (not a shard)."""
    try:
        obj = json.loads(value) if value[:1] == b"{" else msgpack.unpackb(value, strict_map_key=False)
    except (ValueError, msgpack.UnpackException):
        return None
    return obj if isinstance(obj, dict) and "v" not in obj else None


@pytest.mark.parametrize("reason,value", [(r, v) for r, vs in BAD.items() for v in vs if _single(v) is not None])
def test_checking_a_parsed_record_refuses_what_decoding_refuses(reason: str, value: bytes) -> None:
    with pytest.raises(DecodeError) as err:
        check_single_record(_single(value))
    assert err.value.reason == reason


def test_checking_a_parsed_record_accepts_what_decoding_accepts() -> None:
    for value in (b'{"x": [1, 2.5], "y": 1}', b'{"ids": {"u": [1, "a"]}, "y": 0, "w": 2}'):
        decode_record(value)
        check_single_record(json.loads(value))
    check_single_record({"x": [1.0, 2.0], "y": 0}, feature_dim=2)
    with pytest.raises(DecodeError, match="3 features"):
        check_single_record({"x": [1.0, 2.0, 3.0], "y": 0}, feature_dim=2)


def test_every_reason_is_exercised() -> None:
    assert set(BAD) | {"too_large"} == set(REASONS)


def test_stream_checks_shape_dtype_and_size() -> None:
    err = _reason(_shard(d=3), feature_dim=4)
    assert err.reason == "wrong_shape" and err.producer_id == "p1" and err.first_seq == 10 and err.count == 5
    assert _reason(b'{"x": [1, 2], "y": 1}', feature_dim=3).reason == "wrong_shape"
    assert _reason(b'{"x": [1], "y": 0.5}', label_kind="classification").reason == "wrong_dtype"
    err = _reason(_shard(n=100), max_bytes=1000)
    assert err.reason == "too_large" and "1000" in str(err)
    with pytest.raises(ValueError, match="label_kind"):
        decode_record(_shard(), label_kind="ranking")


def test_a_truncated_shard_still_names_its_records() -> None:
    err = _reason(_shard()[:-30])
    assert (err.reason, err.producer_id, err.first_seq, err.count) == ("truncated", "p1", 10, 5)
    assert _reason(_shard()[:3]).producer_id is None
