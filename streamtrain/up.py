"""``streamtrain up``: bring everything up locally and run the main job.

Starts a real Kafka broker and a real Redis server on loopback, streams the
digits data set through a topic with several partitions, reads every record
back and prints what it counted. Everything it started is stopped on exit,
on Ctrl-C and on error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import settings as cfg
from .launcher import KafkaBroker, RedisServer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpSettings:
    """Settings of the local main job."""

    partitions: int = cfg.setting(4, env="STREAMTRAIN_PARTITIONS", min=1, max=256,
                                  help="partitions of the training topic")
    topic: str = cfg.setting("digits", env="STREAMTRAIN_TOPIC", help="training topic name")
    kafka_heap_mb: int = cfg.setting(512, env="STREAMTRAIN_KAFKA_HEAP_MB", min=128,
                                     help="heap of the local Kafka broker")
    redis_aof: bool = cfg.setting(True, env="STREAMTRAIN_REDIS_AOF", help="turn Redis AOF on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``streamtrain up``."""
    cfg.add_arguments(parser, UpSettings)


def run(args: argparse.Namespace) -> int:
    """Run the local main job; returns the process exit code."""
    settings = cfg.from_args(UpSettings, args)
    console = Console()
    with contextlib.ExitStack() as stack:
        with console.status("starting Kafka (KRaft) and Redis on loopback"):
            redis_server = stack.enter_context(RedisServer(appendonly=settings.redis_aof))
            kafka = stack.enter_context(KafkaBroker(heap_mb=settings.kafka_heap_mb))
        console.print(f"Kafka {kafka.bootstrap} ready in {kafka.ready_after_s:.1f}s, "
                      f"Redis {redis_server.url} ready in {redis_server.ready_after_s:.2f}s")
        counts = _stream_digits(console, kafka.bootstrap, settings)
    table = Table(title=f"topic {settings.topic!r}")
    table.add_column("partition", justify="right")
    table.add_column("records", justify="right")
    for partition, n in sorted(counts.items()):
        table.add_row(str(partition), str(n))
    table.add_row("total", str(sum(counts.values())))
    console.print(table)
    return 0


def _stream_digits(console: Console, bootstrap: str, settings: UpSettings) -> Counter[int]:
    """Produce the digits data set as JSON records and consume it back; count per partition."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient
    from sklearn.datasets import load_digits

    digits = load_digits()
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="streamtrain-up")
    try:
        admin.create_topics({settings.topic: {"num_partitions": settings.partitions,
                                              "replication_factor": 1}}, wait_for_metadata=True)
    finally:
        admin.close()
    total = len(digits.target)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]:>9.0f} records/s"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("produce", total=total, rate=0.0)
        producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                                 linger_ms=5)
        t0 = time.monotonic()
        try:
            for i, (x, y) in enumerate(zip(digits.data, digits.target, strict=True)):
                record = json.dumps({"x": x.tolist(), "y": int(y)}).encode()
                producer.send(settings.topic, record, partition=i % settings.partitions)
                if i % 64 == 0:
                    progress.update(task, completed=i, rate=i / max(time.monotonic() - t0, 1e-9))
            producer.flush()
        finally:
            producer.close()
        progress.update(task, completed=total, rate=total / (time.monotonic() - t0))

        task = progress.add_task("consume", total=total, rate=0.0)
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        counts: Counter[int] = Counter()
        try:
            consumer.assign([TopicPartition(settings.topic, p) for p in range(settings.partitions)])
            consumer.seek_to_beginning()
            t0 = time.monotonic()
            deadline = t0 + 60
            while sum(counts.values()) < total and time.monotonic() < deadline:
                for tp, records in consumer.poll(timeout_ms=500).items():
                    for rec in records:
                        json.loads(rec.value)
                    counts[tp.partition] += len(records)
                done = sum(counts.values())
                progress.update(task, completed=done, rate=done / (time.monotonic() - t0))
        finally:
            consumer.close()
    if sum(counts.values()) != total:
        raise RuntimeError(f"produced {total} records but read back {sum(counts.values())}")
    return counts
