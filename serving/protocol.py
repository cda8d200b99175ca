"""The replica's wire formats as pure functions: requests in, model inputs out; model outputs in, answers out.

Two routes feed a model that takes dense features ``x`` float32 ``[n, d]`` and, per categorical
feature, ragged IDs:

- ``POST /v2/models/<job>/infer``, the Open Inference Protocol (KServe v2 REST; JSON tensors or
  the binary tensor data extension, tritonclient's default): :func:`parse_infer` reads the request,
  :func:`infer_response` writes the answer (body and headers) and
  :func:`model_metadata` answers ``GET /v2/models/<job>``. Inputs are ``x`` ``[n, d]`` and, per
  feature ``f``, ``f`` (INT64 ``[nnz]``, the IDs of all records one after the other) with
  ``f.lengths`` (``[n]``, IDs per record): TorchRec's ``KeyedJaggedTensor`` layout.
- ``POST /v1/predict``, for curl: :func:`parse_records` reads records in the training topic's own
  JSON form, string IDs hashed exactly as training hashes them (:func:`datastream.records.hash_id`).

Every problem with a request is a :class:`ProtocolError` (HTTP 400) whose ``code`` says what kind and
whose message names the input; :func:`error_body` is its answer. No I/O here, no torch: the server
shell parses with these, runs the model and serialises the dicts. See docs/serving.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import Any

import numpy as np

from datastream.jagged import Jagged
from datastream.records import FEATURE_NAME, MAX_ID_FEATURES, MAX_IDS_PER_FEATURE, DecodeError, parse_ids

__all__ = [
    # what a model takes and gives
    "KINDS", "PLATFORM", "Signature", "output_names",
    # parsed requests
    "Batch", "InferAsk", "join_batches",
    # routes
    "parse_infer", "infer_response", "model_metadata", "model_outputs", "parse_records",
    # errors
    "CODES", "ProtocolError", "error_body",
]

KINDS = ("binary", "classes", "regression")
"""What a model predicts: one logit per record, logits of ``C`` classes, or one real value."""

PLATFORM = "pytorch_streamtrain"
"""The ``platform`` of :func:`model_metadata`."""

CODES = (
    "bad_json", "bad_request", "bad_header_length", "bad_binary_data", "unknown_input", "duplicate_input",
    "missing_input", "wrong_shape", "wrong_datatype", "non_finite", "bad_ids", "bad_lengths", "too_many_ids",
    "no_records", "too_many_records", "unknown_output", "unknown_feature", "bad_schema",
)
"""Why a request was refused (the ``code`` of :class:`ProtocolError`); ``bad_ids``, ``too_many_ids``,
``wrong_shape``, ``wrong_datatype`` and ``bad_schema`` mean what they mean in
:data:`datastream.records.REASONS`; ``bad_header_length`` and ``bad_binary_data`` are problems of the
binary tensor data extension (the ``Inference-Header-Content-Length`` header; an input's bytes)."""

_LENGTHS = ".lengths"
_FLOAT_TYPES = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
_INT_TYPES = {"INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
              "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64}
_X_TYPES = {**_FLOAT_TYPES, **_INT_TYPES}
_ID_TYPES = {"INT32": np.int32, "INT64": np.int64}
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_NUMBERS = frozenset({int, float})
_HEADER = "Inference-Header-Content-Length"
_INTS = frozenset({int})


class ProtocolError(ValueError):
    """A request the replica cannot answer (HTTP 400); ``str(exc)`` is the message, naming the input.

    Attributes:
        code: one of :data:`CODES`.
    """

    def __init__(self, code: str, message: str) -> None:
        if code not in CODES:
            raise ValueError(f"unknown protocol-error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Signature:
    """What the served model takes and gives; construction checks it (``ValueError`` naming the field)."""

    job: str
    """The model's name in the protocol (the job)."""
    dense: int
    """``d``, columns of ``x`` (0: the model takes no ``x``)."""
    features: tuple[str, ...]
    """Categorical features, each looked up in a table; may be empty."""
    kind: str
    """One of :data:`KINDS`."""
    classes: int = 0
    """``C`` for ``"classes"`` (at least 2); 0 otherwise."""
    max_records: int = 4096
    """Most records one request may hold."""

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not self.job:
            raise ValueError(f"job must be a non-empty string, got {self.job!r}")
        if type(self.dense) is not int or self.dense < 0:
            raise ValueError(f"dense must be an integer >= 0, got {self.dense!r}")
        if not isinstance(self.features, tuple) or len(self.features) > MAX_ID_FEATURES:
            raise ValueError(f"features must be a tuple of at most {MAX_ID_FEATURES} names, got {self.features!r}")
        for name in self.features:
            if not isinstance(name, str) or not FEATURE_NAME.fullmatch(name) or name == "x" \
                    or name.endswith(_LENGTHS):
                raise ValueError(f"feature name {name!r} is not 1-64 letters, digits, '_', '.' or '-', "
                                 f"or is 'x' or ends in {_LENGTHS!r}")
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"features repeat a name: {self.features}")
        if not self.dense and not self.features:
            raise ValueError("a model needs dense features (dense > 0), categorical features, or both")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "classes" and (type(self.classes) is not int or self.classes < 2):
            raise ValueError(f"a 'classes' model needs classes >= 2, got {self.classes!r}")
        if self.kind != "classes" and self.classes:
            raise ValueError(f"classes is for kind 'classes' only; kind {self.kind!r} has classes={self.classes}")
        if type(self.max_records) is not int or self.max_records < 1:
            raise ValueError(f"max_records must be an integer >= 1, got {self.max_records!r}")

    @cached_property
    def input_names(self) -> tuple[str, ...]:
        """Names of the OIP inputs: ``x`` (when ``dense``), then ``f`` and ``f.lengths`` per feature."""
        return (("x",) if self.dense else ()) + tuple(
            name for f in self.features for name in (f, f + _LENGTHS))

    @cached_property
    def _known(self) -> frozenset[str]:
        return frozenset(self.input_names)


@dataclass(frozen=True)
class Batch:
    """Model inputs of ``n`` records."""

    x: np.ndarray
    """float32 ``[n, dense]``, C-contiguous (``[n, 0]`` for a model without dense features)."""
    ids: dict[str, Jagged]
    """Every feature of the signature, in its order; a feature the request left out is ``Jagged.empty(n)``."""
    n: int
    """Number of records, at least 1."""
    labels: np.ndarray | None = None
    """float64 ``[n]``, the records' ``y`` (NaN for a record without one); ``None`` when no record has a
    ``y`` (always for an infer request)."""


def join_batches(batches: Sequence[Batch]) -> Batch:
    """The records of ``batches`` one after the other, as one batch (the features of the first; every
    batch of one signature has them all)."""
    n = sum(b.n for b in batches)
    labels = None
    if any(b.labels is not None for b in batches):
        labels = np.concatenate([b.labels if b.labels is not None else np.full(b.n, np.nan) for b in batches])
    return Batch(x=np.ascontiguousarray(np.concatenate([b.x for b in batches])),
                 ids={f: Jagged.concat([b.ids[f] for b in batches]) for f in batches[0].ids}, n=n, labels=labels)


@dataclass(frozen=True)
class InferAsk:
    """What an infer request asks of the answer besides the predictions."""

    id: str | None
    """The request's ``id``, echoed in the answer; ``None`` when it had none."""
    outputs: tuple[str, ...] | None
    """The outputs asked for, in the request's order; ``None``: all of :func:`output_names`."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """The request's ``parameters`` (unchecked but for ``binary_data_output``; empty when it had none)."""
    binary: frozenset[str] = frozenset()
    """The outputs to answer as binary tensor data: those asked with ``parameters: {"binary_data": true}``,
    or all (of those asked) when the request's ``parameters.binary_data_output`` is true and the output
    does not say ``"binary_data": false``."""


def output_names(sig: Signature) -> tuple[str, ...]:
    """The outputs a model of ``sig.kind`` gives, in the order answers list them."""
    return {"binary": ("probability", "logit"), "classes": ("probabilities", "class"),
            "regression": ("value",)}[sig.kind]


def _output_specs(sig: Signature) -> dict[str, tuple[str, list[int]]]:
    """Output name -> (datatype, shape with -1 for n)."""
    if sig.kind == "binary":
        return {"probability": ("FP32", [-1]), "logit": ("FP32", [-1])}
    if sig.kind == "classes":
        return {"probabilities": ("FP32", [-1, sig.classes]), "class": ("INT64", [-1])}
    return {"value": ("FP32", [-1])}


# --- OIP requests ----------------------------------------------------------------------------------


def _load(body: bytes, what: str = "the body") -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, an integer of too many digits, deep nesting
        raise ProtocolError("bad_json", f"{what} is not UTF-8 JSON: {str(exc)[:200]}") from None


def _header_length(value: int | str | None, size: int) -> int | None:
    """The checked ``Inference-Header-Content-Length`` of a body of ``size`` bytes (``None``: all JSON)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 20):
            raise ProtocolError("bad_header_length", f"{_HEADER} must be a byte count, got {value!r:.40}")
        value = int(text)
    elif type(value) is not int:
        raise ProtocolError("bad_header_length", f"{_HEADER} must be a byte count, got {type(value).__name__}")
    if not 0 < value <= size:
        raise ProtocolError("bad_header_length", f"{_HEADER} is {value}; the JSON header must be 1 to {size} bytes, "
                                                 f"the length of the body")
    return value


def _shape(name: str, spec: dict[str, Any]) -> list[int]:
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise ProtocolError("wrong_shape", f"input {name!r}: shape must be a list of sizes >= 0, got {shape!r:.100}")
    return shape


def _flat(name: str, data: Any, shape: list[int]) -> list[Any]:
    """``data`` as one row-major list of ``prod(shape)`` elements (their types checked by :func:`_check_types`).

    ``data`` is flat already (tritonclient's form), or nested lists whose lengths match ``shape``;
    flattening runs in C (``chain``), not per element in Python.
    """
    if not isinstance(data, list):
        raise ProtocolError("bad_request", f"input {name!r}: data must be a list, got {type(data).__name__}")
    items, depth = data, 0
    while items and type(items[0]) is list:
        if not shape or (depth == 0 and len(items) != shape[0]):
            raise ProtocolError("wrong_shape", f"input {name!r}: nested data of {len(items)} rows "
                                               f"does not match shape {shape}")
        if depth + 1 >= len(shape):
            raise ProtocolError("wrong_shape", f"input {name!r}: data nests deeper than shape {shape}")
        if any(type(row) is not list or len(row) != shape[depth + 1] for row in items):
            raise ProtocolError("wrong_shape", f"input {name!r}: nested data must hold lists of "
                                               f"{shape[depth + 1]} at depth {depth + 1} (shape {shape})")
        items, depth = list(chain.from_iterable(items)), depth + 1
    count = math.prod(shape)
    if len(items) != count:
        raise ProtocolError("wrong_shape", f"input {name!r}: data holds {len(items)} elements, "
                                           f"shape {shape} needs {count}")
    return items


def _from_bytes(name: str, datatype: str, raw: memoryview, shape: list[int], dtype: type) -> np.ndarray:
    """The flat, read-only array of an input's binary data: little-endian ``dtype``, ``prod(shape)`` elements."""
    little = np.dtype(dtype).newbyteorder("<")
    want = math.prod(shape) * little.itemsize
    if len(raw) != want:
        raise ProtocolError("bad_binary_data", f"input {name!r}: binary_data_size is {len(raw)} bytes; shape {shape} "
                                               f"of {datatype} is {want} bytes")
    return np.frombuffer(raw, dtype=little)


def _check_types(name: str, items: list[Any], allowed: frozenset[type]) -> None:
    """Refuse elements of ``items`` that are not of the ``allowed`` JSON types (``bool`` is not ``int``);
    ``map(type)`` runs in C."""
    kinds = set(map(type, items))
    if not kinds <= allowed:
        bad = sorted(t.__name__ for t in kinds - allowed)
        want = "integers" if allowed == _INTS else "numbers"
        raise ProtocolError("wrong_datatype", f"input {name!r}: data must hold only {want}, "
                                              f"found {', '.join(bad)}")


def _x(spec: dict[str, Any], shape: list[int], raw: memoryview | None) -> np.ndarray:
    datatype = spec["datatype"]
    if datatype not in _X_TYPES:
        raise ProtocolError("wrong_datatype", f"input 'x': datatype {datatype!r}; "
                                              f"allowed: {', '.join(_X_TYPES)}")
    is_int = datatype in _INT_TYPES
    if raw is not None:
        with np.errstate(over="ignore"):  # FP64 beyond float32 becomes inf: refused below
            x = _from_bytes("x", datatype, raw, shape, _X_TYPES[datatype]).astype(np.float32)
    else:
        items = _flat("x", spec.get("data"), shape)
        _check_types("x", items, _INTS if is_int else _NUMBERS)
        try:
            with np.errstate(over="ignore"):  # a float beyond float32 (or FP16) becomes inf: refused below
                if is_int:
                    x = np.array(items, dtype=_INT_TYPES[datatype]).astype(np.float32)
                else:
                    x = np.array(items, dtype=_FLOAT_TYPES[datatype]).astype(np.float32, copy=False)
        except OverflowError:
            raise ProtocolError("wrong_datatype" if is_int else "non_finite",
                                f"input 'x': a value does not fit {datatype}" if is_int
                                else "input 'x': a value does not fit float32") from None
    if not np.isfinite(x).all():
        raise ProtocolError("non_finite", "input 'x' holds NaN or infinity (or a value beyond float32)")
    return x.reshape(shape)


def _inputs(obj: dict[str, Any], sig: Signature, tail: memoryview,
            header_length: int | None) -> tuple[dict[str, dict[str, Any]], dict[str, memoryview]]:
    """The request's inputs by name, each checked to be a named, typed tensor of this model, and the
    binary data of those that carry ``parameters.binary_data_size``: consecutive slices of ``tail``, the
    body after the JSON header, in input order, covering all of it."""
    inputs = obj.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("bad_request", "the request needs 'inputs', a non-empty list of tensors")
    out: dict[str, dict[str, Any]] = {}
    raw: dict[str, memoryview] = {}
    offset = 0
    for spec in inputs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError("bad_request", f"an input must be an object with a 'name', got {spec!r:.100}")
        name = spec["name"]
        if name not in sig._known:
            raise ProtocolError("unknown_input", f"unknown input {name!r:.80}; model {sig.job!r} takes "
                                                 f"{', '.join(sig.input_names)}")
        if name in out:
            raise ProtocolError("duplicate_input", f"input {name!r} is given twice")
        params = spec.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ProtocolError("bad_request", f"input {name!r}: parameters must be an object, "
                                               f"got {type(params).__name__}")
        if not isinstance(spec.get("datatype"), str):
            raise ProtocolError("wrong_datatype", f"input {name!r} needs a 'datatype' string")
        size = params.get("binary_data_size") if params else None
        if size is not None:
            if type(size) is not int or size < 0:
                raise ProtocolError("bad_binary_data", f"input {name!r}: binary_data_size must be a byte count, "
                                                       f"got {size!r:.40}")
            if spec.get("data") is not None:
                raise ProtocolError("bad_binary_data", f"input {name!r} has both 'data' and binary_data_size")
            if offset + size > len(tail):
                if header_length is None:
                    raise ProtocolError("bad_header_length", f"input {name!r} has binary_data_size {size} but the "
                                                             f"request has no {_HEADER} header: the body is all JSON")
                raise ProtocolError("bad_binary_data", f"input {name!r}: binary_data_size {size} runs past the end "
                                                       f"of the body; {len(tail) - offset} bytes are left after the "
                                                       f"JSON header ({header_length} bytes) and the inputs before")
            raw[name] = tail[offset:offset + size]
            offset += size
        elif "data" not in spec:
            raise ProtocolError("bad_request", f"input {name!r} has no 'data'")
        out[name] = spec
    if offset != len(tail):
        raise ProtocolError("bad_binary_data", f"{len(tail) - offset} bytes follow the JSON header "
                                               f"({header_length} bytes, {_HEADER}) beyond the {offset} bytes "
                                               f"the inputs' binary_data_size declare")
    return out, raw


def _ask(obj: dict[str, Any], sig: Signature) -> InferAsk:
    rid, params, outputs = obj.get("id"), obj.get("parameters"), obj.get("outputs")
    params = {} if params is None else params
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("bad_request", f"the request 'id' must be a string, got {type(rid).__name__}")
    if not isinstance(params, dict):
        raise ProtocolError("bad_request", f"the request 'parameters' must be an object, "
                                           f"got {type(params).__name__}")
    default = params.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise ProtocolError("bad_request", f"the request parameter 'binary_data_output' must be true or false, "
                                           f"got {default!r:.40}")
    every = frozenset(output_names(sig)) if default else frozenset()
    if outputs is None:
        return InferAsk(rid, None, params, every)
    if not isinstance(outputs, list):
        raise ProtocolError("bad_request", f"'outputs' must be a list, got {type(outputs).__name__}")
    known = output_names(sig)
    names: dict[str, None] = {}
    binary: set[str] = set()
    for spec in outputs:
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str):
            raise ProtocolError("bad_request", f"an output must be an object with a 'name', got {spec!r:.100}")
        if name not in known:
            raise ProtocolError("unknown_output", f"unknown output {name!r:.80}; model {sig.job!r} gives "
                                                  f"{', '.join(known)}")
        out_params = spec.get("parameters")
        if out_params is not None and not isinstance(out_params, dict):
            raise ProtocolError("bad_request", f"output {name!r}: parameters must be an object, "
                                               f"got {type(out_params).__name__}")
        flag = (out_params or {}).get("binary_data", default)
        if not isinstance(flag, bool):
            raise ProtocolError("bad_request", f"output {name!r}: parameter 'binary_data' must be true or false, "
                                               f"got {flag!r:.40}")
        names[name] = None
        if flag:  # an output asked twice is binary when either asks so
            binary.add(name)
    if not names:  # an empty list asks for nothing in particular: all
        return InferAsk(rid, None, params, every)
    return InferAsk(rid, tuple(names), params, frozenset(binary))


def _records(n: int, what: str, sig: Signature) -> None:
    if n == 0:
        raise ProtocolError("no_records", f"{what} holds no records")
    if n > sig.max_records:
        raise ProtocolError("too_many_records", f"{what} holds {n} records; at most {sig.max_records} per request")


def parse_infer(body: bytes, sig: Signature, *,
                header_length: int | str | None = None) -> tuple[Batch, InferAsk]:
    """The model inputs and the asks of an OIP infer request (``POST /v2/models/<job>/infer``).

    Inputs (JSON tensors; ``data`` flat row-major or nested, ``len == prod(shape)``):
    ``x`` ``[n, dense]`` of FP32 (or FP16, FP64, INT*, UINT*: converted to float32), required when
    ``dense > 0``; per feature ``f`` of ``sig``, ``f`` INT64 or INT32 ``[nnz]`` with ``f.lengths``
    INT64 or INT32 ``[n]``, both or neither (neither: no IDs for any record). ``n`` is the same for
    all inputs, ``1 <= n <= sig.max_records``.

    The binary tensor data extension (Triton's; tritonclient's default): with ``header_length``, the
    request's ``Inference-Header-Content-Length`` (an int or the header's text), the body is that many
    bytes of JSON followed by the raw little-endian, row-major bytes of each input whose
    ``parameters.binary_data_size`` gives their count (instead of ``data``), in input order. JSON and
    binary inputs mix freely; ``header_length=None`` means the body is all JSON.

    Raises:
        ProtocolError: the request is not one this model answers; ``code`` says why, the message
            names the input.
    """
    k = _header_length(header_length, len(body))
    try:
        obj = _load(body if k is None else body[:k],
                    "the body" if k is None else f"the JSON header (the first {k} bytes, by {_HEADER})")
    except ProtocolError:
        if k is None and b'"binary_data_size"' in body:  # a JSON header, then tensor bytes, but no length
            raise ProtocolError("bad_header_length", f"the body is a JSON header followed by binary tensor data "
                                                     f"but the request has no {_HEADER} header") from None
        raise
    if not isinstance(obj, dict):
        raise ProtocolError("bad_json", f"the body must be a JSON object, got {type(obj).__name__}")
    inputs, raw = _inputs(obj, sig, memoryview(body)[len(body) if k is None else k:], k)
    ask = _ask(obj, sig)
    if sig.dense and "x" not in inputs:
        raise ProtocolError("missing_input", f"input 'x' (FP32 [n, {sig.dense}]) is missing")
    given = [f for f in sig.features if f in inputs or f + _LENGTHS in inputs]
    for f in given:
        if f not in inputs:
            raise ProtocolError("missing_input", f"input {f + _LENGTHS!r} is given without its IDs {f!r}")
        if f + _LENGTHS not in inputs:
            raise ProtocolError("missing_input", f"input {f!r} is given without its lengths {f + _LENGTHS!r}")
    if not sig.dense and not given:
        raise ProtocolError("missing_input", f"the request gives no feature; model {sig.job!r} takes "
                                             f"{', '.join(sig.input_names)}")

    # shapes first, so no data is converted for a request refused by its shapes
    n: int | None = None
    source = ""  # the input n was read from
    if sig.dense:
        shape = _shape("x", inputs["x"])
        if len(shape) != 2 or shape[1] != sig.dense:
            raise ProtocolError("wrong_shape", f"input 'x' has shape {shape}; model {sig.job!r} takes [n, {sig.dense}]")
        n, source = shape[0], "input 'x'"
    shapes = {}
    for f in given:
        values_shape, lengths_shape = _shape(f, inputs[f]), _shape(f + _LENGTHS, inputs[f + _LENGTHS])
        if len(values_shape) != 1:
            raise ProtocolError("wrong_shape", f"input {f!r} has shape {values_shape}; IDs are 1-D [nnz]")
        if len(lengths_shape) != 1:
            raise ProtocolError("wrong_shape", f"input {f + _LENGTHS!r} has shape {lengths_shape}; lengths are [n]")
        if n is None:
            n, source = lengths_shape[0], f"input {f + _LENGTHS!r}"
        elif lengths_shape[0] != n:
            raise ProtocolError("wrong_shape", f"input {f + _LENGTHS!r} has {lengths_shape[0]} records, "
                                               f"{source} has {n}")
        shapes[f] = values_shape, lengths_shape
    assert n is not None  # x or a feature is given, checked above
    _records(n, source, sig)

    x = _x(inputs["x"], inputs["x"]["shape"], raw.get("x")) if sig.dense else np.zeros((n, 0), np.float32)
    cols = _columns(inputs, raw, shapes, n)
    ids = {f: cols[f] if f in cols else Jagged.empty(n) for f in sig.features}
    return Batch(x=x, ids=ids, n=n), ask


def _id_items(name: str, spec: dict[str, Any], raw: dict[str, memoryview], shape: list[int],
              what: str) -> list[Any] | np.ndarray:
    """An ID or lengths input's elements: a list (JSON, types unchecked) or an array (binary)."""
    datatype = spec["datatype"]
    if datatype not in _ID_TYPES:
        raise ProtocolError("wrong_datatype", f"input {name!r}: datatype {datatype!r}; "
                                              f"{what} are {' or '.join(_ID_TYPES)}")
    if name in raw:
        return _from_bytes(name, datatype, raw[name], shape, _ID_TYPES[datatype])
    return _flat(name, spec.get("data"), shape)


def _check_int_inputs(names: list[str], items: list[list[Any]], joined: list[Any]) -> None:
    """Refuse non-integers: all inputs' elements (``joined``) at once, input by input only to name one."""
    if not set(map(type, joined)) <= _INTS:
        for name, its in zip(names, items):
            _check_types(name, its, _INTS)


def _int64(name: str, datatype: str, items: list[Any] | np.ndarray) -> np.ndarray:
    """One ID or lengths input as int64, checked (the path of requests with binary inputs)."""
    if isinstance(items, np.ndarray):
        return items.astype(np.int64)
    _check_types(name, items, _INTS)
    code = "bad_lengths" if name.endswith(_LENGTHS) else "bad_ids"
    if datatype == "INT32" and items and not _INT32_MIN <= min(items) <= max(items) <= _INT32_MAX:
        raise ProtocolError(code, f"input {name!r}: a value does not fit INT32")
    try:
        return np.array(items, dtype=np.int64)
    except OverflowError:
        raise ProtocolError(code, f"input {name!r}: a value does not fit INT64") from None


def _columns(inputs: dict[str, dict[str, Any]], raw: dict[str, memoryview],
             shapes: dict[str, tuple[list[int], list[int]]], n: int) -> dict[str, Jagged]:
    """The given features' IDs, checked and converted for all features at once (one array of all
    lengths, one of all IDs, one ``cumsum``): a request costs a few numpy calls, not a few per feature.
    Binary inputs arrive as arrays; a request with any converts input by input, then joins."""
    if not shapes:
        return {}
    names = list(shapes)
    lengths_names = [f + _LENGTHS for f in names]
    values_items = [_id_items(f, inputs[f], raw, shapes[f][0], "IDs") for f in names]
    lengths_items = [_id_items(name, inputs[name], raw, shapes[f][1], "lengths")
                     for f, name in zip(names, lengths_names)]
    values: np.ndarray | None = None
    if any(isinstance(items, np.ndarray) for items in chain(values_items, lengths_items)):
        lengths = np.stack([_int64(name, inputs[name]["datatype"], items)
                            for name, items in zip(lengths_names, lengths_items)])
        values = np.concatenate([_int64(f, inputs[f]["datatype"], items) for f, items in zip(names, values_items)])
        least, most = int(lengths.min()), int(lengths.max())
    else:
        json_lengths = [items for items in lengths_items if isinstance(items, list)]  # all of them, typed
        json_values = [items for items in values_items if isinstance(items, list)]
        all_lengths = list(chain.from_iterable(json_lengths))
        all_values = list(chain.from_iterable(json_values))
        _check_int_inputs(lengths_names, json_lengths, all_lengths)
        _check_int_inputs(names, json_values, all_values)
        for name, items in chain(zip(names, json_values), zip(lengths_names, json_lengths)):
            if inputs[name]["datatype"] == "INT32" and items and \
                    not _INT32_MIN <= min(items) <= max(items) <= _INT32_MAX:
                code = "bad_lengths" if name.endswith(_LENGTHS) else "bad_ids"
                raise ProtocolError(code, f"input {name!r}: a value does not fit INT32")
        try:
            lengths = np.array(all_lengths, dtype=np.int64).reshape(len(names), n)
        except OverflowError:
            raise ProtocolError("bad_lengths", "a lengths input holds a value beyond INT64") from None
        small = len(all_lengths) <= 64  # where Python's min and max beat numpy's call overhead
        least, most = (min(all_lengths), max(all_lengths)) if small else (int(lengths.min()), int(lengths.max()))
    if least < 0:
        i = int(lengths.min(axis=1).argmin())
        raise ProtocolError("bad_lengths", f"input {lengths_names[i]!r} holds a negative length")
    if most > MAX_IDS_PER_FEATURE:
        i = int(lengths.max(axis=1).argmax())
        raise ProtocolError("too_many_ids", f"input {lengths_names[i]!r}: record {int(lengths[i].argmax())} has "
                                            f"{int(lengths[i].max())} IDs of {names[i]!r}; "
                                            f"at most {MAX_IDS_PER_FEATURE}")
    offsets, totals = _offsets(lengths)
    counts = list(map(len, values_items))
    if totals != counts:
        i = next(i for i, (t, c) in enumerate(zip(totals, counts)) if t != c)
        raise ProtocolError("bad_lengths", f"input {lengths_names[i]!r} adds up to {totals[i]} IDs, "
                                           f"input {names[i]!r} holds {counts[i]}")
    if values is None:
        try:
            values = np.array(all_values, dtype=np.int64)
        except OverflowError:
            f = next(f for f, items in zip(names, json_values)
                     if items and not _INT64_MIN <= min(items) <= max(items) <= _INT64_MAX)
            raise ProtocolError("bad_ids", f"input {f!r}: an ID does not fit INT64") from None
    return _split(names, values, offsets, totals)


def _offsets(lengths: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Offsets ``[features, n + 1]`` of checked lengths ``[features, n]`` (row i: feature i's, from 0),
    and each feature's count of IDs."""
    offsets = np.zeros((lengths.shape[0], lengths.shape[1] + 1), np.int64)
    np.cumsum(lengths, axis=1, out=offsets[:, 1:])
    return offsets, offsets[:, -1].tolist()


def _split(names: list[str], values: np.ndarray, offsets: np.ndarray, totals: list[int]) -> dict[str, Jagged]:
    """One :class:`Jagged` per feature: views on the joined ``values`` and on the rows of ``offsets``."""
    out, lo = {}, 0
    for f, row, total in zip(names, offsets, totals):
        out[f] = Jagged(values[lo:lo + total], row)
        lo += total
    return out


# --- OIP answers ------------------------------------------------------------------------------------


def model_outputs(sig: Signature, raw: np.ndarray) -> dict[str, np.ndarray]:
    """All outputs of ``sig.kind`` from the model's raw output for ``n`` records.

    ``raw`` is the logits ``[n]`` or ``[n, 1]`` (binary), logits ``[n, C]`` (classes) or values
    ``[n]`` or ``[n, 1]`` (regression). Probabilities are computed without overflow for any logit.

    Raises:
        ValueError: ``raw`` has the wrong shape for the signature (a bug of the model, not the request).
    """
    raw = np.asarray(raw, dtype=np.float32)
    n = raw.shape[0] if raw.ndim else 0
    if sig.kind == "classes":
        if raw.shape != (n, sig.classes):
            raise ValueError(f"model {sig.job!r} gave output {raw.shape}; expected [n, {sig.classes}]")
        shifted = np.exp(raw - raw.max(axis=1, keepdims=True))
        return {"probabilities": shifted / shifted.sum(axis=1, keepdims=True),
                "class": raw.argmax(axis=1).astype(np.int64)}
    if raw.shape not in ((n,), (n, 1)):
        raise ValueError(f"model {sig.job!r} gave output {raw.shape}; expected [n] or [n, 1]")
    raw = raw.reshape(n)
    if sig.kind == "binary":  # sigmoid(z) = (1 + tanh(z / 2)) / 2: no exp to overflow
        return {"probability": (0.5 + 0.5 * np.tanh(0.5 * raw)).astype(np.float32), "logit": raw}
    return {"value": raw}


def infer_response(sig: Signature, ask: InferAsk, outputs: Mapping[str, np.ndarray], *,
                   model_version: str, parameters: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The OIP infer answer, as its body and the HTTP headers to send with it.

    The answer holds the asked outputs of ``outputs`` (name -> array, as :func:`model_outputs` gives
    them), with the request's ``id`` echoed when it had one. An output in ``ask.binary`` goes out as
    binary tensor data: its JSON tensor carries ``parameters: {"binary_data_size": bytes}`` instead of
    ``data``, and its raw little-endian, row-major bytes follow the JSON header, output after output.
    The headers are then ``Content-Type: application/octet-stream`` and
    ``Inference-Header-Content-Length`` (the JSON header's bytes); otherwise ``Content-Type:
    application/json`` and the body is all JSON, flat tensors in ``data``.

    A NaN of a broken model goes out as JSON's ``NaN`` token (Python's ``json`` writes it).

    Raises:
        ValueError: an asked output is missing or has the wrong shape (a bug of the server, not the request).
    """
    specs = _output_specs(sig)
    tensors = []
    chunks: list[bytes] = []
    for name in ask.outputs if ask.outputs is not None else output_names(sig):
        datatype, shape = specs[name]
        arr = outputs.get(name)
        if arr is None:
            raise ValueError(f"output {name!r} of model {sig.job!r} was not computed")
        arr = np.asarray(arr, dtype=np.float32 if datatype == "FP32" else np.int64)
        if arr.ndim != len(shape) or any(want != -1 and got != want for got, want in zip(arr.shape, shape)):
            raise ValueError(f"output {name!r} of model {sig.job!r} has shape {arr.shape}; expected {shape}")
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if name in ask.binary:
            data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
            tensor["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            tensor["data"] = arr.ravel().tolist()
        tensors.append(tensor)
    answer: dict[str, Any] = {"model_name": sig.job, "model_version": model_version}
    if ask.id is not None:
        answer["id"] = ask.id
    answer["parameters"] = parameters
    answer["outputs"] = tensors
    head = json.dumps(answer, separators=(",", ":")).encode()
    if not chunks:
        return head, {"Content-Type": "application/json"}
    return b"".join([head, *chunks]), {"Content-Type": "application/octet-stream", _HEADER: str(len(head))}


def model_metadata(sig: Signature, *, versions: list[str]) -> dict[str, Any]:
    """The OIP model metadata (``GET /v2/models/<job>``); ``-1`` marks a size that varies per request."""
    inputs = [{"name": "x", "datatype": "FP32", "shape": [-1, sig.dense]}] if sig.dense else []
    for f in sig.features:
        inputs.append({"name": f, "datatype": "INT64", "shape": [-1]})
        inputs.append({"name": f + _LENGTHS, "datatype": "INT64", "shape": [-1]})
    outputs = [{"name": name, "datatype": datatype, "shape": shape}
               for name, (datatype, shape) in _output_specs(sig).items()]
    return {"name": sig.job, "versions": list(versions), "platform": PLATFORM, "inputs": inputs, "outputs": outputs}


def error_body(exc: ProtocolError) -> dict[str, str]:
    """The answer to a refused request: OIP's ``{"error": message}`` with the ``code`` beside it."""
    return {"error": exc.message, "code": exc.code}


# --- /v1/predict ------------------------------------------------------------------------------------


def parse_records(body: bytes, sig: Signature) -> Batch:
    """The model inputs of ``POST /v1/predict``: ``{"records": [record, ...]}`` or a bare list of records.

    A record is the training topic's JSON record, ``{"x": [numbers], "ids": {feature: [ids]}, "y": label}``:
    ``x`` holds ``sig.dense`` numbers (left out or empty when ``dense == 0``), ``ids`` names features
    of ``sig`` only, an ID is an integer or a string hashed by :func:`datastream.records.hash_id` as
    training hashes it, a single ID stands for a list of one, and a feature left out has no IDs.
    ``y``, optional, is the record's label (0 or 1 for a binary model), a finite number: it fills
    :attr:`Batch.labels` (NaN for the records without one; ``None`` when none has one).

    Raises:
        ProtocolError: ``code`` says why; ID problems keep the reason of
            :func:`datastream.records.parse_ids` (``bad_ids``, ``too_many_ids``).
    """
    obj = _load(body)
    records = obj.get("records") if isinstance(obj, dict) else obj
    if not isinstance(records, list) or (isinstance(obj, dict) and set(obj) != {"records"}):
        raise ProtocolError("bad_schema", 'the body must be {"records": [record, ...]} or a list of records')
    n = len(records)
    _records(n, "the request", sig)
    xs: list[Any] = []
    cols: dict[str, list[list[int]]] = {f: [] for f in sig.features}
    empty: list[int] = []
    ys: list[float] = []
    labelled = False
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not set(rec) <= {"x", "ids", "y"}:
            shown = sorted(map(str, rec)) if isinstance(rec, dict) else type(rec).__name__
            raise ProtocolError("bad_schema", f"record {i} must be a map of x, ids and y; got {shown}")
        x = rec.get("x", [])
        if not isinstance(x, list) or len(x) != sig.dense:
            got = f"{len(x)} values" if isinstance(x, list) else type(x).__name__
            raise ProtocolError("missing_input" if "x" not in rec else "wrong_shape",
                                f"record {i}: x must be a list of {sig.dense} numbers; got {got}")
        xs.append(x)
        if "y" in rec:
            ys.append(_label(i, rec["y"]))
            labelled = True
        else:
            ys.append(math.nan)
        ids = _record_ids(i, rec["ids"], sig) if "ids" in rec else {}
        for f, col in cols.items():
            col.append(ids.get(f, empty))
    x_arr = np.zeros((n, 0), np.float32)
    if sig.dense:
        items = list(chain.from_iterable(xs))
        if not set(map(type, items)) <= _NUMBERS:
            raise ProtocolError("wrong_datatype", "x must hold only numbers")
        try:
            with np.errstate(over="ignore"):  # a float beyond float32 becomes inf: refused below
                x_arr = np.array(items, dtype=np.float32).reshape(n, sig.dense)
        except OverflowError:  # an integer beyond float
            raise ProtocolError("non_finite", "x holds a value beyond float32") from None
        if not np.isfinite(x_arr).all():
            raise ProtocolError("non_finite", "x holds NaN or infinity (or a value beyond float32)")
    labels = np.array(ys, np.float64) if labelled else None
    if not cols:
        return Batch(x=x_arr, ids={}, n=n, labels=labels)
    per_record = list(chain.from_iterable(cols.values()))  # feature after feature, record after record
    lengths = np.fromiter(map(len, per_record), np.int64, count=len(per_record)).reshape(len(cols), n)
    offsets, totals = _offsets(lengths)  # parse_ids bounded every length
    values = np.fromiter(chain.from_iterable(per_record), np.int64, count=sum(totals))
    return Batch(x=x_arr, ids=_split(list(cols), values, offsets, totals), n=n, labels=labels)


def _label(i: int, y: Any) -> float:
    if type(y) not in _NUMBERS:
        raise ProtocolError("wrong_datatype", f"record {i}: y must be a number, got {type(y).__name__}")
    try:
        label = float(y)
    except OverflowError:  # an integer beyond float
        raise ProtocolError("non_finite", f"record {i}: y is beyond float64") from None
    if not math.isfinite(label):
        raise ProtocolError("non_finite", f"record {i}: y is NaN or infinity")
    return label


def _record_ids(i: int, obj: Any, sig: Signature) -> dict[str, list[int]]:
    try:
        ids = parse_ids(obj)
    except DecodeError as exc:
        raise ProtocolError(exc.reason, f"record {i}: {str(exc).removeprefix(exc.reason + ': ')}") from None
    unknown = [f for f in ids if f not in sig.features]
    if unknown:
        known = ", ".join(sig.features) or "none"
        raise ProtocolError("unknown_feature", f"record {i} names unknown features {', '.join(map(repr, unknown))}; "
                                               f"model {sig.job!r} takes {known}")
    return ids
