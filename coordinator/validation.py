"""Strict validation of request bodies: unknown fields, wrong types and bad values are refused.

A schema maps each allowed field to a :class:`Field`; :func:`validate` returns the checked dict (an
integral number such as ``229.0`` as an ``int``) or raises :class:`InvalidBody` naming the first problem
by its JSON path. See docs/architecture.md, *The control plane: membership and assignment*.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .settings import CoordinatorSettings


class InvalidBody(ValueError):
    """The request body is malformed; the message names the problem."""


@dataclass(frozen=True)
class Field:
    """One allowed field of a JSON object."""

    kind: str
    """"str", "int" (an integral number: ``3`` or ``3.0``), "number", "bool", "object" (nested
    schema), "numbers" (list of numbers), "ints" (list of integers), "objects" (list of objects of the
    nested schema) or "counts" (an object of names matching :attr:`names` to integers)."""
    required: bool = False
    choices: Sequence[Any] | None = None
    min: float | None = None
    max: float | None = None
    max_len: int = 256
    """Longest string or list."""
    schema: Mapping[str, Field] | None = None
    """Schema of a nested object."""
    nullable: bool = False
    """``null`` is allowed too (and returned as None): OpenAPI's ``type: [<kind>, "null"]``."""
    names: str | None = None
    """The pattern every name of a "counts" object matches in full (OpenAPI's ``propertyNames``);
    ``max_len`` bounds how many names it has and ``min``/``max`` each count."""


def _check(path: str, spec: Field, value: Any) -> Any:
    if value is None and spec.nullable:
        return None
    kind = spec.kind
    if kind == "str":
        if not isinstance(value, str):
            raise InvalidBody(f"{path}: expected a string, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise InvalidBody(f"{path}: longer than {spec.max_len} characters")
    elif kind == "int":
        if isinstance(value, float) and value.is_integer():  # JSON Schema: 229.0 is an integer
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            what = repr(value) if isinstance(value, float) else type(value).__name__
            raise InvalidBody(f"{path}: expected an integer, got {what}")
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidBody(f"{path}: expected a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise InvalidBody(f"{path}: expected a finite number, got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise InvalidBody(f"{path}: expected true or false, got {type(value).__name__}")
    elif kind == "numbers":
        if not isinstance(value, list):
            raise InvalidBody(f"{path}: expected a list of numbers, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise InvalidBody(f"{path}: more than {spec.max_len} items")
        for i, item in enumerate(value):
            _check(f"{path}[{i}]", Field("number", min=spec.min, max=spec.max), item)
        return list(value)
    elif kind == "ints":
        if not isinstance(value, list):
            raise InvalidBody(f"{path}: expected a list of integers, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise InvalidBody(f"{path}: more than {spec.max_len} items")
        return [_check(f"{path}[{i}]", Field("int", min=spec.min, max=spec.max), item)
                for i, item in enumerate(value)]
    elif kind == "counts":
        return _counts(path, spec, value)
    elif kind == "object":
        return validate(value, spec.schema or {}, path)
    elif kind == "objects":
        if not isinstance(value, list):
            raise InvalidBody(f"{path}: expected a list of objects, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise InvalidBody(f"{path}: more than {spec.max_len} items")
        return [validate(item, spec.schema or {}, f"{path}[{i}]") for i, item in enumerate(value)]
    else:  # pragma: no cover - schema bug
        raise TypeError(f"unknown field kind {kind!r}")
    if spec.choices is not None and value not in spec.choices:
        raise InvalidBody(f"{path}: must be one of {', '.join(map(str, spec.choices))}, got {value!r}")
    if spec.min is not None and value < spec.min:
        raise InvalidBody(f"{path}: must be >= {spec.min}, got {value!r}")
    if spec.max is not None and value > spec.max:
        raise InvalidBody(f"{path}: must be <= {spec.max}, got {value!r}")
    return value


def _counts(path: str, spec: Field, value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise InvalidBody(f"{path}: expected an object of counts, got {type(value).__name__}")
    if len(value) > spec.max_len:
        raise InvalidBody(f"{path}: more than {spec.max_len} names")
    pattern = re.compile(spec.names or ".*")
    out = {}
    for name, count in value.items():
        if not pattern.fullmatch(name):
            raise InvalidBody(f"{path}: name {name[:80]!r} does not match {pattern.pattern}")
        out[name] = _check(f"{path}.{name}", Field("int", min=spec.min, max=spec.max), count)
    return out


def validate(body: Any, schema: Mapping[str, Field], path: str = "", *,
             fixed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Check ``body`` against ``schema``; return it as a dict.

    ``fixed`` names fields that exist but may not be set here, each with the reason
    (``FIXED_CONFIG`` of :mod:`coordinator.state`); naming one is refused with that reason
    rather than as an unknown field.

    Raises:
        InvalidBody: not an object, a fixed field, an unknown field, a missing required
            field, a wrong type or a value out of bounds.
    """
    where = path or "body"
    if not isinstance(body, dict):
        raise InvalidBody(f"{where}: expected a JSON object, got {type(body).__name__}")
    refused = sorted(set(body) & set(fixed)) if fixed else []
    if fixed and refused:
        sub = f"{path}.{refused[0]}" if path else refused[0]
        raise InvalidBody(f"{sub} cannot change: {fixed[refused[0]]}")
    unknown = sorted(set(body) - set(schema))
    if unknown:
        raise InvalidBody(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                          f"allowed: {', '.join(sorted(schema))}")
    out = {}
    for name, spec in schema.items():
        sub = f"{path}.{name}" if path else name
        if name not in body:
            if spec.required:
                raise InvalidBody(f"{sub}: required field is missing")
            continue
        out[name] = _check(sub, spec, body[name])
    return out


def parse_json(raw: bytes, schema: Mapping[str, Field], *, allow_empty: bool = False,
               fixed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Decode a request body (UTF-8 JSON) and :func:`validate` it (``fixed``: see there).

    Raises:
        InvalidBody: not UTF-8 JSON, or invalid per ``schema``.
    """
    if not raw.strip():
        if allow_empty:
            return validate({}, schema)
        raise InvalidBody("body: expected a JSON object, got an empty body")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidBody(f"body: malformed JSON: {exc}") from None
    return validate(body, schema, fixed=fixed)


CAPABILITIES = {
    "device": Field("str", required=True, choices=("cpu", "cuda")),
    "threads": Field("int", min=1, max=4096),
    "memory_mb": Field("int", min=0, max=1 << 30),
    "hostname": Field("str", max_len=64),
    "gpu_name": Field("str"),
    "gpu_memory_mb": Field("int", min=0, max=1 << 30),
}
"""What a trainer may declare at registration."""

REGISTER = {"capabilities": Field("object", required=True, schema=CAPABILITIES)}
"""Body of ``POST /v1/members``."""

PROGRESSIVE_WINDOW = {
    "records": Field("int", required=True, min=1),
    "n": Field("int", required=True, min=1),
    "auc": Field("number", required=True, min=0, max=1, nullable=True),
    "log_loss": Field("number", required=True, min=0),
}
"""One progressive-validation window a heartbeat carries (``trainers.progressive.WindowScore``)."""

STATS = {
    "records_per_s": Field("number", min=0),
    "loss": Field("number"),
    "accuracy": Field("number", min=0, max=1),
    "auc": Field("number", min=0, max=1),
    "log_loss": Field("number", min=0),
    "clock": Field("int", min=0),
    "lag": Field("int", min=0),
    "staleness": Field("int", min=0),
    "samples": Field("int", min=0),
    "step_time_s": Field("number", min=0),
    "bytes_per_step": Field("number", min=0),
    "freshness_s": Field("numbers", min=0, max_len=1000),
    "row_cache_hit_rate": Field("number", min=0, max=1),
    "progressive": Field("objects", max_len=64, schema=PROGRESSIVE_WINDOW),
    "progressive_auc": Field("number", min=0, max=1),
}
"""Stats a heartbeat may carry. ``freshness_s``: seconds from produce to apply of
records since the previous heartbeat, observed into the freshness histogram.
``row_cache_hit_rate``: the share of embedding rows its batches needed that the
trainer's row cache served, since the previous heartbeat (absent for a dense model
or a window without lookups). ``auc`` and ``log_loss``: a binary model's held-out AUC and log
loss at its last evaluation (absent for other models). ``progressive``: the progressive-validation
windows a binary model's trainer closed since the previous heartbeat (records scored so far, the
window's records, its AUC or null for a one-class window, its log loss); they go to the history,
not the membership; ``progressive_auc``: the newest window's AUC."""

HEARTBEAT = {"stats": Field("object", schema=STATS)}
"""Body of ``POST /v1/members/{id}/heartbeat`` (may be empty)."""


def setting_field(name: str, kind: str) -> Field:
    """A :class:`Field` with the bounds and choices of :class:`CoordinatorSettings` field ``name``,
    so a job configuration changed at run time obeys the limits it was started under; nullable
    when the setting's default is None (unset: it follows another field)."""
    field = next(f for f in dataclasses.fields(CoordinatorSettings) if f.name == name)
    meta = field.metadata
    return Field(kind, choices=meta["choices"], min=meta["min"], max=meta["max"], nullable=field.default is None)


CONFIG_CHANGE = {
    "consistency": setting_field("consistency", "str"),
    "staleness": setting_field("staleness", "int"),
    "lr": setting_field("lr", "number"),
    "table_consistency": setting_field("table_consistency", "str"),
    "table_staleness": setting_field("table_staleness", "int"),
}
"""Body of ``PATCH /v1/admin/config``: consistency bsp/ssp/asp, staleness 0..1000, lr 0..10, and the
embedding tables' table_consistency and table_staleness (the same bounds, or null: follow the dense
part's). The other job fields are fixed; ``ps_groups`` (the model's layout) is refused with its reason
(``FIXED_CONFIG`` of :mod:`coordinator.state`)."""
