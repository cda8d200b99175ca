"""The data plane on the real broker: produce, consume, offsets, foreign clients, DLQ, shutdown."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
import torch
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from datastream import (
    MAX_IDS_PER_FEATURE,
    Batch,
    Jagged,
    ProduceReport,
    ShardConsumer,
    decode_record,
    dlq_topic,
    encode_json_record,
    encode_msgpack_record,
    encode_shard,
    ensure_topic,
    hash_id,
    load_source,
    parse_dlq_headers,
    produce,
)
from datastream.consumer import PARTITION_FETCH_BYTES
from streamtrain.launcher import wait_until


def drain(consumer: ShardConsumer, ends: dict[int, int], timeout_s: float = 60.0) -> list[Batch]:
    """Poll until the batches cover every partition of ``ends`` up to its end offset."""
    batches: list[Batch] = []
    reached: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while any(reached.get(p, -1) < end for p, end in ends.items() if end > 0):
        assert time.monotonic() < deadline, f"timed out at {reached}, want {ends}"
        batch = consumer.poll(1.0)
        if batch is not None:
            batches.append(batch)
            reached.update(batch.next_offsets)
    return batches


def check_chains(batches: list[Batch], starts: dict[int, int], ends: dict[int, int]) -> None:
    """Each partition's ranges start at ``starts``, chain without gap or overlap, end at ``ends``."""
    position = dict(starts)
    for batch in batches:
        for p, (first, nxt) in batch.offsets.items():
            assert first == position[p] and nxt > first, (p, first, nxt, position[p])
            position[p] = nxt
    assert {p: o for p, o in position.items() if o != starts[p] or ends.get(p)} == \
        {p: ends[p] for p in position if ends.get(p, starts[p]) != starts[p]}


def seqs(batches: list[Batch]) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for b in batches:
        for producer, first, count in b.samples:
            out.update((producer, s) for s in range(first, first + count))
    return out


def plain_producer(kafka) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")


def test_produce_digits_and_consume_every_record_once(kafka) -> None:
    topic = f"digits-{time.monotonic_ns()}"
    report = produce(kafka.bootstrap, topic, "digits", partitions=3, shard_size=100, producer_id="prod-a")
    assert (report.records, report.shards, report.failed_records, report.partitions) == (1797, 18, 0, 3)
    assert report.next_seq == 1797 and not report.interrupted
    x_all, y_all = load_source("digits").read()
    with ShardConsumer(kafka.bootstrap, topic, max_records_per_batch=256, prefetch=2) as consumer:
        ends = consumer.end_offsets()
        assert ends == {0: 6, 1: 6, 2: 6}
        consumer.assign({0: None, 1: None, 2: None})
        batches = drain(consumer, ends)
        assert consumer.stats().records == 1797 and consumer.stats().rejected_records == 0
    check_chains(batches, {0: 0, 1: 0, 2: 0}, ends)
    assert seqs(batches) == Counter({("prod-a", s): 1 for s in range(1797)})
    assert len({p for b in batches for p in b.offsets}) == 3
    for b in batches:
        assert b.x.dtype == torch.float32 and b.y.dtype == torch.int64 and b.x.shape[1] == 64
        assert 0 < len(b) <= 256 and b.rejected == 0 and b.produced_ts_ms > 0
        row = 0
        for _, first, count in b.samples:  # rows line up with their sequence numbers
            np.testing.assert_array_equal(b.x[row:row + count].numpy(), x_all[first:first + count])
            np.testing.assert_array_equal(b.y[row:row + count].numpy(), y_all[first:first + count])
            row += count
        assert row == len(b)


def test_a_shard_larger_than_a_partition_fetch_comes_whole(kafka) -> None:
    topic = f"wide-{time.monotonic_ns()}"
    report = produce(kafka.bootstrap, topic, "synthetic?features=784&classes=10&seed=4", partitions=1,
                     shard_size=2000, limit=4000, split="train")
    assert (report.records, report.shards) == (4000, 2)
    with ShardConsumer(kafka.bootstrap, topic, max_records_per_batch=2000, prefetch=2) as consumer:
        ends = consumer.end_offsets()
        consumer.assign({0: None})
        batches = drain(consumer, ends)
    assert PARTITION_FETCH_BYTES < 784 * 4 * 2000  # each shard is larger than one fetch asks for
    assert [len(b) for b in batches] == [2000, 2000] and all(b.x.shape == (2000, 784) for b in batches)
    check_chains(batches, {0: 0}, ends)


def test_ensure_topic_creates_with_configs_keeps_what_exists_and_waits_for_a_new_topic_s_partitions(kafka) -> None:
    tag = time.monotonic_ns()
    compacted, racing = f"compacted-{tag}", f"racing-{tag}"
    assert ensure_topic(kafka.bootstrap, compacted, 2, configs={"cleanup.policy": "compact"}) == 2
    assert ensure_topic(kafka.bootstrap, compacted, 5) == 2  # an existing topic keeps its partitions
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap, client_id="tests")
    try:
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, compacted)])
        assert configs["topic"][compacted]["cleanup.policy"]["value"] == "compact"
        # another process creates a topic and does not wait for its metadata: our call still sees its partitions
        admin.create_topics({racing: {"num_partitions": 3, "replication_factor": 1}}, wait_for_metadata=False)
        assert ensure_topic(kafka.bootstrap, racing, 1) == 3
    finally:
        admin.close()
    with pytest.raises(ValueError, match="partitions must be >= 1"):
        ensure_topic(kafka.bootstrap, compacted, 0)


def test_offsets_after_seek_and_reassignment(kafka) -> None:
    topic = kafka.create_topic(partitions=4)
    report = produce(kafka.bootstrap, topic, "synthetic?task=regression&features=3&seed=1", partitions=4,
                     shard_size=10, limit=400, producer_id="prod-b")
    assert report.records == 400 and report.partitions == 4  # existing topic kept
    with ShardConsumer(kafka.bootstrap, topic, max_records_per_batch=30, prefetch=1) as consumer:
        assert consumer.end_offsets() == dict.fromkeys(range(4), 10)
        consumer.assign({0: 3, 2: 7})
        batches = drain(consumer, {0: 10, 2: 10})
        check_chains(batches, {0: 3, 2: 7}, {0: 10, 2: 10})
        assert all(len(b) <= 30 and b.y.dtype == torch.float32 for b in batches)
        assert sum(len(b) for b in batches) == (7 + 3) * 10
        # shards were spread round-robin: partition p holds shards p, p+4, ...; offset o of p is shard 4o+p
        want = {("prod-b", 10 * (4 * o + p) + i) for p, start in ((0, 3), (2, 7))
                for o in range(start, 10) for i in range(10)}
        assert set(seqs(batches)) == want
        consumer.assign({1: 5, 3: None})  # reassignment at runtime: nothing of 0 or 2 comes any more
        assert consumer.assignment() == {1: 5, 3: 0}
        batches = drain(consumer, {1: 10, 3: 10})
        check_chains(batches, {1: 5, 3: 0}, {1: 10, 3: 10})
        assert {p for b in batches for p in b.offsets} == {1, 3}
        assert consumer.poll(0.3) is None  # all consumed
        with pytest.raises(ValueError, match=r"no partition\(s\) \[9\]"):
            consumer.assign({9: 0})
        with pytest.raises(ValueError, match="start offsets must be >= 0"):
            consumer.assign({0: -1})


def test_records_of_a_plain_kafka_client_in_json_and_msgpack(kafka) -> None:
    topic = kafka.create_topic(partitions=2)
    producer = plain_producer(kafka)
    try:
        for i in range(5):
            producer.send(topic, json.dumps({"x": [i, i / 2, -i], "y": i % 3}).encode(), partition=0)
            producer.send(topic, msgpack.packb({"x": [i, 1.5, 2], "y": 2}), partition=1)
        producer.send(topic, encode_json_record(np.array([9.0, 9.0, 9.0]), 1), partition=1)
        producer.flush()
    finally:
        producer.close()
    with ShardConsumer(kafka.bootstrap, topic, max_records_per_batch=100) as consumer:
        consumer.assign({0: 0, 1: 0})
        batches = drain(consumer, {0: 5, 1: 6})
    check_chains(batches, {0: 0, 1: 0}, {0: 5, 1: 6})
    rows = {}
    for b in batches:
        assert b.x.dtype == torch.float32 and b.y.dtype == torch.int64
        row = 0
        for producer_id, first, count in b.samples:
            for k in range(count):
                rows[(producer_id, first + k)] = (b.x[row].tolist(), int(b.y[row]))
                row += 1
    assert rows[(f"{topic}/0", 4)] == ([4.0, 2.0, -4.0], 1)
    assert rows[(f"{topic}/1", 2)] == ([2.0, 1.5, 2.0], 2)
    assert rows[(f"{topic}/1", 5)] == ([9.0, 9.0, 9.0], 1)
    assert len(rows) == 11


def test_a_transactional_topic_gives_only_committed_records_and_covers_every_offset(kafka) -> None:
    """Written as the joiner writes (a transactional producer): the records of an aborted transaction are never
    in a batch, and the offsets that hold no record (commit and abort markers, aborted records) are covered
    all the same, so the batches chain to the partition's end (the committed offset a trainer pushes)."""
    topic = kafka.create_topic(partitions=1)
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, transactional_id=f"txn-{topic}", acks="all")
    try:
        producer.init_transactions()
        for label, commit in ((0, True), (1, False), (2, True)):
            producer.begin_transaction()
            for i in range(3):
                producer.send(topic, json.dumps({"x": [float(i)], "y": label}).encode(), partition=0)
            producer.flush()
            if commit:
                producer.commit_transaction()
            else:
                producer.abort_transaction()
    finally:
        producer.close()
    probe = KafkaConsumer(bootstrap_servers=kafka.bootstrap)
    try:
        end = probe.end_offsets([TopicPartition(topic, 0)])[TopicPartition(topic, 0)]
    finally:
        probe.close()
    assert end == 12  # 9 records and 3 markers
    with ShardConsumer(kafka.bootstrap, topic, max_records_per_batch=100, max_wait_ms=50) as consumer:
        consumer.assign({0: 0})
        batches = drain(consumer, {0: end})
        assert consumer.stats().lag == {0: 0}
    check_chains(batches, {0: 0}, {0: end})
    labels = [int(y) for b in batches for y in b.y]
    assert labels == [0, 0, 0, 2, 2, 2]  # the aborted transaction's label-1 records never come
    assert sorted(seqs(batches)) == [(f"{topic}/0", o) for o in (0, 1, 2, 8, 9, 10)]


def _bad_values() -> dict[str, bytes]:
    good = encode_shard(np.ones((2, 2), np.float32), np.zeros(2, np.int64), producer_id="bad", first_seq=0)
    shard = msgpack.unpackb(good)
    return {
        "bad_msgpack": b"\xc1\xc1",
        "bad_json": b'{"x": [1, 2], "y": 1,}',
        "unknown_version": msgpack.packb({**shard, "v": 99}),
        "wrong_shape": b'{"x": [1, 2, 3], "y": 1}',
        "wrong_dtype": b'{"x": [1, 2], "y": "cat"}',
        "non_finite": b'{"x": [NaN, 2], "y": 1}',
        "too_large": json.dumps({"x": [1.0] * 2000, "y": 1}).encode(),
        "truncated": good[:-5],
        "bad_schema": b'{"features": [1, 2], "y": 1}',
    }


def test_every_kind_of_bad_record_goes_to_the_dlq_and_is_covered(kafka) -> None:
    topic = kafka.create_topic(partitions=2)
    bad = _bad_values()
    producer = plain_producer(kafka)
    try:
        producer.send(topic, encode_json_record([1, 2], 0), partition=0)  # offset 0: good
        for reason, value in bad.items():  # partition 0 offsets 1..9: poison, with a header of ours
            producer.send(topic, value, partition=0, headers=[("origin", reason.encode())])
        producer.send(topic, encode_msgpack_record([3, 4], 1), partition=0)  # offset 10: good
        for reason in ("bad_json", "non_finite", "truncated"):  # partition 1: nothing but poison
            producer.send(topic, bad[reason], partition=1)
        producer.flush()
    finally:
        producer.close()
    with ShardConsumer(kafka.bootstrap, topic, feature_dim=2, max_record_bytes=4096,
                       max_records_per_batch=1) as consumer:
        consumer.assign({0: 0, 1: 0})
        batches = drain(consumer, {0: 11, 1: 3})
        stats = consumer.stats()
    check_chains(batches, {0: 0, 1: 0}, {0: 11, 1: 3})
    # 12 messages; each truncated shard names its 2 records
    assert sum(len(b) for b in batches) == 2 and sum(b.rejected for b in batches) == 14
    assert any(len(b) == 0 and b.rejected > 0 for b in batches)  # a poison-only batch still has offsets
    assert stats.rejected_by_reason == {**dict.fromkeys(bad, 1), "bad_json": 2, "non_finite": 2, "truncated": 2}
    assert stats.rejected_records == 14 and stats.records == 2

    entries = {}
    reader = KafkaConsumer(bootstrap_servers=kafka.bootstrap, auto_offset_reset="earliest",
                           enable_auto_commit=False)
    try:
        reader.assign([TopicPartition(dlq_topic(topic), 0)])
        deadline = time.monotonic() + 30
        while len(entries) < 12 and time.monotonic() < deadline:
            for msgs in reader.poll(timeout_ms=500).values():
                for m in msgs:
                    entry = parse_dlq_headers(m.headers)
                    entries[(entry.partition, entry.offset)] = (entry, m.value, dict(m.headers))
    finally:
        reader.close()
    assert len(entries) == 12  # written before the batches were handed out
    for offset, (reason, value) in enumerate(bad.items(), start=1):
        entry, stored, headers = entries[(0, offset)]
        assert (entry.reason, entry.topic, stored) == (reason, topic, value)
        assert headers["origin"] == reason.encode()  # original headers kept
        assert entry.error.startswith(reason)
    assert entries[(0, 8)][0].producer_id == "bad"  # a truncated shard still names its producer
    assert [entries[(1, o)][0].reason for o in range(3)] == ["bad_json", "non_finite", "truncated"]


def test_learned_feature_dim_rejects_later_mismatches_and_dlq_can_be_off(kafka) -> None:
    topic = kafka.create_topic(partitions=1)
    producer = plain_producer(kafka)
    try:
        for value in (b'{"x": [1, 2], "y": 0.5}', b'{"x": [1, 2, 3], "y": 0.5}', b'{"x": [1, 2], "y": 1}'):
            producer.send(topic, value, partition=0)
        producer.flush()
    finally:
        producer.close()
    with ShardConsumer(kafka.bootstrap, topic, dlq=False) as consumer:
        consumer.assign({0: 0})
        batches = drain(consumer, {0: 3})
        assert consumer.feature_dim == 2 and consumer.label_kind == "regression"
        assert consumer.stats().rejected_by_reason == {"wrong_shape": 1}
    assert sum(b.rejected for b in batches) == 1
    assert torch.cat([b.y for b in batches]).tolist() == [0.5, 1.0]
    assert dlq_topic(topic) not in kafka.admin.list_topics()


def test_commit_shows_in_the_consumer_group(kafka) -> None:
    topic = kafka.create_topic(partitions=2)
    produce(kafka.bootstrap, topic, "synthetic?features=2&limit=100", shard_size=25)
    group = f"job-{topic}"
    with ShardConsumer(kafka.bootstrap, topic, group_id=group) as consumer:
        consumer.assign({0: None, 1: None})
        committed: dict[int, int] = {}
        for batch in drain(consumer, {0: 2, 1: 2}):
            consumer.commit(batch.next_offsets)  # as a trainer does after each applied push
            committed.update(batch.next_offsets)
    assert committed == {0: 2, 1: 2}
    offsets = kafka.admin.list_group_offsets({group: None})[group]
    assert {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic} == committed
    with ShardConsumer(kafka.bootstrap, topic) as consumer, pytest.raises(ValueError, match="group_id"):
        consumer.commit({0: 1})


def test_closed_consumer_refuses_calls(kafka) -> None:
    topic = kafka.create_topic(partitions=1)
    consumer = ShardConsumer(kafka.bootstrap, topic)
    consumer.close()
    consumer.close()
    from datastream import ConsumerClosedError
    with pytest.raises(ConsumerClosedError):
        consumer.poll(0.1)
    with pytest.raises(ConsumerClosedError):
        consumer.assign({0: 0})
    assert list(consumer) == []


def test_producer_interrupted_loses_nothing_acknowledged(kafka) -> None:
    """Ctrl-C in the middle of an unbounded stream: the printed count equals what is on the topic."""
    topic = f"sigint-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "streamtrain.cli", "produce", "--source", "synthetic?features=4",
           "--topic", topic, "--bootstrap", kafka.bootstrap, "--partitions", "3", "--shard-size", "50",
           "--producer-id", "prod-sig", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        with ShardConsumer(kafka.bootstrap, topic, dlq=False) as probe:
            def enough() -> bool:
                try:
                    return sum(probe.end_offsets().values()) >= 60
                except ValueError:  # topic not created yet
                    return False
            wait_until(enough, timeout_s=60, interval_s=0.2, what="producer to write 60 shards")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    match = re.search(r"produced (\d+) records in (\d+) shards .* failed 0; interrupted", out)
    assert match, out + err
    printed = int(match.group(1))
    with ShardConsumer(kafka.bootstrap, topic) as consumer:
        ends = consumer.end_offsets()
        assert sum(ends.values()) == int(match.group(2))
        consumer.assign(dict.fromkeys(ends, 0))
        batches = drain(consumer, ends)
    assert seqs(batches) == Counter({("prod-sig", s): 1 for s in range(printed)})


def test_produce_with_a_stop_event_rate_and_bad_arguments(kafka) -> None:
    import threading
    topic = kafka.create_topic(partitions=1)
    from io import StringIO

    from rich.console import Console
    screen = StringIO()
    report = produce(kafka.bootstrap, topic, "digits", rate=5000, limit=120, shard_size=32, progress=True,
                     console=Console(file=screen, force_terminal=True, width=100))
    assert (report.records, report.shards, report.interrupted) == (120, 4, False)
    assert "120 records" in screen.getvalue() and "records/s" in screen.getvalue()
    stop = threading.Event()
    stop.set()
    report = produce(kafka.bootstrap, topic, "synthetic", stop=stop)
    assert (report.records, report.interrupted) == (0, True)
    with pytest.raises(ValueError, match="rate"):
        produce(kafka.bootstrap, topic, "digits", rate=0)
    with pytest.raises(ValueError, match="shard_size"):
        produce(kafka.bootstrap, topic, "digits", shard_size=0)
    assert decode_record(encode_shard(np.ones((1, 1)), np.ones(1), producer_id="p", first_seq=0)).count == 1


def test_seek_outside_the_log_fails_loudly(kafka) -> None:
    from datastream import ConsumerClosedError
    topic = kafka.create_topic(partitions=1)
    produce(kafka.bootstrap, topic, "synthetic?features=2&limit=10", shard_size=5)
    with ShardConsumer(kafka.bootstrap, topic) as consumer:
        consumer.assign({0: 50})
        deadline = time.monotonic() + 30
        with pytest.raises(ConsumerClosedError, match="OffsetOutOfRange") as info:
            while time.monotonic() < deadline:
                consumer.poll(0.5)
        assert info.value.__cause__ is not None


def test_produce_command_from_stdin(kafka) -> None:
    topic = f"stdin-{time.monotonic_ns()}"
    lines = "".join(json.dumps({"x": [i, -i], "y": i % 2}) + "\n" for i in range(25))
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "produce", "--source", "stdin", "--topic", topic,
         "--bootstrap", kafka.bootstrap, "--partitions", "2", "--shard-size", "10", "--split", "train",
         "--producer-id", "prod-in", "--no-progress"],
        input=lines, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert "produced 20 records in 2 shards" in done.stdout
    with ShardConsumer(kafka.bootstrap, topic) as consumer:
        consumer.assign({0: 0, 1: 0})
        batches = drain(consumer, {0: 1, 1: 1})
    assert sorted(int(v) for b in batches for v in b.x[:, 0]) == [i for i in range(25) if i % 5 != 4]
    bad = subprocess.run([sys.executable, "-m", "streamtrain.cli", "produce", "--shard-size", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--shard-size / STREAMTRAIN_SHARD_SIZE: must be >= 1" in bad.stderr


def test_an_empty_assignment_idles_until_partitions_come(kafka) -> None:
    topic = kafka.create_topic(partitions=2)
    produce(kafka.bootstrap, topic, "synthetic?features=2&limit=20", shard_size=10)
    with ShardConsumer(kafka.bootstrap, topic) as consumer:
        consumer.assign({0: 0})
        assert drain(consumer, {0: 1})[0].offsets == {0: (0, 1)}
        consumer.assign({})  # more trainers than partitions: this one gets none
        assert consumer.poll(0.3) is None and consumer.assignment() == {}
        consumer.assign({1: 0})
        assert drain(consumer, {1: 1})[0].offsets == {1: (0, 1)}


def _dlq_entries(kafka, topic: str, want: int) -> dict[tuple[int, int], object]:
    entries = {}
    reader = KafkaConsumer(bootstrap_servers=kafka.bootstrap, auto_offset_reset="earliest",
                           enable_auto_commit=False)
    try:
        reader.assign([TopicPartition(dlq_topic(topic), 0)])
        deadline = time.monotonic() + 30
        while len(entries) < want and time.monotonic() < deadline:
            for msgs in reader.poll(timeout_ms=500).values():
                for m in msgs:
                    entry = parse_dlq_headers(m.headers)
                    entries[(entry.partition, entry.offset)] = entry
    finally:
        reader.close()
    return entries


def test_records_with_ids_mixed_with_dense_and_bad_ones(kafka) -> None:
    """``streamtrain produce --source clicks?...`` (version-2 shards) and a plain client's version-1
    shards, JSON and msgpack records with and without ids, and bad ones, in one stream."""
    topic = f"clicks-{time.monotonic_ns()}"
    spec = "clicks?dense=2&features=3&vocab=3000&multi=4&limit=700"
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "produce", "--source", spec, "--topic", topic,
         "--bootstrap", kafka.bootstrap, "--partitions", "2", "--shard-size", "100", "--producer-id", "clk",
         "--no-progress"], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert "produced 700 records in 7 shards" in done.stdout
    clicks = load_source(spec).read()
    dense_x = np.array([[0.5, 1.5], [2.5, 3.5], [4.5, 5.5]], np.float32)
    good_ids = {"user": 42, "genres": [3, 7], "city": "paris"}
    too_many = {"u": list(range(MAX_IDS_PER_FEATURE + 1))}
    bad_lengths = msgpack.unpackb(encode_shard(
        dense_x, np.zeros(3, np.int64), ids={"user": Jagged.from_lists([[1], [2], [3]])},
        producer_id="bad", first_seq=0))
    bad_lengths["ids"]["lengths"]["data"] = np.array([1, 1, 2], np.int32).tobytes()
    messages = [  # partition 0, after the 4 shards of the producer (offsets 0..3)
        encode_shard(dense_x, np.array([0, 1, 0]), producer_id="old", first_seq=0),  # 4: version 1
        encode_json_record([1.0, 2.0], 1, ids=good_ids),  # 5
        encode_msgpack_record([3.0, 4.0], 0, ids={"user": "bob", "c1": [5, 6]}),  # 6
        encode_json_record([5.0, 6.0], 1),  # 7: no ids at all
        json.dumps({"y": 1, "ids": {"user": 1.5}}).encode(),  # 8: bad_ids
        encode_msgpack_record([1.0, 2.0], 0, ids=too_many),  # 9: too_many_ids
        msgpack.packb(bad_lengths),  # 10: bad_ids in a shard, which names its 3 records
        msgpack.packb({**bad_lengths, "v": 3}),  # 11: unknown_version
        encode_json_record([1.0, 2.0, 3.0], 1, ids=good_ids),  # 12: wrong_shape (the stream's width is 2)
        encode_shard(dense_x[:2], np.array([1, 1]), producer_id="old", first_seq=3,
                     ids={"genres": Jagged.from_lists([[], [8, 9, 10]])}),  # 13: version 2 of a plain client
    ]
    producer = plain_producer(kafka)
    try:
        for value in messages:
            producer.send(topic, value, partition=0)
        producer.flush()
    finally:
        producer.close()
    ends = {0: 14, 1: 3}
    with ShardConsumer(kafka.bootstrap, topic, max_records_per_batch=1000, max_record_bytes=64 * 1024) as consumer:
        assert consumer.end_offsets() == ends
        consumer.assign({0: 0, 1: 0})
        batches = drain(consumer, ends)
        stats = consumer.stats()
    check_chains(batches, {0: 0, 1: 0}, ends)
    assert stats.rejected_by_reason == {"bad_ids": 2, "too_many_ids": 1, "unknown_version": 1, "wrong_shape": 1}
    # the bad shard names its 3 records; one of an unknown version is not read further and counts as 1
    assert sum(b.rejected for b in batches) == stats.rejected_records == 1 + 1 + 3 + 1 + 1
    # every accepted record exactly once, in the samples
    assert seqs(batches) == Counter({**{("clk", s): 1 for s in range(700)}, **{("old", s): 1 for s in range(5)},
                                     **{(f"{topic}/0", o): 1 for o in (5, 6, 7)}})
    rows = {}
    for b in batches:
        assert all(col.n == len(b) for col in b.ids.values())
        assert b.x.shape[1] == 2 and b.y.dtype == torch.int64
        row = 0
        for producer_id, first, count in b.samples:
            for k in range(count):
                rows[(producer_id, first + k)] = (b.x[row].tolist(), int(b.y[row]),
                                                  {name: col.to_lists()[row] for name, col in b.ids.items()})
                row += 1
        for col in b.ids.values():  # offsets start at 0 and end at the values
            assert col.offsets[0] == 0 and col.offsets[-1] == col.nnz and col.values.dtype == np.int64
    for s in range(700):  # the producer's records carry the source's IDs, row for row
        x, y, ids = rows[("clk", s)]
        assert y == clicks.y[s] and x == clicks.x[s].tolist()
        for name, col in clicks.ids.items():
            assert ids[name] == col.to_lists()[s], (s, name)
        assert set(ids) - set(clicks.ids) <= {"user", "genres", "city"}  # others' features: zero rows here
        assert all(ids[name] == [] for name in set(ids) - set(clicks.ids))
    def named(key: tuple[str, int]) -> dict[str, list[int]]:  # the features a record has IDs of
        return {name: v for name, v in rows[key][2].items() if v}

    assert named((f"{topic}/0", 5)) == {"user": [42], "genres": [3, 7], "city": [hash_id("paris")]}
    assert named((f"{topic}/0", 6)) == {"user": [hash_id("bob")], "c1": [5, 6]}
    assert rows[(f"{topic}/0", 6)][0] == [3.0, 4.0]
    assert all(v == [] for v in rows[(f"{topic}/0", 7)][2].values())  # no ids: zero rows of every feature
    assert [rows[("old", s)][1] for s in range(5)] == [0, 1, 0, 1, 1]
    assert all(v == [] for s in range(3) for v in rows[("old", s)][2].values())  # version 1: no ids
    assert rows[("old", 4)][2]["genres"] == [8, 9, 10] and rows[("old", 3)][2]["genres"] == []

    entries = _dlq_entries(kafka, topic, 5)
    assert {o: e.reason for (p, o), e in entries.items()} == {
        8: "bad_ids", 9: "too_many_ids", 10: "bad_ids", 11: "unknown_version", 12: "wrong_shape"}
    assert (entries[(0, 10)].producer_id, entries[(0, 10)].first_seq, entries[(0, 10)].count) == ("bad", 0, 3)
    assert "lengths add up to 4, values hold 3" in entries[(0, 10)].error
    assert str(MAX_IDS_PER_FEATURE) in entries[(0, 9)].error


class _Replica:
    """A stand-in for a serving replica's ``POST /v1/predict`` on loopback (``http.server``): it keeps
    what it is sent, and answers ``status`` (after ``delay_s``); ``on_post`` runs on each request."""

    def __init__(self, status: int = 200, on_post: Callable[[list[dict]], None] | None = None) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.posts: list[tuple[str, str, list[dict]]] = []  # (path, authorization, records)
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the producer asks

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                records = body["records"]
                if on_post is not None:
                    on_post(records)
                replica.posts.append((self.path, self.headers.get("Authorization", ""), records))
                answer = json.dumps({"predictions": [{"logit": 0.0}] * len(records)} if status == 200 else
                                    {"error": "the replica is loading its first state", "code": "not_ready"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> _Replica:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_the_producer_scores_every_nth_record_on_a_replica_before_producing_it(kafka, monkeypatch) -> None:
    """Every 7th record of the stream, in the training topic's JSON form with its label, is POSTed to the
    replica's ``/v1/predict`` with the token, before its shard is sent: when the request for shard k
    arrives, the topic holds at most shards 0 .. k-1 (the replica waits a moment first, long enough for a
    shard sent before the request to be acknowledged). Nothing else changes: every record is produced."""
    import datastream.producer as producer_module

    monkeypatch.setattr(producer_module, "SCORE_TIME_SHARE", 1.0)  # every sampled record, however slow the check
    spec, shard_size, every = "clicks?dense=2&features=3&vocab=3000&multi=4&limit=300", 10, 7
    topic = kafka.create_topic(partitions=2)
    on_topic: list[int] = []  # messages (shards) on the topic when each request came
    probe = KafkaConsumer(bootstrap_servers=kafka.bootstrap)
    parts = [TopicPartition(topic, p) for p in range(2)]
    source = load_source(spec).read()

    def check(records: list[dict]) -> None:
        time.sleep(0.05)  # a shard sent before this request would be acknowledged by now (linger 5 ms)
        on_topic.append(sum(probe.end_offsets(parts).values()))

    try:
        with _Replica(on_post=check) as replica:
            report = produce(kafka.bootstrap, topic, spec, partitions=2, shard_size=shard_size, producer_id="sc",
                             score_url=replica.url + "/", score_token="tok", score_every=every)
    finally:
        probe.close()
    assert (report.records, report.failed_records) == (300, 0)
    assert (report.scored, report.score_failed, report.score_skipped) == (len(range(0, 300, every)), 0, 0)
    assert {(path, auth) for path, auth, _ in replica.posts} == {("/v1/predict", "Bearer tok")}
    posted = [r for _, _, records in replica.posts for r in records]
    want = [{"x": source.x[s].tolist(), "ids": {name: col.to_lists()[s] for name, col in source.ids.items()},
             "y": int(source.y[s])} for s in range(0, 300, every)]
    assert posted == want  # exactly the sampled records, with their IDs and labels, in stream order
    shards = sorted({s // shard_size for s in range(0, 300, every)})  # those holding a sampled record
    assert len(replica.posts) == len(shards)  # one request per shard, in order
    assert all(messages <= k for k, messages in zip(shards, on_topic, strict=True)), (shards, on_topic)
    with ShardConsumer(kafka.bootstrap, topic) as consumer:  # and everything was produced, once
        ends = consumer.end_offsets()
        consumer.assign(dict.fromkeys(ends, 0))
        assert seqs(drain(consumer, ends)) == Counter({("sc", s): 1 for s in range(300)})


def test_a_replica_that_refuses_fails_or_hangs_never_stops_production(kafka, caplog) -> None:
    """Scoring is best effort: a closed port, a replica answering 503 (not ready yet) and one that never
    answers (0.5 s timeout, then the time share skips the samples) each leave every record produced; the
    failures are counted and logged once (at most once a minute)."""
    import socket

    def run(url: str) -> ProduceReport:
        topic = kafka.create_topic(partitions=1)
        return produce(kafka.bootstrap, topic, "digits", shard_size=20, limit=1000, score_url=url, score_every=5)

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    with caplog.at_level(logging.WARNING, logger="datastream.producer"):
        report = run(dead)
    assert (report.records, report.failed_records, report.scored) == (1000, 0, 0)
    assert report.score_failed > 0 and report.score_failed + report.score_skipped == 200
    warned = [r.getMessage() for r in caplog.records if "scoring sampled records" in r.getMessage()]
    assert len(warned) == 1 and dead in warned[0] and "ConnectionRefusedError" in warned[0], warned

    with _Replica(status=503) as replica:
        report = run(replica.url)
    assert (report.records, report.scored) == (1000, 0) and report.score_failed > 0
    assert report.score_failed + report.score_skipped == 200 and replica.posts

    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        started = time.monotonic()
        report = run(f"http://127.0.0.1:{silent.getsockname()[1]}")
        took = time.monotonic() - started
    assert (report.records, report.scored) == (1000, 0), report
    assert report.score_failed >= 1 and report.score_skipped > 0 and took < 5.0, (report, took)


def test_a_score_url_that_is_not_http_is_refused_before_anything_is_produced(kafka) -> None:
    with pytest.raises(ValueError, match="score URL must be http"):
        produce(kafka.bootstrap, "never-made", "digits", score_url="127.0.0.1:8800")
