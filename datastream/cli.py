"""``streamtrain produce``: stream a source into a training topic as shards.

Prints one final line with the exact count of acknowledged records, also after
Ctrl-C (exit code 130 then, 1 when sends failed)::

    produced 5000 records in 20 shards to digits (4 partitions) as host-123-ab12cd34 in 1.2 s ...
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rich.console import Console

from common import settings as cfg

from .producer import produce

__all__ = ["ProduceSettings", "add_arguments", "run"]


@dataclass(frozen=True)
class ProduceSettings:
    """Settings of the shard producer."""

    source: str = cfg.setting("digits", env="STREAMTRAIN_SOURCE",
                              help="source spec: digits, synthetic?..., csv:PATH, npz:PATH, jsonl:PATH, "
                                   "stdin, module:callable")
    topic: str = cfg.setting("digits", env="STREAMTRAIN_TOPIC", help="training topic")
    bootstrap: str = cfg.setting("127.0.0.1:9092", env="STREAMTRAIN_KAFKA_BOOTSTRAP",
                                 help="Kafka bootstrap servers")
    partitions: int = cfg.setting(4, env="STREAMTRAIN_PARTITIONS", min=1, max=4096,
                                  help="partitions when the topic is created")
    shard_size: int = cfg.setting(256, env="STREAMTRAIN_SHARD_SIZE", min=1, max=1_000_000,
                                  help="records per shard")
    rate: float | None = cfg.setting(None, env="STREAMTRAIN_PRODUCE_RATE", min=0.001,
                                     help="records per second to stay under (default: unthrottled)")
    limit: int | None = cfg.setting(None, env="STREAMTRAIN_PRODUCE_LIMIT", min=0,
                                    help="stop after this many records")
    split: str = cfg.setting("all", env="STREAMTRAIN_SPLIT", choices=("train", "test", "all"),
                             help="which split of the source to produce")
    producer_id: str | None = cfg.setting(None, env="STREAMTRAIN_PRODUCER_ID",
                                          help="id written into the shards (default: host-pid-random)")
    progress: bool = cfg.setting(True, env="STREAMTRAIN_PROGRESS", help="show a progress bar")
    outage_limit_s: float = cfg.setting(60.0, env="STREAMTRAIN_OUTAGE_LIMIT_S", min=0.1,
                                        help="longest broker outage ridden out before the producer exits "
                                             "with an error")
    max_in_flight_shards: int = cfg.setting(256, env="STREAMTRAIN_PRODUCE_MAX_IN_FLIGHT_SHARDS", min=1,
                                            max=65_536, help="unacknowledged shards held in memory before "
                                                             "the producer waits for the brokers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``streamtrain produce``."""
    cfg.add_arguments(parser, ProduceSettings)


def run(args: argparse.Namespace) -> int:
    """Produce, print the exact acknowledged count; exit 0, 1 (send failures) or 130 (interrupted)."""
    s = cfg.from_args(ProduceSettings, args)
    console = Console(stderr=True)
    report = produce(s.bootstrap, s.topic, s.source, partitions=s.partitions, shard_size=s.shard_size,
                     rate=s.rate, limit=s.limit, split=s.split, producer_id=s.producer_id,
                     progress=s.progress and console.is_terminal, console=console,
                     outage_limit_s=s.outage_limit_s, max_in_flight_shards=s.max_in_flight_shards)
    print(f"produced {report.records} records in {report.shards} shards to {report.topic} "
          f"({report.partitions} partitions) as {report.producer_id} in {report.elapsed_s:.1f} s "
          f"({report.records_per_s:,.0f} records/s); failed {report.failed_records}"
          + ("; interrupted" if report.interrupted else ""), flush=True)
    for error in report.errors:
        console.print(f"[red]send error:[/red] {error}")
    if report.failed_records:
        return 1
    return 130 if report.interrupted else 0
