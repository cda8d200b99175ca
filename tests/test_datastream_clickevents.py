"""The events source for the joiner: impressions and delayed clicks from the clicks stream, their order,
partitions and ground truth (pure), and ``streamtrain produce-events`` on the real broker."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.partitioner.default import murmur2

from datastream.clickevents import (
    FEEDBACK,
    IMPRESSION,
    ClickEvents,
    EventBlock,
    Truth,
    TruthRow,
    click_stream,
    imp_id,
    partition_of,
    partitions_of,
)
from datastream.clicks import BLOCK, ClickStream
from datastream.events_producer import produce_events
from datastream.join.events import Feedback, Impression, Punctuation, decode_event, encode_impression, key_of
from datastream.sources import TEST_EVERY
from streamtrain.cli import main

SMALL = ClickStream(features=4, dense=3, vocab=4000, multi=3, seed=5)
"""A small stream with single IDs, dense features and a multi-hot feature."""


def collect(events: ClickEvents, limit: int | None, fmt: str = "msgpack") -> EventBlock:
    """All the events of ``limit`` impressions in emission order, as one block."""
    blocks = list(events.blocks(limit, fmt=fmt))  # type: ignore[arg-type]  # the formats are checked at run time
    return EventBlock(*(np.concatenate([getattr(b, name) for b in blocks]) for name in
                        ("kind", "index", "t_ms", "partition", "keys", "values")))


def labels_of(stream: ClickStream, limit: int) -> np.ndarray:
    return np.concatenate([block.y for _, block in stream.blocks(limit)])


def test_the_same_fields_give_the_same_events_and_a_shorter_run_is_their_prefix() -> None:
    events = ClickEvents(stream=SMALL, seed=3, rate_per_s=2000.0)
    a, b = collect(events, 20_000), collect(events, 20_000)
    for name in ("kind", "index", "t_ms", "partition", "keys", "values"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    other = collect(replace(events, seed=4), 20_000)
    assert not np.array_equal(a.t_ms[a.kind == FEEDBACK], other.t_ms[other.kind == FEEDBACK])  # other delays
    assert np.array_equal(a.t_ms[a.kind == IMPRESSION], other.t_ms[other.kind == IMPRESSION])  # same impressions
    short = collect(events, 12_345)
    keep = a.index < 12_345
    for name in ("kind", "index", "t_ms", "values"):
        assert np.array_equal(getattr(short, name), getattr(a, name)[keep]), name


def test_without_disorder_events_come_in_event_time_order_with_one_click_per_positive() -> None:
    events = ClickEvents(stream=SMALL, rate_per_s=500.0, start_ms=1_000_000, delay_mean_s=2.0)
    limit = 2 * BLOCK + 1000
    ev = collect(events, limit)
    assert np.all(np.diff(ev.t_ms) >= 0)
    imps = ev.kind == IMPRESSION
    assert np.array_equal(np.sort(ev.index[imps]), np.arange(limit))  # every impression once
    assert np.array_equal(ev.t_ms[imps], 1_000_000 + np.arange(limit) * 2)  # in record order, 2 ms apart
    y = labels_of(SMALL, limit)
    clicked = ev.index[ev.kind == FEEDBACK]
    assert len(clicked) == len(np.unique(clicked)) == int(y.sum()) > 0  # one click per positive, none else
    assert np.all(y[clicked] == 1)
    delays = ev.t_ms[ev.kind == FEEDBACK] - (1_000_000 + clicked * 2)
    assert delays.min() >= 0 and 1800 < delays.mean() < 2200  # exponential, mean 2 s (a fixed seed)
    # a click at the same ms as an impression comes after it
    same = np.flatnonzero(np.diff(ev.t_ms) == 0)
    assert not np.any((ev.kind[same] == FEEDBACK) & (ev.kind[same + 1] == IMPRESSION))


def test_the_train_split_leaves_out_the_held_out_records_and_their_clicks() -> None:
    """With ``train_split`` the test split (what ``load_source("clicks", split="test")`` scores) makes no
    impression and no click; every other event is the one the whole stream makes, and so is the truth."""
    events = ClickEvents(stream=SMALL, seed=5)
    whole, train = collect(events, 5000), collect(replace(events, train_split=True), 5000)
    held_out = whole.index % TEST_EVERY == TEST_EVERY - 1
    assert held_out.any() and not np.any(train.index % TEST_EVERY == TEST_EVERY - 1)
    for name in ("kind", "index", "t_ms", "values"):
        assert np.array_equal(getattr(train, name), getattr(whole, name)[~held_out]), name
    truth, kept = events.truth(5.0, 5000), replace(events, train_split=True).truth(5.0, 5000)
    mask = truth.index % TEST_EVERY != TEST_EVERY - 1
    assert np.array_equal(kept.index, truth.index[mask]) and np.array_equal(kept.label, truth.label[mask])


def test_with_disorder_no_event_is_emitted_after_one_more_than_disorder_ms_later() -> None:
    disorder = 800
    events = ClickEvents(stream=SMALL, rate_per_s=1000.0, disorder_ms=disorder, seed=2)
    ev = collect(events, 3 * BLOCK)
    later_seen = np.maximum.accumulate(ev.t_ms)
    displaced = later_seen - ev.t_ms
    assert displaced.max() <= disorder
    assert displaced.max() > disorder // 2 and np.count_nonzero(displaced) > len(ev) // 4  # really out of order
    ordered = collect(replace(events, disorder_ms=0), 3 * BLOCK)  # the same events, in another order
    assert sorted(zip(ev.kind.tolist(), ev.index.tolist(), ev.t_ms.tolist())) == \
        sorted(zip(ordered.kind.tolist(), ordered.index.tolist(), ordered.t_ms.tolist()))
    # some clicks even come before their impression: the joiner's early feedback
    first_imp = {i: n for n, (k, i) in enumerate(zip(ev.kind.tolist(), ev.index.tolist())) if k == IMPRESSION}
    assert any(n < first_imp[i] for n, (k, i) in enumerate(zip(ev.kind.tolist(), ev.index.tolist())) if k == FEEDBACK)


def test_events_decode_as_the_joiners_and_sit_on_their_keys_partitions() -> None:
    events = ClickEvents(stream=SMALL, partitions=7)
    for fmt in ("msgpack", "json"):
        ev = collect(events, 3000, fmt)
        for kind, index, t, part, key, value in zip(ev.kind.tolist(), ev.index.tolist(), ev.t_ms.tolist(),
                                                    ev.partition.tolist(), ev.keys, ev.values):
            decoded = decode_event(value)
            assert isinstance(decoded, Impression if kind == IMPRESSION else Feedback)
            assert (decoded.imp, decoded.t_ms) == (key_of(imp_id(index)), t) and key == decoded.imp
            assert part == (murmur2(key) & 0x7FFFFFFF) % 7  # kafka-python's default partitioner
            if kind == FEEDBACK:
                assert (decoded.label, decoded.value) == ("click", 1.0)
    # the impression carries the record's features, as encode_impression writes them
    first = next(SMALL.blocks(1))[1]
    ids = {name: (col.values[0].item() if name != "tags" else col.values[:col.offsets[1]].tolist())
           for name, col in first.ids.items()}
    ev = collect(events, 1)
    assert ev.values[0] == encode_impression("i0", events.start_ms, first.x[0].tolist(), ids)
    dense_only = collect(ClickEvents(stream=ClickStream(features=0, dense=2)), 1)
    assert set(msgpack.unpackb(dense_only.values[0])) == {"imp", "t", "x"}  # no ids without categorical features


def test_the_vectorised_partitioner_is_kafka_pythons() -> None:
    rng = np.random.default_rng(0)
    keys = [imp_id(i).encode() for i in range(0, 300_000, 13)] + \
        [rng.bytes(int(n)) for n in rng.integers(0, 40, 2000)] + ["é✓".encode()]
    for partitions in (1, 2, 3, 4, 12, 1000):
        assert partitions_of(keys, partitions).tolist() == [partition_of(k, partitions) for k in keys]
        assert all(partition_of(k, partitions) == (murmur2(k) & 0x7FFFFFFF) % partitions for k in keys[:50])


def test_truth_labels_follow_the_delays_and_the_window() -> None:
    events = ClickEvents(stream=SMALL, delay_mean_s=3.0, seed=9)
    ev = collect(events, 10_000)
    clicks = dict(zip(ev.index[ev.kind == FEEDBACK].tolist(), ev.t_ms[ev.kind == FEEDBACK].tolist()))
    delays = sorted(clicks[i] - events.start_ms - i for i in clicks)
    window_s = delays[len(delays) // 2] / 1000.0  # a window exactly as long as one delay: that click is in
    truth = events.truth(window_s, 10_000)
    assert len(truth) == 10_000 and truth.index.tolist() == list(range(10_000))
    for row in truth:
        i = int(row.imp[1:])
        assert row.t_ms == events.start_ms + i and row.click_ms == clicks.get(i)
        assert row.label == int(i in clicks and clicks[i] - row.t_ms <= window_s * 1000)
    assert 0 < int(truth.label.sum()) < len(clicks)  # some clicks came too late for the window
    assert events.truth(1e6, 10_000).label.sum() == len(clicks) and events.truth(0.0, 10_000).label.sum() < 10
    assert events.truth(window_s, 0).index.size == 0


def test_truth_files_round_trip_and_select_what_was_sent(tmp_path: Path) -> None:
    truth = ClickEvents(stream=SMALL).truth(5.0, 500)
    path = tmp_path / "truth.jsonl"
    truth.write(path)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"imp", "t", "click", "label"} and first["imp"] == "i0"
    back = Truth.read(path)
    assert list(back) == list(truth) and isinstance(next(iter(back)), TruthRow)
    assert back.labels() == {row.imp: row.label for row in truth}
    clicked = truth.index[truth.click_ms >= 0]
    part = truth.select(np.arange(0, 500, 2), clicked[::2])
    assert part.index.tolist() == list(range(0, 500, 2))
    kept = set(clicked[::2].tolist())
    for row in part:
        i = int(row.imp[1:])
        assert row.click_ms is None if i not in kept else row.click_ms == truth.click_ms[i]
        assert row.label == (truth.label[i] if i in kept else 0)
    (tmp_path / "bad.jsonl").write_text('{"imp": "i0", "t": 1, "click": null, "label": 0}\n{"imp": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a truth row"):
        Truth.read(tmp_path / "bad.jsonl")


def test_bad_fields_and_specs_are_refused_by_name() -> None:
    for bad, match in (({"rate_per_s": 0.0}, "rate_per_s"), ({"delay_mean_s": float("nan")}, "delay_mean_s"),
                       ({"disorder_ms": -1}, "disorder_ms"), ({"partitions": 0}, "partitions"),
                       ({"start_ms": -5}, "start_ms"), ({"seed": -1}, "seed")):
        with pytest.raises(ValueError, match=match):
            ClickEvents(**bad)
    with pytest.raises(ValueError, match="limit"):
        next(ClickEvents().blocks(-1))
    with pytest.raises(ValueError, match="format"):
        next(ClickEvents().blocks(5, fmt="xml"))  # type: ignore[arg-type]  # refused at run time
    with pytest.raises(ValueError, match="window_s"):
        ClickEvents().truth(-1.0, 5)
    assert click_stream("clicks?features=3&dense=2&multi=4&zipf=1.3&seed=7") == \
        ClickStream(features=3, dense=2, multi=4, zipf=1.3, seed=7)
    assert click_stream("clicks") == ClickStream()
    for spec, match in (("digits", "clicks stream"), ("clicks?colour=red", "colour"),
                        ("clicks?features=x", "features"), ("clicks?features=0&dense=0", "some features")):
        with pytest.raises(ValueError, match=match):
            click_stream(spec)


def read_all(bootstrap: str, topic: str, partitions: int) -> dict[int, list[tuple[bytes | None, bytes]]]:
    """Every message of ``topic``, per partition, in offset order."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        out: dict[int, list[tuple[bytes | None, bytes]]] = {p: [] for p in range(partitions)}
        deadline = time.monotonic() + 60
        while any(len(out[tp.partition]) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"read {[len(v) for v in out.values()]} of {ends}"
            for tp, msgs in consumer.poll(timeout_ms=500).items():
                out[tp.partition].extend((m.key, m.value) for m in msgs)
        return out
    finally:
        consumer.close()


@pytest.mark.timeout(180)
def test_produce_events_writes_both_topics_the_punctuation_and_the_truth(kafka, tmp_path: Path, capsys) -> None:
    imps_topic, fb_topic = f"imps-{time.monotonic_ns()}", f"clicks-{time.monotonic_ns()}"
    truth_path = tmp_path / "truth.jsonl"
    limit, partitions = 3000, 3
    stream = "clicks?features=4&dense=3&vocab=4000&multi=3&seed=5"  # SMALL
    code = main(["produce-events", "--bootstrap", kafka.bootstrap, "--impressions", imps_topic, "--feedback",
                 fb_topic, "--partitions", str(partitions), "--stream", stream, "--limit", str(limit),
                 "--start-ms", "1700000000000", "--seed", "11", "--delay-mean-s", "2", "--disorder-ms", "300",
                 "--truth", str(truth_path), "--window-s", "4", "--final-watermark-s", "60"])
    assert code == 0
    events = ClickEvents(stream=SMALL, start_ms=1_700_000_000_000, seed=11, delay_mean_s=2.0, disorder_ms=300,
                         partitions=partitions)
    truth = events.truth(4.0, limit)
    clicks = int((truth.click_ms >= 0).sum())
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"produced {limit} impressions to {imps_topic} and {clicks} feedback events to "
                           f"{fb_topic} ({partitions} partitions) in "), line
    assert "; failed 0; truth of 3000 impressions in " in line
    assert list(Truth.read(truth_path)) == list(truth)
    last = int(max(truth.t_ms.max(), truth.click_ms.max()))
    for topic, kind, want in ((imps_topic, Impression, limit), (fb_topic, Feedback, clicks)):
        messages = read_all(kafka.bootstrap, topic, partitions)
        seen: list[bytes] = []
        for p, msgs in messages.items():
            *body, (mark_key, mark) = msgs
            assert mark_key is None and decode_event(mark) == Punctuation(last + 60_000)  # last on the partition
            for key, value in body:
                event = decode_event(value)
                assert isinstance(event, kind) and event.imp == key and partition_of(key, partitions) == p
                seen.append(key)
        assert len(seen) == len(set(seen)) == want
        if kind is Impression:
            assert set(seen) == {key_of(imp_id(i)) for i in range(limit)}
        else:
            assert set(seen) == {key_of(row.imp) for row in truth if row.click_ms is not None}
    # the partitions are those kafka-python's default partitioner picks for the keys
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
    try:
        for i in range(0, limit, 97):
            key = key_of(imp_id(i))
            assert producer.send(imps_topic, b"x", key=key).get(timeout=30).partition == partition_of(key, partitions)
    finally:
        producer.close()


@pytest.mark.timeout(180)
def test_a_stopped_run_writes_no_punctuation_and_the_truth_of_what_it_sent(kafka, tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    report = produce_events(kafka.bootstrap, f"imps-{time.monotonic_ns()}", f"clicks-{time.monotonic_ns()}",
                            ClickEvents(stream=SMALL), limit=100, partitions=2, stop=stop,
                            truth_path=tmp_path / "t.jsonl")
    assert (report.impressions, report.feedback, report.punctuations, report.failed) == (0, 0, 0, 0)
    assert report.interrupted and report.watermark_ms is None and report.truth_rows == 0
    assert (tmp_path / "t.jsonl").read_text() == ""
    with pytest.raises(ValueError, match="topics of their own"):
        produce_events(kafka.bootstrap, "same", "same", ClickEvents(), limit=1, partitions=1)
    other = kafka.create_topic(partitions=2)
    with pytest.raises(ValueError, match="must partition alike"):
        produce_events(kafka.bootstrap, kafka.create_topic(partitions=3), other, ClickEvents(), limit=1, partitions=3)
