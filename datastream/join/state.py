"""The join state of one task (partition ``p`` of the impressions topic and of every feedback topic), as a pure
state machine: events in, decisions and changelog records out.

An impression waits (*pending*) until its label is decided: positive as soon as a feedback event of the
chosen label arrives within ``window_ms`` of it, negative once the watermark passes the end of its window.
The watermark is the lowest of the task's inputs' highest event times, less ``lateness_ms``, and never goes
back. A decided impression is remembered until the watermark passes its window end by ``retain_ms`` (so a
repeated impression id is caught and late feedback is told from feedback for an impression never seen).
Feedback that arrives before its impression is held until the watermark passes its event time.

The changelog (what a restarted joiner restores) holds, per task, one record per commit of each kind:
the impressions that arrived (``pend/<seq>``, with their features), the impressions decided before the
watermark decided them (``dec/<seq>``: positives and those decided early by ``max_pending``), the feedback
held for impressions not yet seen (``early/<seq>``), and the task's watermark and counters (``meta``). A
batch is tombstoned when the watermark has made it useless; an impression the watermark decided needs no
record, since ``t + window < watermark`` says so. See docs/join.md, *Exactly once*.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, cast

import msgpack

from .events import Feedback, Impression, encode_feedback, labelled_record

__all__ = ["LATE_REASONS", "JoinRules", "Output", "Source", "TaskState", "keep_negative"]

LATE_REASONS = ("outside_window", "after_decision", "decided_early")
"""Why feedback was late: its event time is after the impression's window; it was within the window but
arrived after the watermark had decided the impression negative; or ``--max-pending`` had decided it early."""

META = b"meta"
"""Changelog key of a task's watermark, input event times and counters."""

_MAX_BATCH_ENTRIES = 20_000  # entries per changelog batch record (well under the topic's message size)

How = Literal["positive", "negative", "early"]


@dataclass(frozen=True)
class JoinRules:
    """The event-time rules of a join (docs/join.md, *Event time*)."""

    window_ms: int
    """Feedback within this long after an impression makes it positive."""
    lateness_ms: int
    """How far behind the inputs' event times the watermark stays (out-of-order events within it still join)."""
    retain_ms: int
    """How long past its window end a decided impression is remembered."""
    max_pending: int
    """Most impressions (and, separately, held feedback events) a task keeps; beyond, the oldest are decided."""
    label: str = "click"
    """The feedback label that makes an impression positive; other labels are counted and ignored."""
    negative_rate: float = 1.0
    """Share of negatives written (each kept by a hash of its id), weighted ``1/negative_rate``."""
    fmt: str = "msgpack"
    """Encoding of the records written."""

    def __post_init__(self) -> None:
        if min(self.window_ms, self.lateness_ms, self.retain_ms) < 0 or self.max_pending < 1:
            raise ValueError("window, lateness and retention must be >= 0 and max_pending >= 1")
        if not 0 < self.negative_rate <= 1:
            raise ValueError(f"negative_rate must be in (0, 1], got {self.negative_rate}")


@dataclass(frozen=True)
class Source:
    """Where an event came from (named in dead letters and late records)."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class Output:
    """One message a decision produces."""

    kind: Literal["record", "late", "dead"]
    """A training record, a late feedback event, or a dead letter."""
    key: bytes
    """The impression id."""
    value: bytes | None
    """The message value."""
    reason: str = ""
    """Why (late and dead)."""
    error: str = ""
    """A readable account (dead)."""
    source: Source | None = None
    """The input message (late and dead)."""
    decidable_ms: int = 0
    """Event time from which a record's label was known (its feedback's, or its window's end)."""


def keep_negative(imp: bytes, rate: float) -> bool:
    """Whether negative ``imp`` is written at ``rate``: the first 8 bytes of BLAKE2b of the id, as a fraction
    of 2^64, are below ``rate`` (the same answer in every process and every replay)."""
    if rate >= 1.0:
        return True
    u = int.from_bytes(hashlib.blake2b(imp, digest_size=8).digest(), "little")
    return u < rate * 18446744073709551616.0


@dataclass
class _Pending:
    t: int
    features: bytes
    batch: int


@dataclass
class _Decided:
    t: int
    how: How
    batch: int


@dataclass
class _Held:
    t: int
    label: str
    value: float
    source: Source


@dataclass
class _Batch:
    key: bytes
    expire_after: int
    """The record is tombstoned once the watermark is past this."""


@dataclass
class TaskState:
    """The join state of one task: feed it events in order, take outputs and changelog records."""

    rules: JoinRules
    inputs: tuple[str, ...]
    """Names of the task's input partitions (``topic/partition``); the watermark waits for all that are active."""
    watermark: int | None = None
    maxima: dict[str, int] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=Counter)
    seq: int = 0
    pending: dict[bytes, _Pending] = field(default_factory=dict)
    decided: dict[bytes, _Decided] = field(default_factory=dict)
    held: dict[bytes, list[_Held]] = field(default_factory=dict)
    _pending_heap: list[tuple[int, bytes]] = field(default_factory=list)
    _decided_heap: list[tuple[int, bytes]] = field(default_factory=list)
    _held_heap: list[tuple[int, bytes]] = field(default_factory=list)
    _batches: list[_Batch] = field(default_factory=list)
    _new_pending: list[tuple[bytes, int, bytes]] = field(default_factory=list)
    _new_decided: list[tuple[bytes, str]] = field(default_factory=list)
    _new_held: list[tuple[bytes, int, str, float, str, int, int]] = field(default_factory=list)
    _claimed_until: int = 0
    _dirty: bool = False

    def count(self, what: str) -> None:
        """Count ``what`` (a dead letter or late event the caller found) in the task's counters."""
        self.counters[what] += 1
        self._dirty = True

    # -- events ----------------------------------------------------------------------------------------
    def observe(self, name: str, t: int) -> None:
        """Input ``name`` has reached event time ``t`` (any event or punctuation of it)."""
        if t > self.maxima.get(name, -1):
            self.maxima[name] = t
            self._dirty = True

    def impression(self, ev: Impression, source: Source) -> list[Output]:
        """An impression arrives: it waits, or is decided now (held feedback, or its window already closed)."""
        self._dirty = True
        if ev.imp in self.pending or ev.imp in self.decided:
            self.counters["dead.duplicate_impression"] += 1
            return [Output("dead", ev.imp, None, "duplicate_impression",
                           f"impression {ev.imp[:80]!r} was seen already (t={ev.t_ms})", source)]
        batch = self.seq
        self.pending[ev.imp] = _Pending(ev.t_ms, ev.features, batch)
        self._new_pending.append((ev.imp, ev.t_ms, ev.features))
        heapq.heappush(self._pending_heap, (ev.t_ms + self.rules.window_ms, ev.imp))
        out: list[Output] = []
        claimed = self.held.pop(ev.imp, [])
        if claimed:  # so that a restore does not hold them again, however long after the impression
            self._new_decided.append((ev.imp, "claimed"))
            self._claimed_until = max(self._claimed_until, max(h.t for h in claimed))
        for h in claimed:
            out += self._feedback_for_pending(ev.imp, h.t, h.label, h.source, h.value)
        wm = self.watermark
        if ev.imp in self.pending and wm is not None and ev.t_ms + self.rules.window_ms < wm:
            out += self._decide(ev.imp, "negative", wm)  # its window closed before it arrived
        out += self._evict_pending()
        return out

    def feedback(self, ev: Feedback, source: Source) -> list[Output]:
        """A feedback event arrives: it decides a pending impression, is late, or waits for its impression."""
        self._dirty = True
        if ev.imp in self.pending:
            return self._feedback_for_pending(ev.imp, ev.t_ms, ev.label, source, ev.value)
        decided = self.decided.get(ev.imp)
        if decided is not None:
            if ev.label != self.rules.label:
                self.counters["ignored"] += 1
                return []
            if decided.how == "positive":
                self.counters["repeat"] += 1
                return []
            if ev.t_ms - decided.t > self.rules.window_ms:
                reason = "outside_window"
            else:
                reason = "after_decision" if decided.how == "negative" else "decided_early"
            self.counters[f"late.{reason}"] += 1
            return [Output("late", ev.imp, None, reason, "", source)]
        wm = self.watermark
        if wm is not None and ev.t_ms < wm:  # its impression would be late too: nothing will claim it
            self.counters["dead.unknown_impression"] += 1
            return [Output("dead", ev.imp, None, "unknown_impression",
                           f"feedback for impression {ev.imp[:80]!r} never seen (t={ev.t_ms} is behind the "
                           f"watermark {wm})", source)]
        self.held.setdefault(ev.imp, []).append(_Held(ev.t_ms, ev.label, ev.value, source))
        self._new_held.append((ev.imp, ev.t_ms, ev.label, ev.value, source.topic, source.partition, source.offset))
        heapq.heappush(self._held_heap, (ev.t_ms, ev.imp))
        return self._evict_held()

    def advance(self, idle: Iterable[str] = ()) -> list[Output]:
        """Recompute the watermark from the inputs' event times (leaving out ``idle`` ones, unless all are),
        then decide the impressions whose window it passed and drop what it made useless."""
        if not self.maxima:
            return []
        idle = set(idle)  # an input never seen does not hold it back either
        low = min((t for name, t in self.maxima.items() if name not in idle), default=None) if idle else None
        candidate = (min(self.maxima.values()) if low is None else low) - self.rules.lateness_ms
        if self.watermark is not None and candidate <= self.watermark:
            return []
        self.watermark = wm = candidate
        self._dirty = True
        out: list[Output] = []
        heap = self._pending_heap
        while heap and heap[0][0] < wm:
            _, imp = heapq.heappop(heap)
            if imp in self.pending:
                out += self._decide(imp, "negative", wm)
        held = self._held_heap
        while held and held[0][0] < wm:
            _, imp = heapq.heappop(held)
            items = self.held.get(imp)
            if not items:
                continue
            keep = [h for h in items if h.t >= wm]
            for h in items:
                if h.t < wm:
                    self.counters["dead.unknown_impression"] += 1
                    out.append(Output("dead", imp, encode_feedback(imp.decode("utf-8", "replace"), h.t, h.label,
                                                                   h.value),
                                      "unknown_impression",
                                      f"feedback for impression {imp[:80]!r} never seen by the watermark {wm}",
                                      h.source))
            if keep:
                self.held[imp] = keep
            else:
                del self.held[imp]
        dheap, span = self._decided_heap, self.rules.window_ms + self.rules.retain_ms
        while dheap and dheap[0][0] + span < wm:
            _, imp = heapq.heappop(dheap)
            self.decided.pop(imp, None)
        return out

    # -- decisions ---------------------------------------------------------------------------------------
    def _feedback_for_pending(self, imp: bytes, t: int, label: str, source: Source, value: float) -> list[Output]:
        if label != self.rules.label:
            self.counters["ignored"] += 1
            return []
        p = self.pending[imp]
        if t - p.t > self.rules.window_ms:
            self.counters["late.outside_window"] += 1
            return [Output("late", imp, None, "outside_window", "", source)]
        return self._decide(imp, "positive", max(t, p.t))

    def _decide(self, imp: bytes, how: How, decidable_ms: int) -> list[Output]:
        p = self.pending.pop(imp)
        self.decided[imp] = _Decided(p.t, how, p.batch)
        heapq.heappush(self._decided_heap, (p.t, imp))
        if how != "negative":
            self._new_decided.append((imp, how))
        self.counters["joined"] += 1
        if how == "positive":
            self.counters["positives"] += 1
            return [Output("record", imp, labelled_record(p.features, 1, None, self.rules.fmt),
                           decidable_ms=decidable_ms)]
        self.counters["negatives"] += 1
        if how == "early":
            self.counters["decided_early"] += 1
        rate = self.rules.negative_rate
        if not keep_negative(imp, rate):
            self.counters["negatives_dropped"] += 1
            return []
        w = None if rate >= 1.0 else 1.0 / rate
        return [Output("record", imp, labelled_record(p.features, 0, w, self.rules.fmt),
                       decidable_ms=decidable_ms if how == "negative" else 0)]

    def _evict_pending(self) -> list[Output]:
        out: list[Output] = []
        heap = self._pending_heap
        while len(self.pending) > self.rules.max_pending and heap:
            _, imp = heapq.heappop(heap)
            if imp in self.pending:
                out += self._decide(imp, "early", 0)
        return out

    def _evict_held(self) -> list[Output]:
        out: list[Output] = []
        heap = self._held_heap
        while sum(map(len, self.held.values())) > self.rules.max_pending and heap:
            _, imp = heapq.heappop(heap)
            for h in self.held.pop(imp, []):
                self.counters["dead.unknown_impression"] += 1
                out.append(Output("dead", imp, encode_feedback(imp.decode("utf-8", "replace"), h.t, h.label, h.value),
                                  "unknown_impression",
                                  f"feedback for impression {imp[:80]!r} evicted unmatched: more than "
                                  f"{self.rules.max_pending} feedback events held", h.source))
        return out

    # -- the changelog -------------------------------------------------------------------------------------
    @property
    def changed(self) -> bool:
        """True when the state changed since the last :meth:`changelog`."""
        return self._dirty

    def changelog(self) -> list[tuple[bytes, bytes | None]]:
        """The changelog records of what changed since the last call (``None``: a tombstone); the caller
        writes them in the transaction that commits the input offsets of the events that made them."""
        out: list[tuple[bytes, bytes | None]] = []
        span = self.rules.window_ms + self.rules.retain_ms
        wm = self.watermark
        if wm is not None:  # batches the watermark made useless
            live = []
            for b in self._batches:
                if b.expire_after < wm:
                    out.append((b.key, None))
                else:
                    live.append(b)
            self._batches = live
        for i in range(0, len(self._new_pending), _MAX_BATCH_ENTRIES):
            pend = self._new_pending[i:i + _MAX_BATCH_ENTRIES]
            key = b"pend/%d/%d" % (self.seq, i)
            out.append((key, msgpack.packb([[imp, t, f] for imp, t, f in pend])))
            self._batches.append(_Batch(key, max(t for _, t, _ in pend) + span))
        # decisions and held feedback are kept while any pending batch is (restore reads them together)
        pend_expire = max((b.expire_after for b in self._batches if b.key.startswith(b"pend/")), default=0)
        for i in range(0, len(self._new_decided), _MAX_BATCH_ENTRIES):
            dec = self._new_decided[i:i + _MAX_BATCH_ENTRIES]
            key = b"dec/%d/%d" % (self.seq, i)
            out.append((key, msgpack.packb([list(e) for e in dec])))
            self._batches.append(_Batch(key, max(pend_expire, self._claimed_until)))
        for i in range(0, len(self._new_held), _MAX_BATCH_ENTRIES):
            held = self._new_held[i:i + _MAX_BATCH_ENTRIES]
            key = b"early/%d/%d" % (self.seq, i)
            out.append((key, msgpack.packb([list(e) for e in held])))
            self._batches.append(_Batch(key, max(max(e[1] for e in held), pend_expire)))
        if self._dirty or out:
            out.append((META, msgpack.packb({"wm": self.watermark, "maxima": self.maxima,
                                              "counters": dict(self.counters), "seq": self.seq + 1})))
        self.seq += 1
        self._new_pending, self._new_decided, self._new_held = [], [], []
        self._claimed_until = 0
        self._dirty = False
        return out

    @classmethod
    def restore(cls, rules: JoinRules, inputs: tuple[str, ...],
                records: Mapping[bytes, bytes]) -> TaskState:
        """The state a task's changelog holds (its latest value per key, tombstoned keys left out)."""
        state = cls(rules, inputs)
        meta = records.get(META)
        if meta is None:
            return state
        m = msgpack.unpackb(meta, raw=False)
        state.watermark, state.maxima, state.seq = m["wm"], dict(m["maxima"]), m["seq"]
        state.counters = Counter(m["counters"])
        span = rules.window_ms + rules.retain_ms
        wm = state.watermark

        def seq_of(key: bytes) -> tuple[int, int]:
            _, s, i = key.split(b"/")
            return int(s), int(i)

        early_how: dict[bytes, str] = {}
        claimed: set[bytes] = set()
        dec_keys = sorted((k for k in records if k.startswith(b"dec/")), key=seq_of)
        for key in dec_keys:
            for imp, how in msgpack.unpackb(records[key], raw=False):
                if how == "claimed":
                    claimed.add(imp)
                else:
                    early_how[imp] = how
        pend_keys = sorted((k for k in records if k.startswith(b"pend/")), key=seq_of)
        for key in pend_keys:
            top, batch = 0, seq_of(key)[0]
            for imp, t, features in msgpack.unpackb(records[key], raw=False):
                top = max(top, t)
                if wm is not None and t + span < wm:
                    continue
                how = early_how.get(imp)
                if how is None and wm is not None and t + rules.window_ms < wm:
                    how = "negative"
                if how is not None:
                    state.decided[imp] = _Decided(t, cast(How, how), batch)
                    heapq.heappush(state._decided_heap, (t, imp))
                else:
                    state.pending[imp] = _Pending(t, features, batch)
                    heapq.heappush(state._pending_heap, (t + rules.window_ms, imp))
            state._batches.append(_Batch(key, top + span))
        pend_expire = max((b.expire_after for b in state._batches if b.key.startswith(b"pend/")), default=0)
        held_top = 0
        for key in sorted((k for k in records if k.startswith(b"early/")), key=seq_of):
            held_top = max([held_top, *(e[1] for e in msgpack.unpackb(records[key], raw=False))])
        for key in dec_keys:
            state._batches.append(_Batch(key, max(pend_expire, held_top)))
        for key in sorted((k for k in records if k.startswith(b"early/")), key=seq_of):
            top = 0
            for imp, t, label, value, topic, partition, offset in msgpack.unpackb(records[key], raw=False):
                top = max(top, t)
                if imp in claimed or imp in state.pending or imp in state.decided or (wm is not None and t < wm):
                    continue  # claimed by its impression, or dead-lettered when the watermark passed it
                state.held.setdefault(imp, []).append(_Held(t, label, value, Source(topic, partition, offset)))
                heapq.heappush(state._held_heap, (t, imp))
            pend_expire = max((b.expire_after for b in state._batches if b.key.startswith(b"pend/")), default=0)
            state._batches.append(_Batch(key, max(top, pend_expire)))
        return state

    # -- views -----------------------------------------------------------------------------------------------
    @property
    def held_count(self) -> int:
        """Feedback events held for impressions not yet seen."""
        return sum(map(len, self.held.values()))
