"""The replica's wire formats as pure functions: OIP requests and answers, /v1/predict records, errors."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from datastream.jagged import Jagged
from datastream.records import MAX_IDS_PER_FEATURE, hash_id
from serving.protocol import (
    CODES,
    PLATFORM,
    InferAsk,
    ProtocolError,
    Signature,
    error_body,
    infer_response,
    model_metadata,
    model_outputs,
    output_names,
    parse_infer,
    parse_records,
)

SIG = Signature(job="ctr", dense=3, features=("user", "item"), kind="binary", max_records=8)
DENSE = Signature(job="digits", dense=2, features=(), kind="classes", classes=4)
IDS_ONLY = Signature(job="recs", dense=0, features=("user",), kind="regression")


def _body(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _x(data: Any, shape: list[int], datatype: str = "FP32") -> dict[str, Any]:
    return {"name": "x", "shape": shape, "datatype": datatype, "data": data}


def _feature(name: str, values: list[Any], lengths: list[Any], datatype: str = "INT64",
             lengths_datatype: str = "INT64") -> list[dict[str, Any]]:
    return [{"name": name, "shape": [len(values)], "datatype": datatype, "data": values},
            {"name": name + ".lengths", "shape": [len(lengths)], "datatype": lengths_datatype, "data": lengths}]


def _refused(body: bytes, sig: Signature = SIG, *, parse: Any = parse_infer) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(body, sig)
    assert info.value.code in CODES
    return info.value


# --- parse_infer: valid requests ----------------------------------------------------------------


def test_flat_data_with_ragged_ids_and_an_empty_row() -> None:
    body = _body([_x([1, 2, 3, 4.5, 5, 6], [2, 3]), *_feature("user", [7, 8, 9], [2, 1]),
                  *_feature("item", [-5], [0, 1], datatype="INT32", lengths_datatype="INT32")])
    batch, ask = parse_infer(body, SIG)
    assert batch.n == 2
    assert batch.x.dtype == np.float32 and batch.x.flags.c_contiguous
    np.testing.assert_array_equal(batch.x, [[1, 2, 3], [4.5, 5, 6]])
    assert list(batch.ids) == ["user", "item"]
    assert batch.ids["user"].to_lists() == [[7, 8], [9]]
    assert batch.ids["item"].to_lists() == [[], [-5]]
    assert batch.ids["item"].values.dtype == np.int64
    assert ask == InferAsk(None, None, {})


def test_nested_data_reads_as_flat() -> None:
    flat, _ = parse_infer(_body([_x([1, 2, 3, 4, 5, 6], [2, 3])]), SIG)
    nested, _ = parse_infer(_body([_x([[1, 2, 3], [4, 5, 6]], [2, 3])]), SIG)
    np.testing.assert_array_equal(flat.x, nested.x)


def test_features_left_out_have_no_ids() -> None:
    batch, _ = parse_infer(_body([_x([0.5] * 3, [1, 3]), *_feature("item", [1, 2], [2])]), SIG)
    assert batch.ids["user"] == Jagged.empty(1)
    assert batch.ids["item"].to_lists() == [[1, 2]]


def test_dense_only_signature_converts_other_datatypes() -> None:
    for datatype, data in (("FP64", [0.25, 1e-3]), ("FP16", [0.5, 2.0]), ("INT32", [3, -4]), ("UINT8", [0, 255])):
        batch, _ = parse_infer(_body([_x(data, [1, 2], datatype)]), DENSE)
        assert batch.x.dtype == np.float32 and batch.x.shape == (1, 2)
        np.testing.assert_allclose(batch.x[0], np.array(data, np.float32))
        assert batch.ids == {}


def test_ids_only_signature_takes_n_from_the_lengths() -> None:
    batch, _ = parse_infer(_body(_feature("user", [1, 2, 3], [0, 3, 0])), IDS_ONLY)
    assert batch.n == 3 and batch.x.shape == (3, 0) and batch.x.dtype == np.float32
    assert batch.ids["user"].to_lists() == [[], [1, 2, 3], []]


def test_ids_beyond_int32_and_the_int64_extremes() -> None:
    ids = [-(1 << 63), (1 << 63) - 1, 1 << 40]
    batch, _ = parse_infer(_body(_feature("user", ids, [3])), IDS_ONLY)
    assert batch.ids["user"].values.tolist() == ids


def test_asks_echo_the_id_parameters_and_outputs() -> None:
    body = _body([_x([1, 2], [1, 2])], id="req-7", parameters={"trace": True},
                 outputs=[{"name": "class"}, {"name": "class", "parameters": {"binary_data": False}}])
    _, ask = parse_infer(body, DENSE)
    assert ask == InferAsk("req-7", ("class",), {"trace": True})
    _, ask = parse_infer(_body([_x([1, 2], [1, 2])], outputs=[]), DENSE)
    assert ask.outputs is None


def test_max_records_is_allowed() -> None:
    batch, _ = parse_infer(_body([_x([0] * 24, [8, 3])], parameters=None), SIG)
    assert batch.n == 8


def test_many_records_match_their_lists() -> None:
    rng = np.random.default_rng(0)
    rows = {f: [rng.integers(-(1 << 62), 1 << 62, int(k)).tolist() for k in rng.integers(0, 5, 4096)]
            for f in ("user",)}
    body = _body(_feature("user", [v for r in rows["user"] for v in r], [len(r) for r in rows["user"]],
                          lengths_datatype="INT32"))
    batch, _ = parse_infer(body, IDS_ONLY)
    assert batch.n == 4096 and batch.ids["user"] == Jagged.from_lists(rows["user"])


def test_both_routes_read_the_same_records() -> None:
    records = [{"x": [1, 2, 3], "ids": {"user": [1, 2], "item": [3]}}, {"x": [4, 5, 6], "ids": {"item": []}},
               {"x": [7, 8, 9], "ids": {"user": [4]}}]
    from_records = parse_records(json.dumps({"records": records}).encode(), SIG)
    inputs = [_x([v for r in records for v in r["x"]], [3, 3])]
    for f in SIG.features:
        lists = [r["ids"].get(f, []) for r in records]
        inputs += _feature(f, [v for r in lists for v in r], [len(r) for r in lists])
    from_infer, _ = parse_infer(_body(inputs), SIG)
    np.testing.assert_array_equal(from_records.x, from_infer.x)
    assert from_records.ids == from_infer.ids and from_records.n == from_infer.n == 3


# --- parse_infer: refusals ------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "code", "named"), [
    (b"{not json", "bad_json", "JSON"),
    (b"\xff\xfe{", "bad_json", "JSON"),
    (b"[1, 2]", "bad_json", "object"),
    (b"[" * 100_000, "bad_json", "JSON"),
    (b'{"inputs": []}', "bad_request", "inputs"),
    (b'{"inputs": [1]}', "bad_request", "name"),
    (_body([_x([1, 2, 3], [1, 3])], id=5), "bad_request", "id"),
    (_body([_x([1, 2, 3], [1, 3])], parameters=[]), "bad_request", "parameters"),
    (_body([_x([1, 2, 3], [1, 3])], outputs={"name": "logit"}), "bad_request", "outputs"),
    (_body([{"name": "x", "shape": [1, 3], "datatype": "FP32"}]), "bad_request", "'x'"),
    (_body([_x("1 2 3", [1, 3])]), "bad_request", "'x'"),
    (_body([_x([1, 2, 3], [1, 3]), {"name": "age", "shape": [1], "datatype": "FP32", "data": [3]}]),
     "unknown_input", "'age'"),
    (_body([_x([1, 2, 3], [1, 3]), _x([1, 2, 3], [1, 3])]), "duplicate_input", "'x'"),
    (_body(_feature("user", [1], [1])), "missing_input", "'x'"),
    (_body([_x([1, 2, 3], [1, 3]), _feature("user", [1], [1])[0]]), "missing_input", "'user.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), _feature("user", [1], [1])[1]]), "missing_input", "'user'"),
    (_body([_x([1, 2, 3], [3, 1])]), "wrong_shape", "'x'"),
    (_body([_x([1, 2, 3], [3])]), "wrong_shape", "'x'"),
    (_body([_x([1, 2, 3], [1, -3])]), "wrong_shape", "'x'"),
    (_body([_x([1, 2, 3], "1x3")]), "wrong_shape", "'x'"),
    (_body([_x([1, 2, 3, 4], [1, 3])]), "wrong_shape", "'x'"),
    (_body([_x([[1, 2], [3, 4, 5]], [2, 3])]), "wrong_shape", "'x'"),
    (_body([_x([[1, 2, 3], [4, 5, 6]], [3, 3])]), "wrong_shape", "'x'"),
    (_body([_x([[[1, 2, 3]]], [1, 3])]), "wrong_shape", "'x'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1, 2], [1, 1])]), "wrong_shape", "'user.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), {"name": "user", "shape": [1, 1], "datatype": "INT64", "data": [1]},
            _feature("user", [1], [1])[1]]), "wrong_shape", "'user'"),
    (_body([_x([1, 2, 3], [1, 3], "BYTES")]), "wrong_datatype", "'x'"),
    (_body([_x([1, 2, 3], [1, 3], "BOOL")]), "wrong_datatype", "'x'"),
    (_body([{"name": "x", "shape": [1, 3], "data": [1, 2, 3]}]), "wrong_datatype", "'x'"),
    (_body([_x([1, "2", 3], [1, 3])]), "wrong_datatype", "'x'"),
    (_body([_x([1, True, 3], [1, 3])]), "wrong_datatype", "'x'"),
    (_body([_x([1, None, 3], [1, 3])]), "wrong_datatype", "'x'"),
    (_body([_x([1, 2.5, 3], [1, 3], "INT32")]), "wrong_datatype", "'x'"),
    (_body([_x([1, 300, 3], [1, 3], "INT8")]), "wrong_datatype", "'x'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1], datatype="FP32")]), "wrong_datatype", "'user'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1], datatype="UINT64")]), "wrong_datatype", "'user'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1.0], [1])]), "wrong_datatype", "'user'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", ["a"], [1])]), "wrong_datatype", "'user'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [True])]), "wrong_datatype", "'user.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1], lengths_datatype="FP32")]),
     "wrong_datatype", "'user.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1 << 63], [1])]), "bad_ids", "'user'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1 << 40], [1], datatype="INT32")]), "bad_ids", "'user'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1, 2], [3])]), "bad_lengths", "'user.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1], lengths_datatype="INT32"),
            *_feature("item", [1], [1 << 40], lengths_datatype="INT32")]), "bad_lengths", "'item.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1 << 63])]), "bad_lengths", "lengths"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1]), *_feature("item", [1, 2], [1])]),
     "bad_lengths", "'item.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1]), *_feature("item", [1], [-1])]),
     "bad_lengths", "'item.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1]), *_feature("item", [-(1 << 63) - 1], [1])]),
     "bad_ids", "'item'"),
    (_body([_x([1, 2, 3] * 2, [2, 3]), *_feature("user", [1], [2, -1])]), "bad_lengths", "'user.lengths'"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", list(range(MAX_IDS_PER_FEATURE + 1)),
                                             [MAX_IDS_PER_FEATURE + 1])]), "too_many_ids", "'user"),
    (b'{"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, NaN, 3]}]}', "non_finite", "'x'"),
    (b'{"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, -Infinity, 3]}]}',
     "non_finite", "'x'"),
    (_body([_x([1, 1e39, 3], [1, 3])]), "non_finite", "'x'"),
    (_body([_x([1, 10 ** 400, 3], [1, 3])]), "non_finite", "'x'"),
    (_body([_x([1, 1e5, 3], [1, 3], "FP16")]), "non_finite", "'x'"),
    (_body([_x([], [0, 3])]), "no_records", "'x'"),
    (_body([_x([0] * 27, [9, 3])]), "too_many_records", "'x'"),
    (_body([_x([1, 2, 3], [1, 3])], outputs=[{"name": "value"}]), "unknown_output", "'value'"),
    (_body([_x([1, 2, 3], [1, 3])], outputs=[{"nom": "logit"}]), "bad_request", "name"),
    (_body([{**_x(None, [1, 3]), "parameters": {"binary_data_size": 12}}]), "binary_data", "'x'"),
    (_body([{**_x(None, [1, 3]), "parameters": {"binary_data_size": 12}}]) + b"\x00" * 12, "binary_data",
     "binary_data=False"),
    (_body([_x([1, 2, 3], [1, 3]), *_feature("user", [1], [1]),
            *_feature("item", list(range(MAX_IDS_PER_FEATURE + 1)), [MAX_IDS_PER_FEATURE + 1])]),
     "too_many_ids", "'item.lengths'"),
])
def test_refusals_name_the_problem(body: bytes, code: str, named: str) -> None:
    exc = _refused(body)
    assert exc.code == code, exc
    assert named in str(exc)


def test_unknown_input_lists_the_known_ones() -> None:
    exc = _refused(_body([{"name": "age", "shape": [1], "datatype": "FP32", "data": [3]}]))
    for name in ("x", "user", "user.lengths", "item", "item.lengths"):
        assert f"{name}" in str(exc)


def test_ids_only_refusals() -> None:
    assert _refused(_body([_x([1], [1, 1])]), IDS_ONLY).code == "unknown_input"
    assert _refused(_body(_feature("user", [], [])), IDS_ONLY).code == "no_records"
    too_many = _refused(_body(_feature("user", [], [0] * 4097)), IDS_ONLY)
    assert too_many.code == "too_many_records" and "4097" in str(too_many)


def test_error_body_is_the_oip_error_with_its_code() -> None:
    exc = _refused(_body([_x([1, 2, 3], [1, 4])]))
    assert error_body(exc) == {"error": str(exc), "code": "wrong_shape"}
    with pytest.raises(ValueError, match="unknown"):
        ProtocolError("no_such_code", "x")


# --- signatures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"dense": -1}, {"dense": 0, "features": ()}, {"features": ("x",)}, {"features": ("a.lengths",)},
    {"features": ("a b",)}, {"features": ("a", "a")}, {"features": ["a"]}, {"kind": "ranking"},
    {"kind": "classes", "classes": 1}, {"kind": "binary", "classes": 3}, {"max_records": 0}, {"job": ""},
])
def test_bad_signatures_are_refused(kwargs: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"job": "j", "dense": 2, "features": ("a",), "kind": "binary", **kwargs}
    with pytest.raises(ValueError):
        Signature(**fields)


def test_output_names_per_kind() -> None:
    assert output_names(SIG) == ("probability", "logit")
    assert output_names(DENSE) == ("probabilities", "class")
    assert output_names(IDS_ONLY) == ("value",)


# --- answers --------------------------------------------------------------------------------------


def test_binary_answer_round_trip() -> None:
    outs = model_outputs(SIG, np.array([[0.0], [1000.0], [-1000.0]], np.float32))
    np.testing.assert_allclose(outs["probability"], [0.5, 1.0, 0.0], atol=1e-7)
    answer = infer_response(SIG, InferAsk("r1", None), outs, model_version="12.7", parameters={"lag_ms": 3})
    answer = json.loads(json.dumps(answer, allow_nan=False))
    assert answer["model_name"] == "ctr" and answer["model_version"] == "12.7" and answer["id"] == "r1"
    assert answer["parameters"] == {"lag_ms": 3}
    assert [(o["name"], o["datatype"], o["shape"]) for o in answer["outputs"]] == [
        ("probability", "FP32", [3]), ("logit", "FP32", [3])]
    assert answer["outputs"][1]["data"] == [0.0, 1000.0, -1000.0]


def test_classes_answer_with_asked_outputs_only() -> None:
    logits = np.array([[1, 2, 3, 0], [5, 1, 1, 1]], np.float32)
    outs = model_outputs(DENSE, logits)
    np.testing.assert_allclose(outs["probabilities"].sum(axis=1), 1, rtol=1e-6)
    answer = infer_response(DENSE, InferAsk(None, ("class",)), outs, model_version="3", parameters={})
    assert "id" not in answer
    assert answer["outputs"] == [{"name": "class", "datatype": "INT64", "shape": [2], "data": [2, 0]}]
    full = infer_response(DENSE, InferAsk(None, None), outs, model_version="3", parameters={})
    probs = full["outputs"][0]
    assert probs["shape"] == [2, 4] and len(probs["data"]) == 8 and isinstance(probs["data"][0], float)


def test_regression_answer_and_server_bugs() -> None:
    outs = model_outputs(IDS_ONLY, np.array([1.5, -2.0]))
    answer = infer_response(IDS_ONLY, InferAsk(None, None), outs, model_version="1", parameters={})
    assert answer["outputs"] == [{"name": "value", "datatype": "FP32", "shape": [2], "data": [1.5, -2.0]}]
    with pytest.raises(ValueError, match="expected"):
        model_outputs(IDS_ONLY, np.zeros((2, 2)))
    with pytest.raises(ValueError, match="expected"):
        model_outputs(DENSE, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="not computed"):
        infer_response(SIG, InferAsk(None, None), {"logit": np.zeros(2)}, model_version="1", parameters={})
    with pytest.raises(ValueError, match="shape"):
        infer_response(DENSE, InferAsk(None, None), {"probabilities": np.zeros((2, 3)), "class": np.zeros(2)},
                       model_version="1", parameters={})


def test_metadata() -> None:
    meta = model_metadata(SIG, versions=["12"])
    assert meta == {
        "name": "ctr", "versions": ["12"], "platform": PLATFORM,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]},
                   {"name": "user", "datatype": "INT64", "shape": [-1]},
                   {"name": "user.lengths", "datatype": "INT64", "shape": [-1]},
                   {"name": "item", "datatype": "INT64", "shape": [-1]},
                   {"name": "item.lengths", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "probability", "datatype": "FP32", "shape": [-1]},
                    {"name": "logit", "datatype": "FP32", "shape": [-1]}]}
    assert [i["name"] for i in model_metadata(IDS_ONLY, versions=[])["inputs"]] == ["user", "user.lengths"]
    assert model_metadata(DENSE, versions=[])["outputs"] == [
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 4]},
        {"name": "class", "datatype": "INT64", "shape": [-1]}]


def test_metadata_inputs_parse_back() -> None:
    """A request built from the metadata, as a tritonclient user would, is accepted."""
    inputs = []
    for spec in model_metadata(SIG, versions=["1"])["inputs"]:
        shape = [2 if s == -1 else s for s in spec["shape"]]
        inputs.append({**spec, "shape": shape, "data": [1] * math.prod(shape)})
    batch, _ = parse_infer(_body(inputs), SIG)
    assert batch.ids["user"].to_lists() == [[1], [1]]


# --- /v1/predict ----------------------------------------------------------------------------------


def test_records_hash_string_ids_as_training_does() -> None:
    body = json.dumps({"records": [
        {"x": [1, 2, 3], "ids": {"user": ["paris", 7], "item": 5}, "y": 1},
        {"x": [4, 5.5, 6]},
        {"x": [0, 0, 0], "ids": {"user": []}},
    ]}).encode()
    batch = parse_records(body, SIG)
    assert batch.n == 3 and batch.x.dtype == np.float32 and batch.x.flags.c_contiguous
    np.testing.assert_array_equal(batch.x, [[1, 2, 3], [4, 5.5, 6], [0, 0, 0]])
    assert batch.ids["user"].to_lists() == [[hash_id("paris"), 7], [], []]
    assert hash_id("paris") == 1657316678316814225
    assert batch.ids["item"].to_lists() == [[5], [], []]


def test_records_as_a_bare_list_and_ids_only() -> None:
    batch = parse_records(b'[{"ids": {"user": [1, 2]}}, {"x": [], "ids": {"user": "a"}}]', IDS_ONLY)
    assert batch.n == 2 and batch.x.shape == (2, 0)
    assert batch.ids["user"].to_lists() == [[1, 2], [hash_id("a")]]
    assert list(parse_records(b'[{"x": [1, 2]}]', DENSE).ids) == []


@pytest.mark.parametrize(("body", "code", "named"), [
    (b"nope", "bad_json", "JSON"),
    (b'{"rows": []}', "bad_schema", "records"),
    (b'{"records": [], "extra": 1}', "bad_schema", "records"),
    (b'{"records": []}', "no_records", "no records"),
    (json.dumps([{"x": [0, 0, 0]}] * 9).encode(), "too_many_records", "9"),
    (b'[{"x": [1, 2, 3], "label": 1}]', "bad_schema", "record 0"),
    (b'[{"x": [1, 2, 3]}, 5]', "bad_schema", "record 1"),
    (b'[{"ids": {"user": 1}}]', "missing_input", "record 0"),
    (b'[{"x": [1, 2]}]', "wrong_shape", "record 0"),
    (b'[{"x": "1 2 3"}]', "wrong_shape", "record 0"),
    (b'[{"x": [1, "2", 3]}]', "wrong_datatype", "x"),
    (b'[{"x": [1, false, 3]}]', "wrong_datatype", "x"),
    (b'[{"x": [1, NaN, 3]}]', "non_finite", "x"),
    (b'[{"x": [1, 1e39, 3]}]', "non_finite", "x"),
    (b'[{"x": [1, 2, 3], "ids": {"age": [1]}}]', "unknown_feature", "'age'"),
    (b'[{"x": [1, 2, 3], "ids": {"user": [1.5]}}]', "bad_ids", "'user'"),
    (b'[{"x": [1, 2, 3], "ids": {"user": [true]}}]', "bad_ids", "'user'"),
    (b'[{"x": [1, 2, 3], "ids": {"user": [9223372036854775808]}}]', "bad_ids", "'user'"),
    (b'[{"x": [1, 2, 3], "ids": [1]}]', "bad_ids", "record 0"),
    (json.dumps([{"x": [1, 2, 3], "ids": {"user": list(range(MAX_IDS_PER_FEATURE + 1))}}]).encode(),
     "too_many_ids", "'user'"),
])
def test_record_refusals(body: bytes, code: str, named: str) -> None:
    exc = _refused(body, parse=parse_records)
    assert exc.code == code, exc
    assert named in str(exc)
    assert not str(exc).startswith(code + ":")


def test_unknown_feature_lists_the_known_ones() -> None:
    exc = _refused(b'[{"x": [1, 2, 3], "ids": {"age": [1], "user": [2]}}]', parse=parse_records)
    assert "'user'" not in str(exc).split(";")[0] and "user, item" in str(exc)


# --- what tritonclient sends and reads ------------------------------------------------------------


def test_tritonclient_requests_and_answers_round_trip() -> None:
    http = pytest.importorskip("tritonclient.http")
    x = http.InferInput("x", [2, 3], "FP32")
    x.set_data_from_numpy(np.array([[1, 2, 3], [4, 5, 6]], np.float32), binary_data=False)
    user = http.InferInput("user", [3], "INT64")
    user.set_data_from_numpy(np.array([10, 11, 12], np.int64), binary_data=False)
    lengths = http.InferInput("user.lengths", [2], "INT32")
    lengths.set_data_from_numpy(np.array([0, 3], np.int32), binary_data=False)
    body, _ = http.InferenceServerClient.generate_request_body(
        [x, user, lengths], outputs=[http.InferRequestedOutput("probability")], request_id="r9")
    batch, ask = parse_infer(body, SIG)
    assert batch.ids["user"].to_lists() == [[], [10, 11, 12]] and batch.ids["item"] == Jagged.empty(2)
    assert ask.id == "r9" and ask.outputs == ("probability",)
    answer = infer_response(SIG, ask, model_outputs(SIG, np.array([0.0, 2.0])), model_version="4", parameters={})
    result = http.InferResult.from_response_body(json.dumps(answer).encode())
    np.testing.assert_allclose(result.as_numpy("probability"), [0.5, 1 / (1 + math.exp(-2))], rtol=1e-6)
    assert result.as_numpy("logit") is None and result.get_response()["id"] == "r9"


def test_tritonclient_binary_tensors_are_refused_with_a_hint() -> None:
    http = pytest.importorskip("tritonclient.http")
    x = http.InferInput("x", [1, 3], "FP32")
    x.set_data_from_numpy(np.ones((1, 3), np.float32))  # binary_data=True, tritonclient's default
    body, _ = http.InferenceServerClient.generate_request_body([x])
    exc = _refused(body)
    assert exc.code == "binary_data" and "binary_data=False" in str(exc)
