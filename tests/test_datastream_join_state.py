"""The join's event-time rules and its changelog, on the pure state machine (datastream/join/state.py):
windows, the watermark, late feedback by reason, bad input, bounded state, downsampling, and a restore from
the changelog at every point giving what an uninterrupted run gives."""

from __future__ import annotations

import json
import random

import msgpack
import pytest

from datastream.join.events import (
    Feedback,
    Impression,
    JoinDecodeError,
    decode_event,
    encode_feedback,
    encode_impression,
    encode_punctuation,
    labelled_record,
)
from datastream.join.state import JoinRules, Output, Source, TaskState, keep_negative
from datastream.records import decode_record

IMP, FB = "imps/0", "fb/0"
RULES = JoinRules(window_ms=1000, lateness_ms=200, retain_ms=1000, max_pending=1000)


def imp(i: str, t: int) -> Impression:
    ev = decode_event(encode_impression(i, t, [1.0, 2.0], {"u": 7}))
    assert isinstance(ev, Impression)
    return ev


def fb(i: str, t: int, label: str = "click") -> Feedback:
    ev = decode_event(encode_feedback(i, t, label))
    assert isinstance(ev, Feedback)
    return ev


class Driver:
    """Feeds a TaskState events as the service does (observe, handle, advance) and keeps the outputs."""

    def __init__(self, rules: JoinRules = RULES) -> None:
        self.state = TaskState(rules, (IMP, FB))
        self.out: list[Output] = []
        self.offset = 0

    def send(self, kind: str, i: str, t: int, label: str = "click") -> list[Output]:
        self.offset += 1
        src = Source("imps" if kind == "imp" else "fb", 0, self.offset)
        self.state.observe(IMP if kind == "imp" else FB, t)
        got = self.state.impression(imp(i, t), src) if kind == "imp" else self.state.feedback(fb(i, t, label), src)
        got += self.state.advance()
        self.out += got
        return got

    def tick(self, t: int) -> list[Output]:
        """Both inputs reach ``t`` (punctuation)."""
        self.state.observe(IMP, t)
        self.state.observe(FB, t)
        got = self.state.advance()
        self.out += got
        return got

    def labels(self) -> dict[bytes, int]:
        return {o.key: msgpack.unpackb(o.value)["y"] for o in self.out if o.kind == "record"}


def test_feedback_within_the_window_is_positive_at_once_and_silence_is_negative_after_the_watermark() -> None:
    d = Driver()
    d.send("imp", "a", 1000)
    d.send("imp", "b", 1100)
    got = d.send("fb", "a", 1900)
    assert [(o.kind, o.key) for o in got] == [("record", b"a")]
    record = msgpack.unpackb(got[0].value)
    assert record == {"x": [1.0, 2.0], "ids": {"u": 7}, "y": 1}
    assert d.tick(2299) == []  # watermark 2099: b's window ends at 2100
    assert [o.key for o in d.tick(2301)] == [b"b"]  # watermark 2101 > 2100
    assert d.labels() == {b"a": 1, b"b": 0}
    assert d.state.counters["joined"] == 2 and d.state.counters["positives"] == 1


def test_late_feedback_is_counted_by_reason_and_never_joined() -> None:
    d = Driver()
    d.send("imp", "a", 0)
    d.send("imp", "b", 0)
    got = d.send("fb", "a", 1500)  # after a's window (1000) while a is still pending
    assert [(o.kind, o.reason) for o in got] == [("late", "outside_window")]
    d.tick(1300)  # watermark 1100: a and b negative
    got = d.send("fb", "b", 900)  # within b's window, but after the watermark decided it
    assert [(o.kind, o.reason) for o in got] == [("late", "after_decision")]
    assert d.labels() == {b"a": 0, b"b": 0}
    assert d.state.counters["late.outside_window"] == 1 and d.state.counters["late.after_decision"] == 1


def test_out_of_order_events_within_the_allowed_lateness_still_join() -> None:
    d = Driver()
    d.send("imp", "a", 1000)
    d.send("imp", "c", 2150)  # the impressions input is ahead: watermark min(2150, ...) - 200
    d.send("fb", "x", 2150)  # feedback input too: watermark 1950, a's window (2000) still open
    d.send("fb", "a", 1990)  # out of order by 160 ms < 200: joins
    assert d.labels() == {b"a": 1}


def test_feedback_before_its_impression_waits_for_it() -> None:
    d = Driver()
    d.send("fb", "a", 500)
    assert d.state.held_count == 1
    d.send("imp", "a", 400)
    assert d.labels() == {b"a": 1} and d.state.held_count == 0


def test_feedback_for_an_impression_never_seen_is_dead_lettered_once_the_watermark_passes_it() -> None:
    d = Driver()
    d.send("fb", "ghost", 500)
    got = d.tick(800)  # watermark 600 > 500
    assert [(o.kind, o.reason, o.key) for o in got] == [("dead", "unknown_impression", b"ghost")]
    assert msgpack.unpackb(got[0].value)["imp"] == "ghost"
    got = d.send("fb", "ghost2", 100)  # already behind the watermark
    assert [(o.kind, o.reason) for o in got] == [("dead", "unknown_impression")]


def test_a_repeated_impression_id_is_dead_lettered_and_the_first_one_kept() -> None:
    d = Driver()
    d.send("imp", "a", 0)
    got = d.send("imp", "a", 10)
    assert [(o.kind, o.reason) for o in got] == [("dead", "duplicate_impression")]
    d.send("fb", "a", 20)
    got = d.send("imp", "a", 30)  # decided, still remembered
    assert [(o.kind, o.reason) for o in got] == [("dead", "duplicate_impression")]
    assert d.labels() == {b"a": 1}


@pytest.mark.parametrize("value, reason", [
    (encode_impression("a", 5, [float("nan")]), "non_finite"),
    (encode_feedback("a", 5, value=float("inf")), "non_finite"),
    (msgpack.packb({"t": 5, "x": [1.0]}), "no_id"),
    (msgpack.packb({"imp": "", "t": 5, "x": [1.0]}), "no_id"),
    (msgpack.packb({"imp": "a", "x": [1.0]}), "no_event_time"),
    (msgpack.packb({"imp": "a", "t": -1, "x": [1.0]}), "no_event_time"),
    (msgpack.packb({"imp": "a", "t": 1.5, "label": "click"}), "no_event_time"),
    (msgpack.packb({"imp": "a", "t": 5}), "bad_event"),
    (msgpack.packb({"imp": "a", "t": 5, "x": [1.0], "y": 1}), "bad_event"),
    (msgpack.packb([1, 2]), "bad_event"),
    (b"{not json", "bad_event"),
    (msgpack.packb({"imp": "a", "t": 5, "ids": {"bad name!": 1}}), "bad_ids"),
    (msgpack.packb({"wm": 5, "imp": "a"}), "bad_event"),
    (json.dumps({"imp": "a", "t": 5, "x": [10 ** 400]}).encode(), "non_finite"),
    (msgpack.packb({"imp": "a", "t": 5, "x": [1.0, "2"]}), "wrong_dtype"),
    (msgpack.packb({"imp": "a", "t": 5, "x": [1.0], "ids": {"u": 1.5}}), "bad_ids"),
])
def test_bad_events_are_refused_with_their_reason(value: bytes, reason: str) -> None:
    with pytest.raises(JoinDecodeError) as err:
        decode_event(value)
    assert err.value.reason == reason


def test_max_pending_decides_the_oldest_early_and_later_feedback_is_late_for_it() -> None:
    d = Driver(JoinRules(window_ms=1000, lateness_ms=0, retain_ms=1000, max_pending=2))
    d.send("imp", "a", 0)
    d.send("imp", "b", 1)
    got = d.send("imp", "c", 2)
    assert [(o.kind, o.key) for o in got] == [("record", b"a")]
    assert len(d.state.pending) == 2 and d.state.counters["decided_early"] == 1
    got = d.send("fb", "a", 5)
    assert [(o.kind, o.reason) for o in got] == [("late", "decided_early")]


def test_negative_downsampling_keeps_the_same_negatives_and_weights_them() -> None:
    rate = 0.25
    d = Driver(JoinRules(window_ms=10, lateness_ms=0, retain_ms=10, max_pending=100_000, negative_rate=rate))
    for i in range(4000):
        d.send("imp", f"n{i}", i)
    d.tick(10_000)
    kept = [o for o in d.out if o.kind == "record"]
    assert {o.key for o in kept} == {f"n{i}".encode() for i in range(4000) if keep_negative(f"n{i}".encode(), rate)}
    assert 800 < len(kept) < 1200
    assert {msgpack.unpackb(o.value)["w"] for o in kept} == {4.0}
    c = d.state.counters
    assert c["negatives"] == 4000 and c["negatives_dropped"] == 4000 - len(kept) and c["joined"] == 4000


def _script(seed: int, n: int = 300) -> list[tuple[str, str, int]]:
    """A random interleaving of impressions, clicks (some late, some before their impression, some for an
    impression never seen), repeated ids, and events out of order within and beyond the lateness."""
    rng = random.Random(seed)
    events: list[tuple[int, str, str, int]] = []  # (when it is emitted, kind, id, event time)
    for i in range(n):
        t = i * 20
        emitted = t + (rng.randint(20, 120) if rng.random() < 0.1 else 0)  # some impressions arrive late
        events.append((emitted, "imp", f"i{i}", t))
        if rng.random() < 0.4:
            t_click = t + int(rng.expovariate(1 / 600))
            events.append((t_click if rng.random() < 0.8 else t + 5, "fb", f"i{i}", t_click))
        if rng.random() < 0.03:
            events.append((t + rng.randint(0, 50), "imp", f"i{i}", t + 1))  # a duplicate
        if rng.random() < 0.03:
            events.append((t, "fb", f"ghost{i}", t))
    events.sort()
    for k in range(len(events) - 1):
        if rng.random() < 0.1:
            events[k], events[k + 1] = events[k + 1], events[k]
    return [(kind, i, t) for _, kind, i, t in events]


def _changelog_view(records: dict[bytes, bytes], log: list[tuple[bytes, bytes | None]]) -> None:
    for key, value in log:
        if value is None:
            records.pop(key, None)
        else:
            records[key] = value


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_a_restore_from_the_changelog_anywhere_continues_as_if_never_interrupted(seed: int) -> None:
    rules = JoinRules(window_ms=500, lateness_ms=100, retain_ms=400, max_pending=50)
    script = _script(seed)
    whole = Driver(rules)
    for kind, i, t in script:
        whole.send(kind, i, t)
        whole.state.changelog()
    whole.tick(10**9)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(script)), 6))
    d = Driver(rules)
    records: dict[bytes, bytes] = {}
    out: list[Output] = []
    for k, (kind, i, t) in enumerate(script):
        if k in cuts:  # a commit, then a crash and a restore from the compacted changelog
            _changelog_view(records, d.state.changelog())
            out += d.out
            d = Driver(rules)
            d.state = TaskState.restore(rules, (IMP, FB), dict(records))
            d.offset = k
        d.send(kind, i, t)
        if k % 7 == 0:  # commits in between
            _changelog_view(records, d.state.changelog())
    d.tick(10**9)
    out += d.out

    def view(outputs: list[Output]) -> list[tuple[str, bytes, str, bytes | None]]:
        return sorted((o.kind, o.key, o.reason, o.value if o.kind == "record" else None) for o in outputs)

    assert view(out) == view(whole.out)
    assert d.state.counters == whole.state.counters
    assert not d.state.pending and not whole.state.pending


def test_the_changelog_forgets_what_the_watermark_made_useless() -> None:
    rules = JoinRules(window_ms=100, lateness_ms=0, retain_ms=100, max_pending=10_000)
    d = Driver(rules)
    records: dict[bytes, bytes] = {}
    for step in range(50):
        for j in range(20):
            t = step * 100 + j * 5
            d.send("imp", f"s{step}j{j}", t)
            if j % 3 == 0:
                d.send("fb", f"s{step}j{j}", t + 10)
        _changelog_view(records, d.state.changelog())
    d.tick(50 * 100 + 10)
    _changelog_view(records, d.state.changelog())
    # only batches still in reach of the watermark are kept: a few commits' worth, not fifty
    assert len([k for k in records if k.startswith(b"pend/")]) <= 4
    assert len(d.state.decided) <= 3 * 20


@pytest.mark.parametrize("features", [{"x": [1.0, 2.5]}, {"ids": {"a": [1, 2], "b": 3}},
                                      {"x": [0.1, -4.0, 0.0], "ids": {"f0": 5, "tags": []}}])
@pytest.mark.parametrize("y, w", [(0, None), (1, None), (0, 10.0), (0, 1 / 0.3)])
def test_a_labelled_record_is_the_impressions_features_with_y_and_w(features: dict, y: int, w: float | None) -> None:
    ev = decode_event(msgpack.packb({"imp": "a", "t": 5, **features}))
    assert isinstance(ev, Impression)
    want = {**features, "y": y, **({} if w is None else {"w": w})}
    assert labelled_record(ev.features, y, w) == msgpack.packb(want)
    assert json.loads(labelled_record(ev.features, y, w, "json")) == want
    record = decode_record(labelled_record(ev.features, y, w))  # what a trainer reads
    assert record.count == 1 and int(record.y[0]) == y
    assert (record.w is None) == (w is None)


def test_punctuation_decodes() -> None:
    ev = decode_event(encode_punctuation(123))
    assert ev.t_ms == 123
