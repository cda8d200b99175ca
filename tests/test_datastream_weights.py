"""Sample weights (``w``) of single records: the codec, every refusal, and ``Batch.w`` on the real broker."""

from __future__ import annotations

import json
import time

import msgpack
import numpy as np
import pytest
import torch
from kafka import KafkaProducer

from datastream import Batch, DecodeError, ShardConsumer, decode_record, encode_json_record, encode_msgpack_record
from datastream.records import encode_shard


@pytest.mark.parametrize("encode", [encode_json_record, encode_msgpack_record])
@pytest.mark.parametrize("w", [3, 0.1, 10.0, 1e-30])
def test_a_weight_round_trips_in_both_formats(encode, w) -> None:
    rec = decode_record(encode([0.5, 1.0], 1, w=w))
    assert rec.w is not None and rec.w.dtype == np.float32 and rec.w.shape == (1,)
    assert rec.w[0] == np.float32(w)
    rec = decode_record(encode(None, 0, ids={"u": 7}, w=w), label_kind="classification")
    assert rec.w is not None and rec.w[0] == np.float32(w) and rec.count == 1


@pytest.mark.parametrize("encode", [encode_json_record, encode_msgpack_record])
def test_a_record_without_a_weight_has_none(encode) -> None:
    assert decode_record(encode([0.5], 1)).w is None
    assert b"w" not in encode([0.5], 1)  # nothing new on the wire for unweighted records


REFUSED = {
    "wrong_dtype": [{"w": "2"}, {"w": True}, {"w": None}, {"w": [1.0]}, {"w": 0}, {"w": -1}, {"w": -0.5},
                    {"w": 0.0}, {"w": 1e-50}],  # the last rounds to 0 in float32
    "non_finite": [{"w": float("nan")}, {"w": float("inf")}, {"w": float("-inf")}, {"w": 1e39}],
}


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@pytest.mark.parametrize("reason,extra", [(r, e) for r, es in REFUSED.items() for e in es])
def test_each_bad_weight_is_refused_with_its_reason(fmt, reason, extra) -> None:
    obj = {"x": [1.0], "y": 1, **extra}
    value = json.dumps(obj).encode() if fmt == "json" else msgpack.packb(obj)
    with pytest.raises(DecodeError) as info:
        decode_record(value)
    assert info.value.reason == reason and "w (sample weight)" in str(info.value)


def test_an_integer_weight_too_large_for_float32_is_non_finite() -> None:
    with pytest.raises(DecodeError) as info:
        decode_record(b'{"x": [1], "y": 1, "w": 1' + b"0" * 400 + b"}")
    assert info.value.reason == "non_finite" and "too large" in str(info.value)


def test_encoders_refuse_a_bad_weight() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="weight w must be a finite number > 0"):
            encode_json_record([1.0], 1, w=bad)  # type: ignore[arg-type]  # bad on purpose
        with pytest.raises(ValueError, match="weight w must be a finite number > 0"):
            encode_msgpack_record([1.0], 1, w=bad)  # type: ignore[arg-type]  # bad on purpose


def test_shards_carry_no_weights_nor_unknown_keys() -> None:
    shard = msgpack.unpackb(encode_shard(np.ones((2, 1), np.float32), np.zeros(2, np.int64), producer_id="p",
                                         first_seq=0))
    weights = {"dtype": "float32", "shape": [2], "data": np.ones(2, np.float32).tobytes()}
    for extra, says in (({"w": weights}, "no sample weights"), ({"zz": 1}, "unknown keys zz")):
        with pytest.raises(DecodeError) as info:
            decode_record(msgpack.packb({**shard, **extra}))
        assert info.value.reason == "bad_schema" and says in str(info.value)
        assert info.value.producer_id is None or info.value.producer_id == "p"
    assert decode_record(msgpack.packb(shard)).w is None


def _drain(consumer: ShardConsumer, end: int, timeout_s: float = 60.0) -> list[Batch]:
    batches: list[Batch] = []
    reached = 0
    deadline = time.monotonic() + timeout_s
    while reached < end:
        assert time.monotonic() < deadline, f"timed out at offset {reached}, want {end}"
        batch = consumer.poll(1.0)
        if batch is not None:
            batches.append(batch)
            reached = batch.next_offsets.get(0, reached)
    return batches


@pytest.mark.timeout(120)
def test_batches_carry_the_weights_of_mixed_records(kafka) -> None:
    topic = kafka.create_topic(partitions=1)
    # (message, the weight each of its records carries: None for none; "refused": rejected); the shards
    # are the messages of several records
    messages: list[tuple[bytes, list[float | None] | str]] = [
        (encode_shard(np.zeros((3, 2), np.float32), np.array([0, 1, 0]), producer_id="s", first_seq=0),
         [None] * 3),
        (encode_json_record([0.0, 1.0], 1), [None]), (encode_json_record([0.0, 1.0], 0), [None]),
        (encode_msgpack_record([1.0, 2.0], 0, w=10), [10.0]), (encode_json_record([1.0, 2.0], 1), [None]),
        (encode_json_record([1.0, 2.0], 0, w=2.5), [2.5]), (b'{"x": [1, 2], "y": 0, "w": 0}', "refused"),
        (encode_msgpack_record([1.0, 2.0], 1), [None]), (encode_json_record([1.0, 2.0], 0, w=1), [1.0]),
        (encode_shard(np.ones((2, 2), np.float32), np.array([1, 1]), producer_id="s", first_seq=3), [None] * 2),
        (encode_msgpack_record([1.0, 2.0], 0, w=0.5), [0.5]),
        *[(encode_json_record([3.0, 3.0], 1), [None])] * 6,
    ]
    carried: dict[tuple[str, int], float | None] = {}  # record name (as in Batch.samples) -> its weight
    seq = 0
    for offset, (_, ws) in enumerate(messages):
        if ws == "refused":
            continue
        shard = len(ws) > 1
        for k, w in enumerate(ws):
            carried[("s", seq + k) if shard else (f"{topic}/0", offset)] = w
        seq += len(ws) if shard else 0
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    try:
        for value, _ in messages:
            producer.send(topic, value, partition=0)
        producer.flush()
    finally:
        producer.close()
    with ShardConsumer(kafka.bootstrap, topic, max_records_per_batch=4, dlq=False) as consumer:
        consumer.assign({0: 0})
        batches = _drain(consumer, len(messages))
    seen: dict[tuple[str, int], float] = {}
    for b in batches:
        names = [(name, first + k) for name, first, count in b.samples for k in range(count)]
        own = [carried[name] for name in names]
        if all(w is None for w in own):  # no record of the batch carries a weight: no weights at all
            assert b.w is None
            continue
        assert b.w is not None and b.w.dtype == torch.float32 and b.w.shape == (len(b),)
        assert b.w.tolist() == [1.0 if w is None else w for w in own]
        seen.update(zip(names, b.w.tolist(), strict=True))
    assert sum(b.rejected for b in batches) == 1 and sum(len(b) for b in batches) == len(carried)
    assert {name: w for name, w in carried.items() if w is not None} == \
        {name: w for name, w in seen.items() if carried[name] is not None}
