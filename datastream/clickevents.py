"""Impressions and their delayed clicks from the ``clicks`` stream, with the ground truth of every label.

:class:`ClickEvents` turns each record of a :class:`~datastream.clicks.ClickStream` into an impression
(id ``i<n>``, event time ``start_ms + n * 1000 / rate_per_s``, the record's ``x`` and ``ids``), and each
record labelled 1 into one click at the impression's time plus an exponential delay; a record labelled 0
is never clicked. :meth:`ClickEvents.blocks` yields the events in emission order (event time, or jittered
by up to ``disorder_ms``), encoded for the joiner (:mod:`datastream.join.events`) with their Kafka key
and partition; :meth:`ClickEvents.truth` says what every impression's label is for a window. Pure: no
Kafka here (:mod:`datastream.events_producer` writes them). See docs/join.md, *The events source*.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, NamedTuple

import msgpack
import numpy as np
from kafka.partitioner.default import murmur2

from common.options import SpecOptions, split_spec

from .clicks import BLOCK, ClickStream
from .examples import Examples
from .join.events import FORMATS, encode_feedback, key_of
from .sources import TEST_EVERY

__all__ = ["FEEDBACK", "IMPRESSION", "ClickEvents", "EventBlock", "Truth", "TruthRow", "click_stream",
           "imp_id", "partition_of", "partitions_of"]

IMPRESSION = 0
""":attr:`EventBlock.kind` of an impression."""
FEEDBACK = 1
""":attr:`EventBlock.kind` of a click (feedback event)."""

_SALT = 0xC11C_E7E7  # seeds the delays and the jitter apart from the stream's own draws


def imp_id(index: int) -> str:
    """The impression id of record number ``index``: ``i<index>``."""
    return f"i{index}"


def partition_of(key: bytes, partitions: int) -> int:
    """The partition kafka-python's default partitioner picks for ``key`` among ``partitions``
    (murmur2, as the Java client does)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


_M = np.uint32(0x5BD1E995)


def partitions_of(keys: list[bytes], partitions: int) -> np.ndarray:
    """int32 :func:`partition_of` of every key, vectorised: murmur2 over the keys of each length at once."""
    out = np.empty(len(keys), np.int32)
    lengths = np.fromiter(map(len, keys), np.int64, len(keys))
    for length in np.unique(lengths).tolist():
        where = np.flatnonzero(lengths == length)
        data = np.frombuffer(b"".join([keys[i] for i in where.tolist()]), np.uint8).reshape(len(where), length)
        data = data.astype(np.uint32)
        h = np.full(len(where), 0x9747B28C ^ length, np.uint32)
        with np.errstate(over="ignore"):
            for i in range(0, length - length % 4, 4):
                k = data[:, i] | data[:, i + 1] << 8 | data[:, i + 2] << 16 | data[:, i + 3] << 24
                k *= _M
                k ^= k >> 24
                k *= _M
                h *= _M
                h ^= k
            tail = length - length % 4
            for extra in range(length % 4 - 1, -1, -1):
                h ^= data[:, tail + extra] << (8 * extra)
            if length % 4:
                h *= _M
            h ^= h >> 13
            h *= _M
            h ^= h >> 15
        out[where] = (h & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)
    return out


def click_stream(spec: str) -> ClickStream:
    """The :class:`ClickStream` of a ``clicks`` source spec, e.g. ``"clicks?features=8&dense=4&seed=3"``
    (the options are the stream's fields: docs/records.md, *The clicks source*).

    Raises:
        ValueError: not a ``clicks`` spec, or an unknown or bad option.
    """
    base, given = split_spec(spec)
    if base != "clicks":
        raise ValueError(f"the events source draws from the clicks stream: want clicks?option=value&..., got {spec!r}")
    opts = SpecOptions(given)
    defaults = ClickStream()
    values: dict[str, int | float] = {}
    for f in fields(ClickStream):
        default = getattr(defaults, f.name)
        values[f.name] = (opts.integer(f.name, default, lo=0) if isinstance(default, int)
                          else opts.number(f.name, default))
    opts.refuse_unread(f"stream {spec!r}")
    try:
        return ClickStream(**values)  # type: ignore[arg-type]  # each value has its field's type, read above
    except ValueError as exc:
        raise ValueError(f"stream {spec!r}: {exc}") from None


@dataclass(frozen=True)
class EventBlock:
    """Events in emission order; every array has one entry per event."""

    kind: np.ndarray
    """uint8: :data:`IMPRESSION` or :data:`FEEDBACK`."""
    index: np.ndarray
    """int64: the impression's record number (its id is :func:`imp_id` of it)."""
    t_ms: np.ndarray
    """int64: event time, ms since the epoch."""
    partition: np.ndarray
    """int32: the partition of both topics the event goes to (:func:`partition_of` its key)."""
    keys: np.ndarray
    """object: the Kafka key (:func:`~datastream.join.events.key_of` the impression id), bytes."""
    values: np.ndarray
    """object: the encoded event, bytes."""

    def __len__(self) -> int:
        return len(self.kind)

    @property
    def impressions(self) -> int:
        """Impressions in the block."""
        return int(np.count_nonzero(self.kind == IMPRESSION))


class TruthRow(NamedTuple):
    """One impression's ground truth."""

    imp: str
    """Impression id."""
    t_ms: int
    """Impression time, ms."""
    click_ms: int | None
    """Its click's time, ms; None: never clicked."""
    label: int
    """1 when the click came within the window, else 0."""


@dataclass(frozen=True)
class Truth:
    """The ground truth of impressions (by record number); arrays of one entry per impression."""

    index: np.ndarray
    """int64 record numbers, ascending."""
    t_ms: np.ndarray
    """int64 impression times."""
    click_ms: np.ndarray
    """int64 click times; -1 where there is no click."""
    label: np.ndarray
    """uint8: 1 where the click came at most the window after the impression."""

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[TruthRow]:
        for i, t, c, y in zip(self.index.tolist(), self.t_ms.tolist(), self.click_ms.tolist(), self.label.tolist()):
            yield TruthRow(imp_id(i), t, None if c < 0 else c, y)

    def labels(self) -> dict[str, int]:
        """Impression id -> its label."""
        return {imp_id(i): y for i, y in zip(self.index.tolist(), self.label.tolist())}

    def select(self, keep: np.ndarray, clicked: np.ndarray | None = None) -> Truth:
        """The impressions whose record numbers are in ``keep``; with ``clicked``, a click counts only for the
        record numbers in it (the others become unclicked negatives: their click was never written)."""
        mask = np.isin(self.index, keep)
        click, label = self.click_ms[mask], self.label[mask]
        if clicked is not None:
            gone = ~np.isin(self.index[mask], clicked)
            click, label = np.where(gone, -1, click), np.where(gone, 0, label).astype(np.uint8)
        return Truth(self.index[mask], self.t_ms[mask], click, label)

    def write(self, path: str | Path) -> None:
        """Write JSON lines, one per impression in record order:
        ``{"imp": "i0", "t": ms, "click": ms or null, "label": 0 or 1}``."""
        with open(path, "w", encoding="utf-8") as out:
            for row in self:
                out.write(json.dumps({"imp": row.imp, "t": row.t_ms, "click": row.click_ms, "label": row.label},
                                     separators=(",", ":")) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Truth:
        """Read what :meth:`write` wrote.

        Raises:
            ValueError: a line is not a truth row (the message names the file and line).
        """
        rows: list[tuple[int, int, int, int]] = []
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    obj = json.loads(line)
                    imp, click = obj["imp"], obj["click"]
                    if not (isinstance(imp, str) and imp.startswith("i")) or obj["label"] not in (0, 1):
                        raise ValueError("not an impression id i<n> with a label 0 or 1")
                    rows.append((int(imp[1:]), int(obj["t"]), -1 if click is None else int(click), obj["label"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: not a truth row ({exc}): {line.strip()[:80]!r}") from None
        table = np.array(rows, dtype=np.int64).reshape(-1, 4)
        return cls(table[:, 0], table[:, 1], table[:, 2], table[:, 3].astype(np.uint8))


@dataclass
class _Pending:
    """Events generated but not yet emitted (their emission key is past the frontier)."""

    order: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # emission key: t + jitter
    kind: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    index: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    t_ms: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    partition: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    keys: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    values: np.ndarray = field(default_factory=lambda: np.empty(0, object))

    def extend(self, other: _Pending) -> _Pending:
        return _Pending(*(np.concatenate([getattr(self, f.name), getattr(other, f.name)]) for f in fields(self)))

    def take(self, where: np.ndarray) -> _Pending:
        return _Pending(*(getattr(self, f.name)[where] for f in fields(self)))


@dataclass(frozen=True)
class ClickEvents:
    """Impressions and delayed clicks drawn from a click stream; the model: docs/join.md, *The events source*."""

    stream: ClickStream = field(default_factory=ClickStream)
    """The records: one impression each, clicked when its label is 1."""
    rate_per_s: float = 1000.0
    """Impressions per second of event time."""
    start_ms: int = 1_700_000_000_000
    """Event time of the first impression, ms since the epoch."""
    delay_mean_s: float = 3.0
    """Mean of the exponential delay from an impression to its click, seconds of event time."""
    disorder_ms: int = 0
    """0: events are emitted in event-time order; > 0: each event's place in the emission order is that of
    its event time plus a uniform jitter of 0 .. ``disorder_ms``, so no event is emitted after one more than
    ``disorder_ms`` later than it in event time."""
    seed: int = 0
    """Seed of the delays and of the jitter (the stream has its own)."""
    partitions: int = 4
    """Partitions of both topics (an event's partition is its key's, as kafka-python's default partitioner
    picks it)."""
    train_split: bool = False
    """Only the records of the stream's train split become impressions: the test split (record ``i`` with
    ``i % TEST_EVERY == TEST_EVERY - 1``, what ``load_source("clicks", split="test")`` reads) is left out,
    with its clicks, so a job scored on it is scored on impressions it never trained on. A limit still
    counts the stream's records."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise ValueError(f"rate_per_s must be a finite number > 0 impressions per second, got {self.rate_per_s}")
        if not (math.isfinite(self.delay_mean_s) and self.delay_mean_s > 0):
            raise ValueError(f"delay_mean_s must be a finite number of seconds > 0, got {self.delay_mean_s}")
        if not 0 <= self.start_ms < 1 << 52:
            raise ValueError(f"start_ms must be ms since the epoch (0 .. 2^52), got {self.start_ms}")
        if self.disorder_ms < 0:
            raise ValueError(f"disorder_ms must be >= 0, got {self.disorder_ms}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions}")

    def impression_ms(self, index: np.ndarray | int) -> np.ndarray:
        """int64 event times of the impressions of record numbers ``index``."""
        step = 1000.0 / self.rate_per_s
        return self.start_ms + np.floor(np.asarray(index, dtype=np.float64) * step).astype(np.int64)

    def _draws(self, block: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Click delays (int64 ms) and emission jitters of impressions and clicks of stream block ``block``
        (its first ``n`` records; drawn for the whole block, so a record's draws do not depend on a limit)."""
        rng = np.random.default_rng((self.seed, _SALT, block))
        delay = np.rint(rng.exponential(self.delay_mean_s * 1000.0, BLOCK)).astype(np.int64)[:n]
        if not self.disorder_ms:
            zero = np.zeros(n, np.int64)
            return delay, zero, zero
        jitter = rng.integers(0, self.disorder_ms, size=(2, BLOCK), endpoint=True)
        return delay, jitter[0, :n], jitter[1, :n]

    def _generate(self, first: int, records: Examples, fmt: Literal["msgpack", "json"]) -> _Pending:
        """The encoded events of ``records`` (record numbers ``first`` on), unsorted."""
        n = len(records)
        index = np.arange(first, first + n, dtype=np.int64)
        t = self.impression_ms(index)
        delay, imp_jitter, click_jitter = self._draws(first // BLOCK, n)
        clicked = np.flatnonzero(records.y == 1)
        ids = [imp_id(i) for i in index.tolist()]
        keys = [key_of(i) for i in ids]
        part = partitions_of(keys, self.partitions)
        t_list = t.tolist()
        xs = records.x.tolist() if records.x.shape[1] else None
        single = self.stream.names[:self.stream.features]  # one ID each; the rest (tags) lists of IDs
        rows: list[list[int]] = (np.stack([records.ids[name].values for name in single], axis=1).tolist()
                                 if single else [[]] * n)
        multi = [(name, records.ids[name].values.tolist(), records.ids[name].offsets.tolist())
                 for name in self.stream.names[self.stream.features:]]
        with_ids = bool(self.stream.names)
        pack = _packer(fmt)
        values = []
        for j in range(n):  # the map encode_impression writes, built here without its per-value checks (the hot loop)
            obj: dict[str, object] = {"imp": ids[j], "t": t_list[j]}
            if xs is not None:
                obj["x"] = xs[j]
            if with_ids:
                feature_ids: dict[str, int | list[int]] = dict(zip(single, rows[j]))
                for name, vals, offs in multi:
                    feature_ids[name] = vals[offs[j]:offs[j + 1]]
                obj["ids"] = feature_ids
            values.append(pack(obj))
        click_t = t[clicked] + delay[clicked]
        clicks = [encode_feedback(ids[j], c, fmt=fmt) for j, c in zip(clicked.tolist(), click_t.tolist())]
        m = len(clicked)
        obj_keys, obj_values = np.empty(n + m, object), np.empty(n + m, object)
        obj_keys[:n] = keys
        obj_keys[n:] = [keys[j] for j in clicked.tolist()]
        obj_values[:n] = values
        obj_values[n:] = clicks
        out = _Pending(order=np.concatenate([t + imp_jitter, click_t + click_jitter[clicked]]),
                       kind=np.repeat(np.array([IMPRESSION, FEEDBACK], np.uint8), [n, m]),
                       index=np.concatenate([index, index[clicked]]), t_ms=np.concatenate([t, click_t]),
                       partition=np.concatenate([part, part[clicked]]), keys=obj_keys, values=obj_values)
        return out.take(self._kept(out.index)) if self.train_split else out

    @staticmethod
    def _kept(index: np.ndarray) -> np.ndarray:
        """Where record numbers ``index`` are in the train split."""
        return index % TEST_EVERY != TEST_EVERY - 1

    def blocks(self, limit: int | None = None, *, fmt: Literal["msgpack", "json"] = "msgpack"
               ) -> Iterator[EventBlock]:
        """The events of the first ``limit`` impressions (``None``: forever), every click included, block after
        block in emission order: ascending ``(event time + jitter, event time, impression before click, record
        number)``. The same for the same fields, whatever ``limit`` (a shorter run is a prefix of the
        impressions, with their clicks).

        Raises:
            ValueError: ``limit`` < 0 or an unknown ``fmt``.
        """
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 impressions, got {limit}")
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        pending = _Pending()
        for first, records in self.stream.blocks(limit):
            pending = pending.extend(self._generate(first, records, fmt))
            end = first + len(records)
            last = limit is not None and end >= limit
            # every later event has an emission key >= its event time >= the next impression's time
            frontier = None if last else int(self.impression_ms(end))
            ready = np.arange(len(pending.order)) if frontier is None else np.flatnonzero(pending.order < frontier)
            if len(ready):
                out = pending.take(ready)
                rest = np.ones(len(pending.order), bool)
                rest[ready] = False
                pending = pending.take(rest)
                yield _emit(out)

    def truth(self, window_s: float, limit: int) -> Truth:
        """Every one of the first ``limit`` impressions with its click (if any) and its label: 1 when a click
        exists and ``click_ms - t_ms <= window_s * 1000``.

        Raises:
            ValueError: ``window_s`` < 0 or not finite, ``limit`` < 0.
        """
        if not (math.isfinite(window_s) and window_s >= 0):
            raise ValueError(f"window_s must be a finite number of seconds >= 0, got {window_s}")
        if limit < 0:
            raise ValueError(f"limit must be >= 0 impressions, got {limit}")
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for first, records in self.stream.blocks(limit):
            n = len(records)
            index = np.arange(first, first + n, dtype=np.int64)
            delay = self._draws(first // BLOCK, n)[0]
            clicked = records.y == 1
            parts.append((index, np.where(clicked, delay, -1), clicked & (delay <= window_s * 1000.0)))
        if not parts:
            empty = np.empty(0, np.int64)
            return Truth(empty, empty, empty, np.empty(0, np.uint8))
        index, delay, label = (np.concatenate(p) for p in zip(*parts))
        if self.train_split:
            kept = self._kept(index)
            index, delay, label = index[kept], delay[kept], label[kept]
        t = self.impression_ms(index)
        return Truth(index, t, np.where(delay >= 0, t + delay, -1), label.astype(np.uint8))


def _packer(fmt: str) -> Callable[[object], bytes]:
    """Encodes a map as :mod:`datastream.join.events` does in ``fmt``."""
    if fmt == "msgpack":
        return msgpack.Packer().pack
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    return lambda obj: dumps(obj).encode()


def _emit(events: _Pending) -> EventBlock:
    order = np.lexsort((events.index, events.kind, events.t_ms, events.order))
    e = events.take(order)
    return EventBlock(kind=e.kind, index=e.index, t_ms=e.t_ms, partition=e.partition, keys=e.keys, values=e.values)
