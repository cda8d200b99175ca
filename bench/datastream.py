"""Data-plane throughput: our consumer path to tensors against raw kafka-python bytes.

Produces the digits data set (repeated) once as ~64 KB shards, then, in the
same run and from the same topic, consumes everything with

(a) a plain kafka-python ``KafkaConsumer`` returning message bytes (the ceiling), and
(b) :class:`datastream.ShardConsumer`: fetch, decode, validate, assemble float32/int64
    tensor batches with exact offsets, in its prefetch thread.

Each path runs ``--rounds`` times alternately; the best round of each counts.
It also times decoding the same shards to tensors in memory (no Kafka), for reference.
Prints records/s and MB/s of both, writes ``bench/results/datastream.json`` and
prints the ratio ours/raw last.

    .venv/bin/python bench/datastream.py [--records 500000] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import numpy as np
import torch
from kafka import KafkaConsumer, TopicPartition

from bench import harness
from datastream import ShardConsumer, decode_record, encode_shard, iter_shards, load_source, produce
from datastream.topics import MAX_MESSAGE_BYTES
from streamtrain.launcher import KafkaBroker

FETCH: dict[str, Any] = {"fetch_max_bytes": 64 << 20, "max_partition_fetch_bytes": MAX_MESSAGE_BYTES,
                        "fetch_min_bytes": 1, "fetch_max_wait_ms": 100}


def raw_pass(bootstrap: str, topic: str, ends: dict[int, int]) -> tuple[float, int, int]:
    """Seconds, messages and value bytes to read everything as bytes with kafka-python."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, **FETCH)
    try:
        consumer.assign([TopicPartition(topic, p) for p in ends])
        for p in ends:
            consumer.seek(TopicPartition(topic, p), 0)
        want, messages, nbytes = sum(ends.values()), 0, 0
        started = time.perf_counter()
        while messages < want:
            for batch in consumer.poll(timeout_ms=500, max_records=4096).values():
                messages += len(batch)
                nbytes += sum(len(m.value) for m in batch)
        return time.perf_counter() - started, messages, nbytes
    finally:
        consumer.close()


def our_pass(bootstrap: str, topic: str, ends: dict[int, int], batch: int) -> tuple[float, int]:
    """Seconds and records to read everything as tensor batches with ShardConsumer."""
    with ShardConsumer(bootstrap, topic, max_records_per_batch=batch, prefetch=8, dlq=False,
                       **FETCH) as consumer:
        reached = dict.fromkeys(ends, 0)
        records = 0
        started = time.perf_counter()
        consumer.assign(dict.fromkeys(ends, 0))
        while any(reached[p] < ends[p] for p in ends):
            got = consumer.poll(5.0)
            if got is None:
                raise RuntimeError(f"no batch within 5 s at {reached} of {ends}")
            records += len(got)
            reached.update(got.next_offsets)
        return time.perf_counter() - started, records


def decode_only(values: list[bytes], batch_shards: int) -> float:
    """Seconds to decode ``values`` and assemble float32/int64 tensors, without Kafka."""
    started = time.perf_counter()
    for i in range(0, len(values), batch_shards):
        recs = [decode_record(v, feature_dim=64, label_kind="classification") for v in values[i:i + batch_shards]]
        torch.from_numpy(np.concatenate([r.x for r in recs]).astype(np.float32, copy=False))
        torch.from_numpy(np.concatenate([r.y for r in recs]).astype(np.int64, copy=False))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500_000, help="digits records to produce")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--shard-bytes", type=int, default=64 * 1024, help="target shard size")
    parser.add_argument("--batch", type=int, default=1024, help="records per consumer batch")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each counts")
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    args = parser.parse_args()
    harness.start()

    record_bytes = 64 * 4 + 8  # float32 features + int64 label
    shard_size = max(1, args.shard_bytes // record_bytes)
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap or stack.enter_context(KafkaBroker(log_level="WARN")).bootstrap
        topic = f"bench-datastream-{int(time.time())}"
        repeat = -(-args.records // 1797)
        report = produce(bootstrap, topic, load_source(f"digits?repeat={repeat}"), partitions=args.partitions,
                         shard_size=shard_size, limit=args.records, max_in_flight_shards=1024)
        print(f"produced {report.records:,} digits records in {report.shards:,} shards of {shard_size} "
              f"records to {args.partitions} partitions ({report.records_per_s:,.0f} records/s acknowledged)")
        with ShardConsumer(bootstrap, topic, dlq=False) as probe:
            ends = probe.end_offsets()
        raw_best: float | None = None
        ours_best: float | None = None
        for r in range(args.rounds):
            raw_s, messages, nbytes = raw_pass(bootstrap, topic, ends)
            ours_s, records = our_pass(bootstrap, topic, ends, args.batch)
            if records != report.records or messages != report.shards:
                raise RuntimeError(f"read {records} records / {messages} messages, "
                                   f"produced {report.records} / {report.shards}")
            print(f"round {r + 1}: raw {raw_s:.2f} s, ours {ours_s:.2f} s")
            raw_best = raw_s if raw_best is None else min(raw_best, raw_s)
            ours_best = ours_s if ours_best is None else min(ours_best, ours_s)
    assert raw_best is not None and ours_best is not None, "--rounds must be at least 1"
    values = [encode_shard(x, y, producer_id="bench", first_seq=0)
              for x, y in iter_shards(load_source(f"digits?repeat={repeat}"), shard_size, args.records)]
    decode_s = min(decode_only(values, max(1, args.batch // shard_size)) for _ in range(args.rounds))
    mb = nbytes / 1e6
    result = {
        "records": report.records, "shards": report.shards, "shard_records": shard_size,
        "mean_shard_bytes": nbytes / messages, "partitions": args.partitions, "batch": args.batch,
        "rounds": args.rounds,
        "raw": {"seconds": raw_best, "records_per_s": report.records / raw_best, "mb_per_s": mb / raw_best},
        "ours": {"seconds": ours_best, "records_per_s": report.records / ours_best, "mb_per_s": mb / ours_best},
        "decode_only": {"seconds": decode_s, "records_per_s": report.records / decode_s},
        "ratio": raw_best / ours_best,
    }
    print(f"raw kafka-python bytes : {result['raw']['records_per_s']:>12,.0f} records/s "
          f"{result['raw']['mb_per_s']:>8.1f} MB/s")
    print(f"datastream to tensors  : {result['ours']['records_per_s']:>12,.0f} records/s "
          f"{result['ours']['mb_per_s']:>8.1f} MB/s")
    print(f"decode only (no Kafka) : {result['decode_only']['records_per_s']:>12,.0f} records/s")
    harness.finish("datastream", result, [f"ratio ours/raw: {result['ratio']:.2f}"])


if __name__ == "__main__":
    main()
