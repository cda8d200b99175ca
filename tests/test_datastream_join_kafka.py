"""``streamtrain join`` on the real broker: every impression reaches the training topic exactly once with the
label its feedback gives, through kill -9 at random points (mid-transaction included), out-of-order events,
two joiners splitting the partitions with one killed, and bad input dead-lettered by reason."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from datastream import dlq_topic, parse_dlq_headers
from datastream.clickevents import ClickEvents, Truth
from datastream.clicks import ClickStream
from datastream.events_producer import EventsReport, produce_events
from datastream.join.events import encode_feedback, encode_impression, encode_punctuation
from streamtrain.launcher import wait_until

STREAM = ClickStream(features=4, dense=3, vocab=5000, seed=1)
"""A small click stream (about 38 % clicked)."""
WINDOW_S = 5.0
"""The join window of these tests; clicks come after an exponential delay of mean 2 s, so some are late."""


@dataclass(frozen=True)
class Topics:
    """One join's topics and its name."""

    impressions: str
    feedback: str
    train: str
    late: str
    app: str


def topics(kafka: Any, partitions: int) -> Topics:
    """Fresh input topics of ``partitions`` partitions each; the joiner makes the others."""
    tag = uuid.uuid4().hex[:10]
    return Topics(kafka.create_topic(partitions, prefix="imps"), kafka.create_topic(partitions, prefix="fb"),
                  f"train-{tag}", f"late-{tag}", f"join-{tag}")


class Joiner:
    """One ``streamtrain join`` process, its output (stdout and log) in a file."""

    def __init__(self, kafka: Any, t: Topics, log: Path, *flags: str, instance: str = "a") -> None:
        self.log_path = log
        cmd = [sys.executable, "-m", "streamtrain.cli", "join", "--bootstrap", kafka.bootstrap,
               "--impressions", t.impressions, "--feedback", t.feedback, "--topic", t.train, "--late", t.late,
               "--app-id", t.app, "--instance-id", instance, "--window-s", str(WINDOW_S),
               "--allowed-lateness-s", "0.5", "--retain-s", "120", "--session-timeout-s", "6",
               "--transaction-timeout-s", "10", "--commit-interval-ms", "50", *flags]
        self._out = open(log, "a", encoding="utf-8")  # noqa: SIM115 - closed when the process is reaped
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore"})

    def log(self) -> str:
        """What it printed so far."""
        return self.log_path.read_text(encoding="utf-8")

    def kill(self) -> None:
        """kill -9, and reap it."""
        self.proc.kill()
        self.proc.wait(30)
        self._out.close()

    def stop(self) -> str:
        """SIGTERM (it commits what it joined), wait; its last line (the counts)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(90)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)
            self._out.close()
        text = self.log()
        assert code == 0, text[-4000:]
        return [line for line in text.splitlines() if line.startswith("joined ")][-1]

    def stacks(self) -> str:
        """Its log with every thread's stack at its end (``kill -USR1``): what a joiner that hangs is doing."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        return self.log()[-12000:]

    def partitions(self) -> list[int] | None:
        """The partitions it said it joins last, or None before it said so."""
        found = re.findall(r"joining partitions \[([0-9, ]*)\]", self.log())
        return None if not found else [int(p) for p in found[-1].split(",") if p.strip()]

    def cleanup(self) -> None:
        """Kill it if it still runs (a failed test); its output file closed either way."""
        if self.proc.poll() is None:
            self.kill()
        self._out.close()


def read(bootstrap: str, topic: str, *, committed: bool = True) -> list[Any]:
    """Every message of ``topic`` (its committed ones by default), up to its end now."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             isolation_level="read_committed" if committed else "read_uncommitted")
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return []
        ends = consumer.end_offsets(tps)
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out: list[Any] = []
        deadline = time.monotonic() + 60
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"could not read {topic} to {ends}"
            for msgs in consumer.poll(timeout_ms=500).values():
                out += msgs
        return out
    finally:
        consumer.close()


def stable_end(bootstrap: str, topic: str) -> int:
    """The sum of ``topic``'s last stable offsets (it grows with every committed transaction)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        return sum(consumer.end_offsets([TopicPartition(topic, p) for p in parts]).values()) if parts else 0
    finally:
        consumer.close()


def labels(bootstrap: str, topic: str) -> tuple[dict[str, int], list[str]]:
    """Impression id -> its label as the training topic holds it (committed), and every id in order read."""
    keys: list[str] = []
    out: dict[str, int] = {}
    for m in read(bootstrap, topic):
        record = msgpack.unpackb(m.value)
        key = m.key.decode()
        keys.append(key)
        out[key] = record["y"]
        assert set(record) <= {"x", "ids", "y", "w"}, record
    return out, keys


class Production:
    """produce_events on a thread of its own, with the ground truth written at the end."""

    def __init__(self, kafka: Any, t: Topics, events: ClickEvents, limit: int, truth: Path, *,
                 rate: float | None) -> None:
        self.truth_path = truth
        self.report: EventsReport | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.report = produce_events(kafka.bootstrap, t.impressions, t.feedback, events, limit=limit,
                                             partitions=events.partitions, rate=rate, final_watermark_s=60.0,
                                             truth_path=truth, window_s=WINDOW_S)
            except BaseException as exc:  # noqa: BLE001 - the test raises it
                self.error = exc

        self.thread = threading.Thread(target=run, name="produce-events")
        self.thread.start()

    def done(self) -> bool:
        """True once production ended (raising what it raised)."""
        if self.thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True

    def truth(self) -> Truth:
        """The ground truth, once done."""
        self.thread.join(120)
        assert self.done() and self.report is not None and self.report.failed == 0, self.report
        return Truth.read(self.truth_path)


def wait_joined(bootstrap: str, topic: str, expected: int, joiners: list[Joiner], timeout_s: float = 120) -> None:
    """Until the training topic holds ``expected`` committed records (while the joiners run)."""
    def enough() -> bool:
        for j in joiners:
            assert j.proc.poll() is None, f"the joiner exited with {j.proc.returncode}:\n{j.log()[-4000:]}"
        return len(read(bootstrap, topic)) >= expected

    wait_until(enough, timeout_s, interval_s=1.0, what=f"{expected} records on {topic}")


def counts(line: str, what: str) -> dict[str, int]:
    """``late: a 1, b 2`` or ``dead letters: ...`` of a joiner's last line, by reason."""
    part = re.search(rf"{what}: ([^;]*)", line)
    assert part, line
    return {} if part[1].strip() == "none" else {k: int(v) for k, v in
                                                 (item.rsplit(" ", 1) for item in part[1].split(", "))}


def late_clicks(truth: Truth) -> set[str]:
    """Impressions whose click came after the window."""
    return {row.imp for row in truth if row.click_ms is not None and row.label == 0}


@pytest.mark.timeout(420)
def test_kill_9_at_random_points_leaves_every_impression_once_with_its_true_label(kafka, tmp_path: Path) -> None:
    """Events arrive for about 40 s while the joiner is killed four times, each a moment after it committed
    (so mid-transaction), and restarted: read committed, the training topic holds each impression once,
    labelled as the ground truth says; the late feedback is on the late topic once each and counted exactly;
    and killed transactions did write records that no committed read sees."""
    t = topics(kafka, 3)
    limit = 12_000
    events = ClickEvents(stream=STREAM, rate_per_s=1000.0, delay_mean_s=2.0, seed=7, partitions=3)
    production = Production(kafka, t, events, limit, tmp_path / "truth.jsonl", rate=400.0)
    rng = random.Random(20261206)
    log = tmp_path / "join.log"
    joiner: Joiner | None = None
    killed_at: list[int] = []
    try:
        for _ in range(4):
            joiner = Joiner(kafka, t, log)
            before = stable_end(kafka.bootstrap, t.train)

            def progressed(j: Joiner = joiner, mark: int = before) -> bool:
                assert j.proc.poll() is None, j.log()[-4000:]
                return stable_end(kafka.bootstrap, t.train) > mark

            wait_until(progressed, 90, interval_s=0.2, what="the joiner to commit")
            time.sleep(rng.uniform(0.0, 0.5))
            joiner.kill()
            killed_at.append(stable_end(kafka.bootstrap, t.train))
        assert not production.done(), "the events ended before the last kill: slow them down"
        joiner = Joiner(kafka, t, log)
        truth = production.truth()
        wait_joined(kafka.bootstrap, t.train, len(truth), [joiner])
        time.sleep(1.0)  # anything more (a duplicate) would be committed by now
        line = joiner.stop()
    finally:
        if joiner is not None:
            joiner.cleanup()
        production.thread.join(120)
    got, keys = labels(kafka.bootstrap, t.train)
    assert len(keys) == len(got) == len(truth), (len(keys), len(got), len(truth))  # each exactly once
    assert got == truth.labels()
    late = read(kafka.bootstrap, t.late)
    late_keys = [m.key.decode() for m in late]
    assert len(late_keys) == len(set(late_keys)) and set(late_keys) == late_clicks(truth)
    assert {dict(m.headers)["join.reason"] for m in late} == {b"outside_window"}
    assert counts(line, "late") == {"outside_window": len(late_clicks(truth))}
    assert counts(line, "dead letters") == {}
    assert f"joined {len(truth)} impressions ({int(truth.label.sum())} positive" in line, line
    assert killed_at[0] > 0 and len(set(killed_at)) == 4  # killed while it made progress, four times
    aborted = len(read(kafka.bootstrap, t.train, committed=False)) - len(keys)
    assert aborted > 0  # the killed transactions had written records: mid-transaction


@pytest.mark.timeout(300)
def test_out_of_order_events_join_within_the_allowed_lateness_and_are_late_beyond_it(kafka, tmp_path: Path) -> None:
    """Events displaced by up to 3 s of event time: a join allowing 3 s of lateness labels every impression as
    the truth says; one allowing none mislabels exactly the impressions whose click it counted late after
    deciding them, or dead-lettered because the watermark passed it before its impression came."""
    t = topics(kafka, 2)
    limit = 6000
    events = ClickEvents(stream=STREAM, rate_per_s=1000.0, delay_mean_s=2.0, disorder_ms=3000, seed=3, partitions=2)
    production = Production(kafka, t, events, limit, tmp_path / "truth.jsonl", rate=None)
    truth = production.truth()
    strict = Topics(t.impressions, t.feedback, t.train + "-strict", t.late + "-strict", t.app + "-strict")
    patient = Joiner(kafka, t, tmp_path / "patient.log", "--allowed-lateness-s", "3")
    hasty = Joiner(kafka, strict, tmp_path / "hasty.log", "--allowed-lateness-s", "0")
    try:
        wait_joined(kafka.bootstrap, t.train, len(truth), [patient, hasty])
        wait_joined(kafka.bootstrap, strict.train, len(truth), [patient, hasty])
        patient_line, hasty_line = patient.stop(), hasty.stop()
    finally:
        patient.cleanup()
        hasty.cleanup()
    got, keys = labels(kafka.bootstrap, t.train)
    assert len(keys) == len(truth) and got == truth.labels()
    assert counts(patient_line, "late") == {"outside_window": len(late_clicks(truth))}
    assert counts(patient_line, "dead letters") == {}

    got, keys = labels(kafka.bootstrap, strict.train)
    assert len(keys) == len(got) == len(truth)
    wrong = {k for k, y in got.items() if y != truth.labels()[k]}
    late = read(kafka.bootstrap, strict.late)
    after = {m.key.decode() for m in late if dict(m.headers)["join.reason"] == b"after_decision"}
    unknown = {msgpack.unpackb(m.value)["imp"] for m in read(kafka.bootstrap, dlq_topic(t.feedback))
               if parse_dlq_headers(m.headers).reason == "unknown_impression"}  # keyed by where they came from
    positives = {k for k, y in truth.labels().items() if y == 1}
    assert wrong and wrong == after | (unknown & positives)  # every mislabel accounted for, by its reason
    assert all(got[k] == 0 for k in wrong) and after <= positives
    assert counts(hasty_line, "late") == {"after_decision": len(after),
                                          "outside_window": len(late_clicks(truth) - unknown)}
    assert counts(hasty_line, "dead letters") == {"unknown_impression": len(unknown)}


@pytest.mark.timeout(420)
def test_two_joiners_split_the_partitions_and_one_killed_hands_its_own_over(kafka, tmp_path: Path) -> None:
    """Two joiners of one join split four partitions; one is killed mid-stream: the other takes its
    partitions (once the group and the broker have let go of the dead one) and every impression is on the
    training topic once, with its true label."""
    t = topics(kafka, 4)
    limit = 10_000
    events = ClickEvents(stream=STREAM, rate_per_s=1000.0, delay_mean_s=2.0, seed=11, partitions=4)
    production = Production(kafka, t, events, limit, tmp_path / "truth.jsonl", rate=500.0)
    a = Joiner(kafka, t, tmp_path / "a.log", instance="a")
    b = Joiner(kafka, t, tmp_path / "b.log", instance="b")
    try:
        def split() -> bool:
            for j in (a, b):
                assert j.proc.poll() is None, j.log()[-4000:]
            pa, pb = a.partitions(), b.partitions()
            return bool(pa) and bool(pb) and sorted((pa or []) + (pb or [])) == [0, 1, 2, 3]

        try:
            wait_until(split, 90, interval_s=0.5, what="the joiners to split the partitions")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n--- a:\n{a.stacks()}\n--- b:\n{b.stacks()}") from exc
        mine = b.partitions()
        before = stable_end(kafka.bootstrap, t.train)
        wait_until(lambda: stable_end(kafka.bootstrap, t.train) > before + 200, 60, interval_s=0.2,
                   what="both to join")
        b.kill()
        assert not production.done()
        wait_until(lambda: a.partitions() == [0, 1, 2, 3], 90, interval_s=0.5, what="a to take b's partitions")
        truth = production.truth()
        wait_joined(kafka.bootstrap, t.train, len(truth), [a])
        time.sleep(1.0)
        line = a.stop()
    finally:
        a.cleanup()
        b.cleanup()
        production.thread.join(120)
    assert mine and set(mine) < {0, 1, 2, 3}
    got, keys = labels(kafka.bootstrap, t.train)
    assert len(keys) == len(got) == len(truth) and got == truth.labels()
    assert "on partitions [0, 1, 2, 3]" in line and counts(line, "late") == {"outside_window": len(late_clicks(truth))}
    late_keys = [m.key.decode() for m in read(kafka.bootstrap, t.late)]
    assert sorted(late_keys) == sorted(late_clicks(truth))


@pytest.mark.timeout(180)
def test_bad_events_go_to_their_topic_s_dead_letters_by_reason_and_the_good_ones_join(kafka, tmp_path: Path) -> None:
    """An impression without an id, without an event time, with NaN features, with a repeated id, and feedback
    for an impression never seen: each in the dead-letter topic of its input, with its reason and where it
    came from, counted; the impressions accepted before and after them are joined, the first of a repeated id
    kept."""
    t = topics(kafka, 1)
    base = 1_700_000_000_000
    imps: list[bytes] = [
        encode_impression("a", base, [1.0, 2.0]),
        msgpack.packb({"t": base + 1, "x": [1.0]}),                  # no_id
        json.dumps({"imp": "c", "x": [1.0, 2.0]}).encode(),           # no_event_time
        msgpack.packb({"imp": "d", "t": base + 3, "x": [float("nan"), 1.0]}),  # non_finite
        encode_impression("a", base + 4, [3.0, 4.0]),                 # duplicate_impression
        encode_impression("b", base + 5, [5.0, 6.0]),
        b"\xc1 not an event",                                          # bad_event
    ]
    fbs = [encode_feedback("a", base + 1000), encode_feedback("ghost", base + 50_000)]
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    try:
        for value in imps:
            producer.send(t.impressions, value, key=b"k", partition=0)
        for value in fbs:
            producer.send(t.feedback, value, key=b"k", partition=0)
        for topic in (t.impressions, t.feedback):
            producer.send(topic, encode_punctuation(base + 600_000), partition=0)
        producer.flush()
    finally:
        producer.close()
    joiner = Joiner(kafka, t, tmp_path / "join.log")
    try:
        wait_joined(kafka.bootstrap, t.train, 2, [joiner])
        wait_until(lambda: len(read(kafka.bootstrap, dlq_topic(t.feedback))) >= 1, 60, what="the ghost dead letter")
        line = joiner.stop()
    finally:
        joiner.cleanup()
    records = {m.key.decode(): msgpack.unpackb(m.value) for m in read(kafka.bootstrap, t.train)}
    assert records == {"a": {"x": [1.0, 2.0], "y": 1}, "b": {"x": [5.0, 6.0], "y": 0}}
    dead = [(parse_dlq_headers(m.headers), m.value) for m in read(kafka.bootstrap, dlq_topic(t.impressions))]
    assert [(e.reason, e.offset, value) for e, value in dead] == [
        ("no_id", 1, imps[1]), ("no_event_time", 2, imps[2]), ("non_finite", 3, imps[3]),
        ("duplicate_impression", 4, imps[4]), ("bad_event", 6, imps[6])]
    assert all(e.topic == t.impressions and e.partition == 0 for e, _ in dead)
    assert "impression b'a' was seen already" in dead[3][0].error
    ghost = [(parse_dlq_headers(m.headers), m.value) for m in read(kafka.bootstrap, dlq_topic(t.feedback))]
    assert [(e.reason, e.offset, value) for e, value in ghost] == [("unknown_impression", 1, fbs[1])]
    assert counts(line, "dead letters") == {"bad_event": 1, "duplicate_impression": 1, "no_event_time": 1,
                                            "no_id": 1, "non_finite": 1, "unknown_impression": 1}
