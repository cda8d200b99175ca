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


def _x(data: Any, shape: Any, datatype: str = "FP32") -> dict[str, Any]:
    return {"name": "x", "shape": shape, "datatype": datatype, "data": data}


def _feature(name: str, values: list[Any], lengths: list[Any], datatype: str = "INT64",
             lengths_datatype: str = "INT64") -> list[dict[str, Any]]:
    return [{"name": name, "shape": [len(values)], "datatype": datatype, "data": values},
            {"name": name + ".lengths", "shape": [len(lengths)], "datatype": lengths_datatype, "data": lengths}]


def _refused(body: bytes, sig: Signature = SIG, *, parse: Any = parse_infer, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(body, sig, **kwargs)
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
    records: list[dict[str, Any]] = [{"x": [1, 2, 3], "ids": {"user": [1, 2], "item": [3]}},
                                     {"x": [4, 5, 6], "ids": {"item": []}}, {"x": [7, 8, 9], "ids": {"user": [4]}}]
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
    (_body([{**_x(None, [1, 3]), "parameters": {"binary_data_size": 12}}]), "bad_header_length", "'x'"),
    (_body([{**_x(None, [1, 3]), "parameters": {"binary_data_size": 12}}]) + b"\x00" * 12, "bad_header_length",
     "Inference-Header-Content-Length"),
    (_body([{**_x([1, 2, 3], [1, 3]), "parameters": "binary"}]), "bad_request", "'x'"),
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


def _json_answer(sig: Signature, ask: InferAsk, outs: dict[str, np.ndarray], **kwargs: Any) -> dict[str, Any]:
    body, headers = infer_response(sig, ask, outs, **kwargs)
    assert headers == {"Content-Type": "application/json"}
    answer: dict[str, Any] = json.loads(body)
    return answer


def test_binary_answer_round_trip() -> None:
    outs = model_outputs(SIG, np.array([[0.0], [1000.0], [-1000.0]], np.float32))
    np.testing.assert_allclose(outs["probability"], [0.5, 1.0, 0.0], atol=1e-7)
    answer = _json_answer(SIG, InferAsk("r1", None), outs, model_version="12.7", parameters={"lag_ms": 3})
    assert answer["model_name"] == "ctr" and answer["model_version"] == "12.7" and answer["id"] == "r1"
    assert answer["parameters"] == {"lag_ms": 3}
    assert [(o["name"], o["datatype"], o["shape"]) for o in answer["outputs"]] == [
        ("probability", "FP32", [3]), ("logit", "FP32", [3])]
    assert answer["outputs"][1]["data"] == [0.0, 1000.0, -1000.0]


def test_classes_answer_with_asked_outputs_only() -> None:
    logits = np.array([[1, 2, 3, 0], [5, 1, 1, 1]], np.float32)
    outs = model_outputs(DENSE, logits)
    np.testing.assert_allclose(outs["probabilities"].sum(axis=1), 1, rtol=1e-6)
    answer = _json_answer(DENSE, InferAsk(None, ("class",)), outs, model_version="3", parameters={})
    assert "id" not in answer
    assert answer["outputs"] == [{"name": "class", "datatype": "INT64", "shape": [2], "data": [2, 0]}]
    full = _json_answer(DENSE, InferAsk(None, None), outs, model_version="3", parameters={})
    probs = full["outputs"][0]
    assert probs["shape"] == [2, 4] and len(probs["data"]) == 8 and isinstance(probs["data"][0], float)


def test_regression_answer_and_server_bugs() -> None:
    outs = model_outputs(IDS_ONLY, np.array([1.5, -2.0]))
    answer = _json_answer(IDS_ONLY, InferAsk(None, None), outs, model_version="1", parameters={})
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
    body, json_size = http.InferenceServerClient.generate_request_body(
        [x, user, lengths], outputs=[http.InferRequestedOutput("probability", binary_data=False)], request_id="r9")
    assert json_size is None
    batch, ask = parse_infer(body, SIG)
    assert batch.ids["user"].to_lists() == [[], [10, 11, 12]] and batch.ids["item"] == Jagged.empty(2)
    assert ask.id == "r9" and ask.outputs == ("probability",)
    answer, headers = infer_response(SIG, ask, model_outputs(SIG, np.array([0.0, 2.0])), model_version="4",
                                     parameters={})
    assert "Inference-Header-Content-Length" not in headers
    result = http.InferResult.from_response_body(answer)
    np.testing.assert_allclose(result.as_numpy("probability"), [0.5, 1 / (1 + math.exp(-2))], rtol=1e-6)
    assert result.as_numpy("logit") is None and result.get_response()["id"] == "r9"


# --- the binary tensor data extension -------------------------------------------------------------

_HEADER = "Inference-Header-Content-Length"
_RECORDS: dict[str, np.ndarray] = {
    "x": np.array([[1, 2, 3], [4.5, -5, 6]], np.float32), "user": np.array([10, -(1 << 62), 12], np.int64),
    "user.lengths": np.array([1, 2], np.int32), "item": np.array([7], np.int64),
    "item.lengths": np.array([0, 1], np.int64)}


def _triton_inputs(binary: Any, data: dict[str, np.ndarray] = _RECORDS) -> list[Any]:
    """tritonclient's InferInputs of ``data``; ``binary(name)`` says which go as binary tensor data."""
    http = pytest.importorskip("tritonclient.http")
    np_to_triton_dtype = pytest.importorskip("tritonclient.utils").np_to_triton_dtype
    inputs = []
    for name, arr in data.items():
        one = http.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inputs.append(one.set_data_from_numpy(arr, binary_data=binary(name)))
    return inputs


def _assert_same(a: Any, b: Any) -> None:
    assert a.n == b.n and a.labels is None and b.labels is None
    assert a.x.dtype == b.x.dtype == np.float32 and a.x.flags.c_contiguous and b.x.flags.c_contiguous
    np.testing.assert_array_equal(a.x, b.x)
    assert a.ids == b.ids


def test_tritonclient_binary_inputs_parse_as_their_json_form() -> None:
    http = pytest.importorskip("tritonclient.http")
    json_body, none = http.InferenceServerClient.generate_request_body(_triton_inputs(lambda name: False))
    assert none is None
    from_json, json_ask = parse_infer(json_body, SIG)
    for binary in (lambda name: True, lambda name: name in ("x", "user.lengths"), lambda name: name == "item"):
        body, json_size = http.InferenceServerClient.generate_request_body(_triton_inputs(binary))  # tritonclient's
        assert json_size is not None and json_size < len(body)
        for header_length in (json_size, str(json_size), f" {json_size} "):
            batch, ask = parse_infer(body, SIG, header_length=header_length)
            _assert_same(batch, from_json)
            assert ask == json_ask  # no outputs named: binary_data_output, all outputs binary
            assert ask.outputs is None and ask.binary == {"probability", "logit"}
    assert from_json.ids["user"].to_lists() == [[10], [-(1 << 62), 12]]
    assert from_json.ids["item"].to_lists() == [[], [7]]


def test_binary_inputs_of_every_datatype() -> None:
    http = pytest.importorskip("tritonclient.http")
    for dtype in (np.float16, np.float64, np.int8, np.int32, np.uint8, np.uint64):
        x = np.array([[0, 1], [2, 3]], dtype)
        body, json_size = http.InferenceServerClient.generate_request_body(
            _triton_inputs(lambda name: True, {"x": x}), outputs=[http.InferRequestedOutput("class")])
        batch, ask = parse_infer(body, DENSE, header_length=json_size)
        assert batch.x.dtype == np.float32 and batch.x.flags.writeable
        np.testing.assert_array_equal(batch.x, x.astype(np.float32))
        assert ask.outputs == ("class",) and ask.binary == {"class"}


def test_binary_ids_only_and_many_records() -> None:
    rng = np.random.default_rng(1)
    lists = [rng.integers(-(1 << 62), 1 << 62, int(k)).tolist() for k in rng.integers(0, 5, 4096)]
    data: dict[str, np.ndarray] = {"user": np.array([v for r in lists for v in r], np.int64),
            "user.lengths": np.array([len(r) for r in lists], np.int32)}
    http = pytest.importorskip("tritonclient.http")
    body, json_size = http.InferenceServerClient.generate_request_body(_triton_inputs(lambda name: True, data))
    batch, _ = parse_infer(body, IDS_ONLY, header_length=json_size)
    assert batch.n == 4096 and batch.ids["user"] == Jagged.from_lists(lists)


def test_a_header_length_of_the_whole_body_is_all_json() -> None:
    body = _body([_x([1, 2, 3], [1, 3]), {"name": "user", "shape": [0], "datatype": "INT64",
                                          "parameters": {"binary_data_size": 0}}, _feature("user", [], [0])[1]])
    for header_length in (None, len(body)):
        batch, _ = parse_infer(body, SIG, header_length=header_length)
        assert batch.ids["user"] == Jagged.empty(1)


def _binary_body(inputs: list[tuple[dict[str, Any], bytes]], **extra: Any) -> tuple[bytes, int]:
    head = _body([spec for spec, _ in inputs], **extra)
    return head + b"".join(data for _, data in inputs), len(head)


def _binary_x(arr: np.ndarray, datatype: str = "FP32", size: Any = None,
              shape: list[int] | None = None) -> tuple[dict[str, Any], bytes]:
    data = arr.tobytes()
    return ({"name": "x", "shape": list(arr.shape) if shape is None else shape, "datatype": datatype,
             "parameters": {"binary_data_size": len(data) if size is None else size}}, data)


def _binary_ints(name: str, values: list[int], datatype: str = "INT64") -> tuple[dict[str, Any], bytes]:
    data = np.array(values, {"INT64": np.int64, "INT32": np.int32}[datatype]).tobytes()
    return {"name": name, "shape": [len(values)], "datatype": datatype,
            "parameters": {"binary_data_size": len(data)}}, data


def _json_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    return spec, b""


ROW = np.array([[1, 2, 3]], np.float32)


def test_handmade_binary_requests_mix_json_and_binary() -> None:
    body, k = _binary_body([_binary_x(ROW), _json_spec(_feature("user", [4, 5], [2])[0]),
                            _binary_ints("user.lengths", [2], "INT32"), _binary_ints("item", [-1]),
                            _json_spec(_feature("item", [], [1])[1])])
    batch, _ = parse_infer(body, SIG, header_length=k)
    np.testing.assert_array_equal(batch.x, ROW)
    assert batch.ids["user"].to_lists() == [[4, 5]] and batch.ids["item"].to_lists() == [[-1]]


@pytest.mark.parametrize(("inputs", "code", "named"), [
    ([_binary_x(ROW[:, :2], shape=[1, 3])], "bad_binary_data", "'x'"),  # 8 bytes declared and sent; [1, 3] FP32: 12
    ([_binary_x(ROW, "FP64")], "bad_binary_data", "'x'"),
    ([_binary_x(ROW, shape=[2, 3])], "bad_binary_data", "'x'"),
    ([_binary_x(ROW, "BYTES")], "wrong_datatype", "'x'"),
    ([_binary_x(ROW, size=-1)], "bad_binary_data", "'x'"),
    ([_binary_x(ROW, size=True)], "bad_binary_data", "'x'"),
    ([_binary_x(ROW, size="12")], "bad_binary_data", "'x'"),
    ([({**_binary_x(ROW)[0], "data": [1, 2, 3]}, ROW.tobytes())], "bad_binary_data", "'x'"),
    ([_binary_x(np.array([[1, np.nan, 3]], np.float32))], "non_finite", "'x'"),
    ([_binary_x(np.array([[1, 1e300, 3]]), "FP64")], "non_finite", "'x'"),
    ([_binary_x(ROW), _binary_ints("user", [1, 2]), _binary_ints("user.lengths", [3])], "bad_lengths",
     "'user.lengths'"),
    ([_binary_x(ROW), _binary_ints("user", []), _binary_ints("user.lengths", [-1], "INT32")], "bad_lengths",
     "'user.lengths'"),
    ([_binary_x(ROW), _binary_ints("user", [1]), _json_spec(_feature("user", [1], [1.0])[1])], "wrong_datatype",
     "'user.lengths'"),
    ([_binary_x(ROW), _binary_ints("user", [1]),
      _json_spec(_feature("user", [1], [1 << 40], lengths_datatype="INT32")[1])], "bad_lengths", "'user.lengths'"),
    ([_binary_x(ROW), _json_spec(_feature("user", [1 << 63], [1])[0]), _binary_ints("user.lengths", [1])],
     "bad_ids", "'user'"),
    ([_binary_x(ROW), _binary_ints("user", list(range(MAX_IDS_PER_FEATURE + 1))),
      _binary_ints("user.lengths", [MAX_IDS_PER_FEATURE + 1])], "too_many_ids", "'user.lengths'"),
    ([_binary_x(ROW), _binary_ints("user", [1]), ({**_binary_ints("user.lengths", [1])[0], "datatype": "FP32"},
                                                  _binary_ints("user.lengths", [1])[1])], "wrong_datatype",
     "'user.lengths'"),
])
def test_binary_refusals_name_the_input(inputs: list[tuple[dict[str, Any], bytes]], code: str, named: str) -> None:
    body, k = _binary_body(inputs)
    exc = _refused(body, header_length=k)
    assert exc.code == code, exc
    assert named in str(exc)


def test_truncated_and_overlong_bodies() -> None:
    body, k = _binary_body([_binary_x(ROW), _binary_ints("user", [1, 2]), _binary_ints("user.lengths", [2])])
    truncated = _refused(body[:-1], header_length=k)
    assert truncated.code == "bad_binary_data" and "'user.lengths'" in str(truncated) and "7 bytes" in str(truncated)
    cut = _refused(body[:k + 20], header_length=k)
    assert cut.code == "bad_binary_data" and "'user'" in str(cut)
    overlong = _refused(body + b"\0", header_length=k)
    assert overlong.code == "bad_binary_data" and "1 bytes" in str(overlong)


@pytest.mark.parametrize("header_length", ["", "abc", "-1", "0", "1e3", "12.0", "١٢", "9" * 30, 0, -5, 1.5, True,
                                           None])
def test_bad_header_lengths(header_length: Any) -> None:
    body, _ = _binary_body([_binary_x(ROW)])
    exc = _refused(body, header_length=header_length)
    assert exc.code == "bad_header_length", exc
    assert "Inference-Header-Content-Length" in str(exc)


def test_a_header_length_beyond_the_body_is_refused() -> None:
    body, _ = _binary_body([_binary_x(ROW)])
    for beyond in (len(body) + 1, str(len(body) + 1)):
        exc = _refused(body, header_length=beyond)
        assert exc.code == "bad_header_length" and str(len(body)) in str(exc)


def test_a_wrong_header_length_cuts_the_json() -> None:
    body, k = _binary_body([_binary_x(ROW)])
    for wrong in (k - 1, k + 1, len(body)):  # JSON cut short, or followed by tensor bytes
        exc = _refused(body, header_length=wrong)
        assert exc.code == "bad_json" and f"first {wrong} bytes" in str(exc)


@pytest.mark.parametrize(("extra", "outputs", "binary"), [
    ({}, None, set()),
    ({"parameters": {"binary_data_output": True}}, None, {"probability", "logit"}),
    ({"parameters": {"binary_data_output": False}}, None, set()),
    ({}, [{"name": "logit", "parameters": {"binary_data": True}}, {"name": "probability"}], {"logit"}),
    ({"parameters": {"binary_data_output": True}},
     [{"name": "logit", "parameters": {"binary_data": False}}, {"name": "probability"}], {"probability"}),
    ({"parameters": {"binary_data_output": True}}, [], {"probability", "logit"}),
    ({}, [{"name": "logit", "parameters": {"binary_data": True}}, {"name": "logit"}], {"logit"}),
])
def test_which_outputs_are_binary(extra: dict[str, Any], outputs: Any, binary: set[str]) -> None:
    if outputs is not None:
        extra = {**extra, "outputs": outputs}
    _, ask = parse_infer(_body([_x([1, 2, 3], [1, 3])], **extra), SIG)
    assert ask.binary == binary


@pytest.mark.parametrize(("extra", "named"), [
    ({"parameters": {"binary_data_output": 1}}, "'binary_data_output'"),
    ({"outputs": [{"name": "logit", "parameters": {"binary_data": "yes"}}]}, "'binary_data'"),
    ({"outputs": [{"name": "logit", "parameters": []}]}, "output 'logit': parameters"),
])
def test_bad_binary_output_asks(extra: dict[str, Any], named: str) -> None:
    exc = _refused(_body([_x([1, 2, 3], [1, 3])], **extra))
    assert exc.code == "bad_request" and named in str(exc)


def test_binary_answers_decode_with_tritonclient() -> None:
    http = pytest.importorskip("tritonclient.http")
    outs = model_outputs(DENSE, np.array([[1, 2, 3, 0], [5, 1, 1, 1], [0, 0, 9, 0]], np.float32))
    for binary in ({"probabilities", "class"}, {"class"}, {"probabilities"}):
        ask = InferAsk("r2", None, {}, frozenset(binary))
        body, headers = infer_response(DENSE, ask, outs, model_version="5", parameters={"misses": 0})
        assert headers["Content-Type"] == "application/octet-stream"
        k = int(headers[_HEADER])
        header = json.loads(body[:k])
        assert header["id"] == "r2" and header["model_version"] == "5" and header["parameters"] == {"misses": 0}
        sizes = {"probabilities": 3 * 4 * 4, "class": 3 * 8}
        for tensor in header["outputs"]:
            if tensor["name"] in binary:
                assert tensor["parameters"] == {"binary_data_size": sizes[tensor["name"]]} and "data" not in tensor
            else:
                assert "parameters" not in tensor and len(tensor["data"]) == np.prod(tensor["shape"])
        assert len(body) == k + sum(sizes[name] for name in binary)
        result = http.InferResult.from_response_body(body, header_length=k)
        np.testing.assert_array_equal(result.as_numpy("probabilities"), outs["probabilities"])
        np.testing.assert_array_equal(result.as_numpy("class"), [2, 0, 2])
        assert result.as_numpy("class").dtype == np.int64


def test_tritonclient_binary_round_trip() -> None:
    """tritonclient's defaults end to end: binary inputs, binary outputs asked by name."""
    http = pytest.importorskip("tritonclient.http")
    body, json_size = http.InferenceServerClient.generate_request_body(
        _triton_inputs(lambda name: True), outputs=[http.InferRequestedOutput("logit")], request_id="b1")
    _, ask = parse_infer(body, SIG, header_length=str(json_size))
    assert ask == InferAsk("b1", ("logit",), {}, frozenset({"logit"}))
    logits = np.array([0.25, -3.5], np.float32)
    answer, headers = infer_response(SIG, ask, model_outputs(SIG, logits), model_version="7", parameters={})
    result = http.InferResult.from_response_body(answer, header_length=int(headers[_HEADER]))
    np.testing.assert_array_equal(result.as_numpy("logit"), logits)
    assert result.as_numpy("probability") is None and result.get_response()["id"] == "b1"
    # no outputs named: tritonclient asks binary_data_output, and every output comes back binary
    body, json_size = http.InferenceServerClient.generate_request_body(_triton_inputs(lambda name: False))
    _, ask = parse_infer(body, SIG, header_length=json_size)
    answer, headers = infer_response(SIG, ask, model_outputs(SIG, logits), model_version="7", parameters={})
    result = http.InferResult.from_response_body(answer, header_length=int(headers[_HEADER]))
    np.testing.assert_allclose(result.as_numpy("probability"), 1 / (1 + np.exp(-logits)), rtol=1e-6)


def test_a_nan_output_goes_out_in_both_forms() -> None:
    outs = {"value": np.array([np.nan, 1.0], np.float32)}
    body, _ = infer_response(IDS_ONLY, InferAsk(None, None), outs, model_version="1", parameters={})
    assert b"NaN" in body
    body, headers = infer_response(IDS_ONLY, InferAsk(None, None, {}, frozenset({"value"})), outs,
                                   model_version="1", parameters={})
    values = np.frombuffer(body[int(headers[_HEADER]):], "<f4")
    assert np.isnan(values[0]) and values[1] == 1.0


# --- labels on /v1/predict ------------------------------------------------------------------------


def test_records_carry_labels() -> None:
    batch = parse_records(b'[{"x": [1, 2, 3], "y": 1}, {"x": [4, 5, 6]}, {"x": [0, 0, 0], "y": 0.0}]', SIG)
    assert batch.labels is not None and batch.labels.dtype == np.float64 and batch.labels.shape == (3,)
    np.testing.assert_array_equal(batch.labels, [1.0, np.nan, 0.0])
    assert parse_records(b'[{"x": [1, 2, 3]}, {"x": [4, 5, 6]}]', SIG).labels is None
    only_ids = parse_records(b'[{"ids": {"user": 1}, "y": 2.5}]', IDS_ONLY)
    assert only_ids.labels is not None and only_ids.labels.tolist() == [2.5]
    assert parse_records(b'[{"x": [1, 2]}]', DENSE).labels is None
    assert parse_infer(_body([_x([1, 2, 3], [1, 3])]), SIG)[0].labels is None


@pytest.mark.parametrize(("y", "code"), [
    (b'"1"', "wrong_datatype"), (b"true", "wrong_datatype"), (b"null", "wrong_datatype"), (b"[1]", "wrong_datatype"),
    (b"NaN", "non_finite"), (b"-Infinity", "non_finite"), (b"1e400", "non_finite"), (b"1" + b"0" * 400, "non_finite"),
])
def test_bad_labels_are_refused(y: bytes, code: str) -> None:
    exc = _refused(b'[{"x": [1, 2, 3], "y": 1}, {"x": [1, 2, 3], "y": ' + y + b"}]", parse=parse_records)
    assert exc.code == code and "record 1" in str(exc) and "y" in str(exc)
