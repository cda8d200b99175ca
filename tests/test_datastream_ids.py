"""Categorical IDs in the data plane as pure functions: Jagged columns, the record codecs with ids,
the string hash, the limits, and the sources and shards that carry them."""

from __future__ import annotations

import hashlib
import json
import sys
import types

import msgpack
import numpy as np
import pytest

from datastream.examples import Examples
from datastream.jagged import Jagged, concat_features
from datastream.producer import iter_shards
from datastream.records import (
    DENSE_SHARD_VERSION,
    MAX_ID_FEATURES,
    MAX_IDS_PER_FEATURE,
    SHARD_VERSION,
    DecodeError,
    decode_record,
    encode_json_record,
    encode_msgpack_record,
    encode_shard,
    hash_id,
)
from datastream.sources import Source, SourceError, load_source

# A shard written by the version-1 producer (datastream/records.py before IDs existed), byte for byte:
# x [[0.5, -1], [2, 3.25]] float32, y [1, 0] int64, producer "old-producer", seq 7, ts 1700000000000.
OLD_V1_SHARD = bytes.fromhex(
    "87a17601a870726f6475636572ac6f6c642d70726f6475636572a373657107a16e02a27473cf0000018bcfe56800a178"
    "83a56474797065a7666c6f61743332a57368617065920202a464617461c4100000003f000080bf0000004000005040a179"
    "83a56474797065a5696e743634a573686170659102a464617461c41001000000000000000000000000000000")


def _ids(n: int = 4) -> dict[str, Jagged]:
    return {"user": Jagged.from_lists([[10 + r] for r in range(n)]),
            "genres": Jagged.from_lists([[3, 7], [], [1 << 62], [-5, 6, 7]][:n])}


def _shard_v2(n: int = 4, d: int = 2, ids: dict[str, Jagged] | None = None) -> bytes:
    x = np.arange(n * d, dtype=np.float32).reshape(n, d)
    return encode_shard(x, np.arange(n, dtype=np.int64) % 2, ids=_ids(n) if ids is None else ids,
                        producer_id="p2", first_seq=40, ts_ms=99)


def _reason(value: bytes, **kw) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode_record(value, **kw)
    return info.value


# -- Jagged ------------------------------------------------------------------------------------------

def test_jagged_basics_concat_slice_take() -> None:
    a = Jagged.from_lists([[1, 2], [], [3]])
    assert (a.n, len(a), a.nnz) == (3, 3, 3)
    assert a.offsets.tolist() == [0, 2, 2, 3] and a.lengths.tolist() == [2, 0, 1]
    assert a.to_lists() == [[1, 2], [], [3]] and a.row_ids().tolist() == [0, 0, 2]
    e = Jagged.empty(2)
    assert e.to_lists() == [[], []] and e.values.dtype == np.int64 and Jagged.empty(0).n == 0
    b = Jagged.from_lengths(np.array([9, 8, 7]), np.array([0, 3], np.int32))
    joined = Jagged.concat([a, e, b])
    assert joined.to_lists() == [[1, 2], [], [3], [], [], [], [9, 8, 7]]
    assert joined.offsets.tolist() == [0, 2, 2, 3, 3, 3, 3, 6]
    assert Jagged.concat([]).n == 0 and Jagged.concat([a]) == a
    part = joined.slice(2, 7)
    assert part.to_lists() == [[3], [], [], [], [9, 8, 7]]
    assert np.shares_memory(part.values, joined.values)  # a slice's values are a view
    assert joined.take(np.array([6, 0, 6, 1])).to_lists() == [[9, 8, 7], [1, 2], [9, 8, 7], []]
    mask = np.array([True, False, True, False, False, False, True])
    assert joined.take(mask).to_lists() == [[1, 2], [3], [9, 8, 7]]
    assert joined.take(np.array([], np.int64)).n == 0
    assert a != b and a == Jagged.from_lists([[1, 2], [], [3]])


@pytest.mark.parametrize("values,offsets,message", [
    (np.array([1, 2], np.int32), np.array([0, 2]), "int64"),
    (np.array([[1, 2]]), np.array([0, 2]), "1-D int64"),
    (np.array([1, 2]), np.array([], np.int64), "non-empty"),
    (np.array([1, 2]), np.array([1, 2]), "from 0"),
    (np.array([1, 2]), np.array([0, 1]), "to len"),
    (np.array([1, 2]), np.array([0, 2, 1, 2]), "non-decreasing"),
    (np.array([1, 2]), np.array([0, 2.0, 2.0]), "int64"),
])
def test_jagged_refuses_broken_invariants(values, offsets, message) -> None:
    with pytest.raises(ValueError, match=message):
        Jagged(values, offsets)


def test_jagged_helpers_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Jagged.from_lengths(np.array([1]), np.array([2, -1]))
    with pytest.raises(ValueError, match="to len"):
        Jagged.from_lengths(np.array([1]), np.array([2]))
    with pytest.raises(ValueError, match="mask"):
        Jagged.from_lists([[1]]).take(np.array([True, False]))
    with pytest.raises(ValueError, match="outside"):
        Jagged.from_lists([[1]]).slice(0, 2)
    with pytest.raises(ValueError, match="n must be"):
        Jagged.empty(-1)


def test_concat_features_fills_absent_features_with_empty_rows() -> None:
    parts = [(2, {"a": Jagged.from_lists([[1], [2]])}),
             (1, {}),
             (2, {"b": Jagged.from_lists([[5, 6], []]), "a": Jagged.from_lists([[], [3]])})]
    ids = concat_features(parts)
    assert list(ids) == ["a", "b"] and all(col.n == 5 for col in ids.values())  # in order of first appearance
    assert ids["a"].to_lists() == [[1], [2], [], [], [3]]
    assert ids["b"].to_lists() == [[], [], [], [5, 6], []]
    assert concat_features([]) == {}
    with pytest.raises(ValueError, match="3 records in a part of 2"):
        concat_features([(2, {"a": Jagged.from_lists([[1], [2], [3]])})])


# -- the string hash ---------------------------------------------------------------------------------

def test_string_ids_hash_as_documented() -> None:
    # fixed values: these must never change (stored models key their rows by them)
    assert hash_id("paris") == 1657316678316814225
    assert hash_id("") == -5426141060434712860
    assert hash_id("user-42") == -6417657526719176593
    for s in ("paris", "Zürich", "東京", ""):  # the documented recipe, spelled out
        digest = hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest()
        assert hash_id(s) == int.from_bytes(digest, "little", signed=True)
    assert hash_id("Paris") != hash_id("paris")


# -- shards with ids ---------------------------------------------------------------------------------

def test_shard_with_ids_round_trips_as_views() -> None:
    value = _shard_v2()
    assert msgpack.unpackb(value)["v"] == SHARD_VERSION == 2
    rec = decode_record(value, feature_dim=2, label_kind="classification")
    assert rec.count == 4 and rec.producer_id == "p2" and rec.first_seq == 40 and list(rec.ids) == ["user", "genres"]
    assert rec.ids["user"].to_lists() == [[10], [11], [12], [13]]
    assert rec.ids["genres"].to_lists() == [[3, 7], [], [1 << 62], [-5, 6, 7]]
    for col in rec.ids.values():
        assert col.values.dtype == np.int64 and not col.values.flags.owndata  # a view on the message
        assert not col.values.flags.writeable and col.offsets.dtype == np.int64
    assert msgpack.unpackb(value)["ids"]["keys"] == ["user", "genres"]  # laid out as a KeyedJaggedTensor
    assert msgpack.unpackb(value)["ids"]["lengths"]["shape"] == [2, 4]
    empty = decode_record(_shard_v2(ids={"a": Jagged.empty(4), "b": Jagged.from_lists([[], [], [], [1]])}))
    assert empty.ids["a"].to_lists() == [[]] * 4 and empty.ids["b"].to_lists() == [[], [], [], [1]]
    np.testing.assert_array_equal(rec.x, np.arange(8, dtype=np.float32).reshape(4, 2))


def test_shards_of_ids_only_and_of_dense_only() -> None:
    only_ids = encode_shard(np.empty((4, 0), np.float32), np.zeros(4, np.int64), ids=_ids(),
                            producer_id="p", first_seq=0)
    rec = decode_record(only_ids, feature_dim=0)
    assert rec.x.shape == (4, 0) and rec.ids["user"].n == 4
    assert _reason(only_ids, feature_dim=2).reason == "wrong_shape"  # a stream's dense width is fixed
    # without ids the shard stays version 1, byte for byte what the version-1 producer wrote
    dense = encode_shard(np.array([[0.5, -1.0], [2.0, 3.25]], np.float32), np.array([1, 0], np.int64),
                         producer_id="old-producer", first_seq=7, ts_ms=1700000000000, ids={})
    assert dense == OLD_V1_SHARD and msgpack.unpackb(dense)["v"] == DENSE_SHARD_VERSION == 1


def test_old_version_1_shards_still_decode() -> None:
    rec = decode_record(OLD_V1_SHARD, feature_dim=2, label_kind="classification")
    assert (rec.kind, rec.producer_id, rec.first_seq, rec.count, rec.ts_ms) == ("shard", "old-producer", 7, 2,
                                                                                 1700000000000)
    np.testing.assert_array_equal(rec.x, [[0.5, -1.0], [2.0, 3.25]])
    assert rec.y.tolist() == [1, 0] and rec.ids == {}


def test_encode_shard_refuses_ids_that_break_the_rules() -> None:
    def enc(ids, n=2):
        return encode_shard(np.ones((n, 1), np.float32), np.zeros(n, np.int64), ids=ids,
                            producer_id="p", first_seq=0)
    with pytest.raises(ValueError, match="Jagged of 2 records"):
        enc({"a": Jagged.from_lists([[1]])})
    with pytest.raises(ValueError, match="feature name"):
        enc({"a b": Jagged.from_lists([[1], [2]])})
    with pytest.raises(ValueError, match=f"at most {MAX_IDS_PER_FEATURE}"):
        enc({"a": Jagged.from_lists([list(range(MAX_IDS_PER_FEATURE + 1)), []])})
    with pytest.raises(ValueError, match=f"at most {MAX_ID_FEATURES}"):
        enc({f"f{i}": Jagged.empty(2) for i in range(MAX_ID_FEATURES + 1)})
    enc({"a": Jagged.from_lists([list(range(MAX_IDS_PER_FEATURE)), []])})  # the limits themselves are fine
    enc({f"f{i}": Jagged.empty(2) for i in range(MAX_ID_FEATURES)})


# -- single records with ids -------------------------------------------------------------------------

def test_json_and_msgpack_records_with_ids() -> None:
    ids = {"user": 42, "genres": [3, 7], "city": "paris", "none": [], "big": -(1 << 63)}
    for value, kind in ((encode_json_record([0.5], 1, ids=ids), "json"),
                        (encode_msgpack_record([0.5], 1, ids=ids), "msgpack")):
        rec = decode_record(value, feature_dim=1)
        assert rec.kind == kind and rec.count == 1
        assert {k: v.to_lists() for k, v in rec.ids.items()} == {
            "user": [[42]], "genres": [[3, 7]], "city": [[hash_id("paris")]], "none": [[]], "big": [[-(1 << 63)]]}
    rec = decode_record(b'{"y": 0, "ids": {"u.id-2_x": ["a", 5, "b"]}}')  # no x: ids only
    assert rec.x.shape == (1, 0) and rec.ids["u.id-2_x"].to_lists() == [[hash_id("a"), 5, hash_id("b")]]
    rec = decode_record(encode_msgpack_record(None, 2, ids={"u": [(1 << 63) - 1]}), feature_dim=0)
    assert rec.x.shape == (1, 0) and rec.ids["u"].values.tolist() == [(1 << 63) - 1]
    assert decode_record(b'{"x": [], "y": 0, "ids": {"u": 1}}').x.shape == (1, 0)
    assert decode_record(encode_json_record([1, 2], 0)).ids == {}  # records without ids have none


def _json(ids: object, x: str = '"x": [1], ') -> bytes:
    return ('{' + x + '"y": 1, "ids": ' + json.dumps(ids) + '}').encode()


@pytest.mark.parametrize("value", [
    _json({"u": 1.5}), _json({"u": True}), _json({"u": None}), _json({"u": [1, [2]]}), _json({"u": {"v": 1}}),
    _json({"u": 1 << 63}), _json({"u": -(1 << 63) - 1}), _json({"u": [1, 2.0]}),
    _json({"bad name": 1}), _json({"": 1}), _json({"x" * 65: 1}), _json({"é": 1}), _json([1, 2]), _json(7),
    b'{"x": [1], "y": 1, "ids": {"u": "\\ud800"}}',  # a lone surrogate has no UTF-8 bytes
    msgpack.packb({"x": [1.0], "y": 1, "ids": {"u": b"raw"}}),
    msgpack.packb({"x": [1.0], "y": 1, "ids": {"u": (1 << 64) - 1}}),
    msgpack.packb({"x": [1.0], "y": 1, "ids": {b"u": 1}}),
    msgpack.packb({"x": [1.0], "y": 1, "ids": {"u": 1.0}}),
])
def test_bad_ids_of_single_records(value: bytes) -> None:
    err = _reason(value)
    assert err.reason == "bad_ids", err


def test_limits_of_single_records() -> None:
    most = {f"f{i}": [1] * MAX_IDS_PER_FEATURE for i in range(MAX_ID_FEATURES)}
    for encode in (encode_json_record, encode_msgpack_record):
        assert len(decode_record(encode([1.0], 0, ids=most)).ids) == MAX_ID_FEATURES  # the limits pass
        for ids in ({f"f{i}": 1 for i in range(MAX_ID_FEATURES + 1)},
                    {"u": list(range(MAX_IDS_PER_FEATURE + 1))}):
            err = _reason(encode([1.0], 0, ids=ids))
            assert err.reason == "too_many_ids" and str(MAX_ID_FEATURES if len(ids) > 1 else MAX_IDS_PER_FEATURE) \
                in str(err)


@pytest.mark.parametrize("value,reason", [
    (b'{"y": 1}', "bad_schema"), (b'{"y": 1, "ids": {}, "z": 0}', "bad_schema"),
    (b'{"x": [1], "ids": {}}', "bad_schema"),
    (b'{"y": 1, "ids": {}}', "wrong_shape"), (b'{"x": [], "y": 1, "ids": {}}', "wrong_shape"),
])
def test_a_single_record_needs_features_of_some_kind(value: bytes, reason: str) -> None:
    assert _reason(value).reason == reason


def _edit_v2(**changes) -> bytes:
    """The shard of :func:`_shard_v2` (keys user, genres; 4 records, 10 IDs) with ``ids`` fields replaced."""
    obj = msgpack.unpackb(_shard_v2())
    if "ids" in changes:
        obj["ids"] = changes["ids"]
    else:
        obj["ids"].update(changes)
    return msgpack.packb(obj)


def _arr(a: np.ndarray) -> dict:
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}


def _lengths(*rows: list[int]) -> dict:
    return _arr(np.array(rows, np.int32))


@pytest.mark.parametrize("value,reason", [
    (_edit_v2(lengths=_lengths([1, 1, 1, 1], [2, 0, 1, 2])), "bad_ids"),  # adds up to 9, values hold 10
    (_edit_v2(lengths=_lengths([1, 1, 1, 1], [2, -1, 2, 3])), "bad_ids"),
    (_edit_v2(lengths=_lengths([1, 1, 1], [2, 0, 1])), "bad_ids"),
    (_edit_v2(lengths=_arr(np.ones(10, np.int32))), "bad_ids"),
    (_edit_v2(lengths=_arr(np.ones((2, 4), np.float32))), "bad_ids"),
    (_edit_v2(values=_arr(np.zeros(10, np.int32))), "bad_ids"),
    (_edit_v2(values=_arr(np.zeros((2, 5), np.int64))), "bad_ids"),
    (_edit_v2(values=_arr(np.zeros(10, np.complex64))), "wrong_dtype"),
    (_edit_v2(values={"dtype": "int64", "shape": [10], "data": b"\0" * 72}), "truncated"),
    (_edit_v2(ids=[1, 2]), "bad_ids"),
    (_edit_v2(ids={"keys": ["u"], "values": _arr(np.zeros(4, np.int64))}), "bad_ids"),
    (_edit_v2(keys="user,genres"), "bad_ids"),
    (_edit_v2(keys=["user", "bad name"]), "bad_ids"),
    (_edit_v2(keys=["user", 7]), "bad_ids"),
    (_edit_v2(keys=["user", "user"]), "bad_ids"),
    (_edit_v2(keys=["user"]), "bad_ids"),  # two rows of lengths for one key
    (_edit_v2(lengths=_lengths([1, 1, 1, 1], [MAX_IDS_PER_FEATURE + 1, 0, 0, 0]),
              values=_arr(np.zeros(MAX_IDS_PER_FEATURE + 5, np.int64))), "too_many_ids"),
    (_edit_v2(ids={"keys": [f"f{i}" for i in range(MAX_ID_FEATURES + 1)], "values": _arr(np.zeros(0, np.int64)),
                   "lengths": _arr(np.zeros((MAX_ID_FEATURES + 1, 4), np.int32))}), "too_many_ids"),
])
def test_bad_ids_in_shards_name_their_records(value: bytes, reason: str) -> None:
    err = _reason(value)
    assert (err.reason, err.producer_id, err.first_seq, err.count) == (reason, "p2", 40, 4), err


def test_shard_versions_and_their_keys() -> None:
    v2 = msgpack.unpackb(_shard_v2())
    del v2["ids"]
    assert _reason(msgpack.packb(v2)).reason == "bad_schema"  # version 2 needs ids
    v1 = msgpack.unpackb(OLD_V1_SHARD)
    v1["ids"] = msgpack.unpackb(_shard_v2())["ids"]
    assert _reason(msgpack.packb(v1)).reason == "bad_schema"  # version 1 cannot carry them
    assert _reason(msgpack.packb({**v1, "v": 3})).reason == "unknown_version"
    assert _reason(msgpack.packb({**v1, "v": True})).reason == "unknown_version"


# -- examples, sources and shards with ids -----------------------------------------------------------

def test_examples_unpack_only_without_ids() -> None:
    dense = Examples(np.ones((2, 1), np.float32), np.zeros(2, np.int64))
    x, y = dense
    assert x.shape == (2, 1) and y.shape == (2,)
    with_ids = Examples(np.ones((2, 1), np.float32), np.zeros(2, np.int64), {"u": Jagged.from_lists([[1], [2]])})
    with pytest.raises(TypeError, match=r"\(u\).*read .x, .y and .ids"):
        x, y = with_ids
    with pytest.raises(ValueError, match="do not have the 2 rows"):
        Examples(np.ones((2, 1), np.float32), np.zeros(2, np.int64), {"u": Jagged.from_lists([[1]])})
    joined = Examples.concat([dense, with_ids, dense])
    assert len(joined) == 6 and joined.ids["u"].to_lists() == [[], [], [1], [2], [], []]


def test_jsonl_files_carry_ids_and_the_split_keeps_them_aligned(tmp_path) -> None:
    lines = []
    for i in range(12):
        rec = {"y": i % 2, "ids": {"user": i, "tags": [f"t{j}" for j in range(i % 3)]}}
        if i % 4 == 0:
            rec["ids"]["rare"] = "z"
        lines.append(json.dumps(rec))
    (tmp_path / "ids.jsonl").write_text("\n".join(lines) + "\n")
    test = load_source(f"jsonl:{tmp_path / 'ids.jsonl'}", split="test").read()
    assert test.x.shape == (2, 0) and test.y.tolist() == [0, 1]  # records 4 and 9
    assert test.ids["user"].to_lists() == [[4], [9]]
    assert test.ids["tags"].to_lists() == [[hash_id("t0")], []]
    assert test.ids["rare"].to_lists() == [[hash_id("z")], []]
    with pytest.raises(TypeError, match="carry ID features"):
        _x, _y = test
    (tmp_path / "mixed.jsonl").write_text('{"x": [1, 2], "y": 0, "ids": {"u": 1}}\n{"x": [3, 4], "y": 1}\n')
    both = load_source(f"{tmp_path / 'mixed.jsonl'}").read()
    assert both.x.tolist() == [[1, 2], [3, 4]] and both.ids["u"].to_lists() == [[1], []]
    (tmp_path / "bad.jsonl").write_text('{"x": [1], "y": 0}\n{"x": [1], "y": 0, "ids": {"u": 1.5}}\n')
    with pytest.raises(SourceError, match="line 2: bad_ids"):
        load_source(f"jsonl:{tmp_path / 'bad.jsonl'}").read()
    (tmp_path / "none.jsonl").write_text('{"y": 0}\n')
    with pytest.raises(SourceError, match="line 1"):
        load_source(f"jsonl:{tmp_path / 'none.jsonl'}").read()


def test_plugin_sources_may_yield_ids(monkeypatch) -> None:
    mod = types.ModuleType("my_id_source")
    mod.records = lambda: ((np.array([float(i)]), i % 2, {"u": i, "g": ["a"] * i}) for i in range(3))
    mod.blocks = lambda: iter([(np.zeros((2, 0)), np.array([0, 1]), {"u": Jagged.from_lists([[1], [2, 3]])})])
    mod.bad_block = lambda: iter([(np.zeros((2, 1)), np.array([0, 1]), {"u": [[1], [2]]})])
    mod.short = lambda: iter([(np.zeros((2, 1)), np.array([0, 1]), {"u": Jagged.from_lists([[1]])})])
    mod.bad_id = lambda: iter([(np.zeros(1), 0, {"u": True})])
    monkeypatch.setitem(sys.modules, "my_id_source", mod)
    got = load_source("my_id_source:records").read()
    assert got.x.tolist() == [[0], [1], [2]] and got.ids["g"].to_lists() == [[], [hash_id("a")], [hash_id("a")] * 2]
    assert load_source("my_id_source:blocks").read().ids["u"].to_lists() == [[1], [2, 3]]
    for name, message in (("bad_block", "Jagged columns"), ("short", "one entry per row"), ("bad_id", "bad_ids")):
        with pytest.raises(SourceError, match=message):
            load_source(f"my_id_source:{name}").read()


def test_iter_shards_rechunks_ids_exactly() -> None:
    def blocks():
        start = 0
        for n, names in ((5, ("a",)), (3, ()), (6, ("a", "b"))):
            ids = {name: Jagged.from_lists([[start + r] * (r % 3) for r in range(n)]) for name in names}
            yield start, Examples(np.arange(start, start + n, dtype=np.float32)[:, None], np.zeros(n, np.int64), ids)
            start += n
    src = Source("blocks", blocks)
    whole = src.read()
    shards = list(iter_shards(src, 4))
    assert [len(s) for s in shards] == [4, 4, 4, 2]
    assert [sorted(s.ids) for s in shards] == [["a"], ["a"], ["a", "b"], ["a", "b"]]
    joined = Examples.concat(shards)
    np.testing.assert_array_equal(joined.x, whole.x)
    assert joined.ids == whole.ids and whole.ids["b"].to_lists()[:8] == [[]] * 8
    for s in shards:  # every shard encodes and decodes to the same IDs
        rec = decode_record(encode_shard(s.x, s.y, ids=s.ids, producer_id="p", first_seq=0))
        assert rec.ids == s.ids
