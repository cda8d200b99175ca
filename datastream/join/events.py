"""The joiner's input events, as pure encode/decode functions.

Impressions (what was shown, with the features it was scored on), feedback (what happened later:
a click, a conversion) and punctuation (a partition's event time has reached a point) arrive as
JSON or msgpack maps, one per Kafka message, keyed by the impression id so that both topics
partition alike. :func:`decode_event` turns a message into :class:`Impression`, :class:`Feedback` or
:class:`Punctuation`, or raises :class:`JoinDecodeError` with one of :data:`JOIN_REASONS`. See
docs/join.md, *Formats*.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from ..records import DEFAULT_MAX_RECORD_BYTES, DecodeError, check_single_record

__all__ = ["FORMATS", "JOIN_REASONS", "MAX_IMP_BYTES", "Feedback", "Impression", "JoinDecodeError", "Punctuation",
           "decode_event", "encode_feedback", "encode_impression", "encode_punctuation", "imp_key", "key_of",
           "labelled_record"]

FORMATS = ("msgpack", "json")
"""Encodings of events and of the joiner's output records."""

JOIN_REASONS = ("bad_event", "no_id", "no_event_time", "duplicate_impression", "unknown_impression")
"""Why the joiner dead-letters an event (besides a record reason of :data:`datastream.records.REASONS`
for an impression whose features are not a valid record)."""

MAX_IMP_BYTES = 256
"""Longest impression id accepted (UTF-8 bytes)."""

_MAX_TIME_MS = 1 << 53  # event times are ms since the epoch; anything larger is not a time
_IMPRESSION_KEYS = {"imp", "t", "x", "ids"}
_FEEDBACK_KEYS = {"imp", "t", "label", "value"}

ImpId = str | int
"""An impression id as events give it."""


class JoinDecodeError(ValueError):
    """A message is not a valid event; ``reason`` is one of :data:`JOIN_REASONS` or a record reason."""

    def __init__(self, reason: str, message: str, imp: bytes | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.imp = imp


@dataclass(frozen=True)
class Impression:
    """One impression: its id, event time and the training record's features (msgpack of ``x``/``ids``)."""

    imp: bytes
    """The impression id (UTF-8 of its string form)."""
    t_ms: int
    """Event time, ms since the epoch."""
    features: bytes
    """msgpack map of the record's ``x`` and ``ids``, checked as a valid record."""


@dataclass(frozen=True)
class Feedback:
    """One feedback event."""

    imp: bytes
    """The impression it is about."""
    t_ms: int
    """Event time, ms since the epoch."""
    label: str
    """What happened (``click``, ``conversion``, ...)."""
    value: float
    """Its value (1.0 unless the event says)."""


@dataclass(frozen=True)
class Punctuation:
    """A partition's event time has reached ``t_ms``: no event of it will be earlier (as far as its writer knows)."""

    t_ms: int


def key_of(imp: ImpId) -> bytes:
    """Kafka key of an impression's events: the id's string form in UTF-8."""
    return imp_key(imp)


def imp_key(imp: Any) -> bytes:
    """The impression id of an event field, as bytes.

    Raises:
        JoinDecodeError: ``no_id`` (missing, empty, not a string or integer, too long).
    """
    if type(imp) is int:
        return str(imp).encode()
    if isinstance(imp, str) and imp:
        try:
            out = imp.encode("utf-8")
        except UnicodeEncodeError:
            raise JoinDecodeError("no_id", "the impression id is not valid Unicode") from None
        if len(out) > MAX_IMP_BYTES:
            raise JoinDecodeError("no_id", f"impression id of {len(out)} bytes; at most {MAX_IMP_BYTES}")
        return out
    raise JoinDecodeError("no_id", f"an event needs an impression id 'imp' (a non-empty string or an integer), "
                                   f"got {type(imp).__name__}")


_Y, _W = msgpack.packb("y"), msgpack.packb("w")


def _pack(obj: dict[str, Any], fmt: str) -> bytes:
    if fmt == "msgpack":
        return msgpack.packb(obj)
    if fmt == "json":
        return json.dumps(obj, separators=(",", ":")).encode()
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def encode_impression(imp: ImpId, t_ms: int, x: Sequence[float] | None = None,
                      ids: Mapping[str, int | str | Sequence[int | str]] | None = None, *,
                      fmt: Literal["msgpack", "json"] = "msgpack") -> bytes:
    """One impression event (``x=None`` leaves the dense features out)."""
    obj: dict[str, Any] = {"imp": imp, "t": int(t_ms)}
    if x is not None:
        obj["x"] = [float(v) for v in x]
    if ids is not None:
        obj["ids"] = {k: v if isinstance(v, int | str) else list(v) for k, v in ids.items()}
    return _pack(obj, fmt)


def encode_feedback(imp: ImpId, t_ms: int, label: str = "click", value: float = 1.0, *,
                    fmt: Literal["msgpack", "json"] = "msgpack") -> bytes:
    """One feedback event."""
    return _pack({"imp": imp, "t": int(t_ms), "label": label, "value": float(value)}, fmt)


def encode_punctuation(t_ms: int, *, fmt: Literal["msgpack", "json"] = "msgpack") -> bytes:
    """A punctuation: the partition's event time has reached ``t_ms``."""
    return _pack({"wm": int(t_ms)}, fmt)


def _time(obj: dict[str, Any], key: str, imp: bytes | None) -> int:
    t = obj.get(key)
    if type(t) is not int or not 0 <= t < _MAX_TIME_MS:
        raise JoinDecodeError("no_event_time", f"an event needs its event time {key!r} as integer ms since the "
                                               f"epoch, got {t!r:.40}", imp)
    return t


def _parse(value: bytes | None, max_bytes: int) -> Any:
    if value is None or not value:
        raise JoinDecodeError("bad_event", "empty message value")
    if len(value) > max_bytes:
        raise JoinDecodeError("bad_event", f"message of {len(value)} bytes exceeds the limit of {max_bytes}")
    if value[:1] in (b"{", b" ", b"\n", b"\t", b"\r"):
        try:
            return json.loads(value)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise JoinDecodeError("bad_event", f"not valid JSON: {exc}") from None
    try:
        return msgpack.unpackb(value, raw=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise JoinDecodeError("bad_event", f"not valid msgpack: {str(exc) or type(exc).__name__}") from None


def decode_event(value: bytes | None, *, feature_dim: int | None = None,
                 max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Impression | Feedback | Punctuation:
    """Decode one message of an impressions or feedback topic.

    An impression's features are checked as the training record they will become
    (:func:`datastream.records.check_single_record`), so the joiner never writes what a trainer would reject.

    Raises:
        JoinDecodeError: not a valid event; ``reason`` says why (a record reason for bad features).
    """
    obj = _parse(value, max_bytes)
    if not isinstance(obj, dict):
        raise JoinDecodeError("bad_event", f"an event is a map, got {type(obj).__name__}")
    if "wm" in obj:
        if set(obj) != {"wm"}:
            raise JoinDecodeError("bad_event", f"a punctuation is {{'wm': ms}} alone, got keys {sorted(map(str, obj))}")
        return Punctuation(_time(obj, "wm", None))
    if "imp" not in obj:
        raise JoinDecodeError("no_id", f"an event needs an impression id 'imp'; got keys {sorted(map(str, obj))}")
    imp = imp_key(obj["imp"])
    t = _time(obj, "t", imp)
    if "label" in obj or "value" in obj:
        extra = set(obj) - _FEEDBACK_KEYS
        if extra or "label" not in obj:
            raise JoinDecodeError("bad_event", f"feedback is a map of imp, t, label and value; got keys "
                                               f"{sorted(map(str, obj))}", imp)
        label, value_ = obj["label"], obj.get("value", 1.0)
        if not isinstance(label, str) or not 0 < len(label) <= 64:
            raise JoinDecodeError("bad_event", f"feedback label must be a name of 1-64 characters, got {label!r:.40}",
                                  imp)
        if type(value_) not in (int, float):
            raise JoinDecodeError("bad_event", f"feedback value must be a number, got {type(value_).__name__}", imp)
        if not math.isfinite(value_):
            raise JoinDecodeError("non_finite", "feedback value is NaN or infinite", imp)
        return Feedback(imp, t, label, float(value_))
    extra = set(obj) - _IMPRESSION_KEYS
    if extra:
        raise JoinDecodeError("bad_event", f"an impression is a map of imp, t, x and ids; unexpected "
                                           f"{sorted(map(str, extra))}", imp)
    features = {k: obj[k] for k in ("x", "ids") if k in obj}
    if not features:
        raise JoinDecodeError("bad_event", "an impression carries no features (x, ids or both)", imp)
    try:
        check_single_record({**features, "y": 0}, feature_dim=feature_dim)
    except DecodeError as exc:
        raise JoinDecodeError(exc.reason, f"its features are not a valid record: {exc}", imp) from None
    return Impression(imp, t, msgpack.packb(features))


def labelled_record(features: bytes, y: int, w: float | None, fmt: str = "msgpack") -> bytes:
    """The training record of an impression's ``features`` (a msgpack map of ``x``, ``ids`` or both, as
    :attr:`Impression.features` holds them) with label ``y`` and weight ``w`` (None: 1)."""
    if fmt == "msgpack" and features[:1] in (b"\x81", b"\x82"):
        # the map's entries as they are, after a fixmap header that counts y (and w) too: the bytes
        # msgpack.packb({**features, "y": y, "w": w}) writes, without decoding the features again
        extra = _Y + msgpack.packb(y) + (b"" if w is None else _W + msgpack.packb(w))
        return bytes((features[0] + (1 if w is None else 2),)) + features[1:] + extra
    obj = msgpack.unpackb(features, raw=False)
    obj["y"] = y
    if w is not None:
        obj["w"] = w
    return _pack(obj, fmt)
