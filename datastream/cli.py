"""``streamtrain produce``: stream a source into a training topic as shards.

Prints one final line with the exact count of acknowledged records, also after
Ctrl-C (exit code 130 then, 1 when sends failed)::

    produced 5000 records in 20 shards to digits (4 partitions) as host-123-ab12cd34 in 1.2 s ...

With ``--score-url`` it also says how many sampled records a serving replica scored before they were
produced (a replica's failures never fail production).
"""

from __future__ import annotations

import argparse

from rich.console import Console

from common import settings as cfg

from .producer import produce
from .settings import ProduceSettings

__all__ = ["add_arguments", "run"]


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
                     outage_limit_s=s.outage_limit_s, max_in_flight_shards=s.max_in_flight_shards,
                     score_url=s.score_url, score_token=s.score_token, score_every=s.score_every,
                     score_wait_s=s.score_wait_s)
    print(f"produced {report.records} records in {report.shards} shards to {report.topic} "
          f"({report.partitions} partitions) as {report.producer_id} in {report.elapsed_s:.1f} s "
          f"({report.records_per_s:,.0f} records/s); failed {report.failed_records}"
          + ("; interrupted" if report.interrupted else "")
          + (f"; scored {report.scored} sampled records on {s.score_url} before producing them "
             f"({report.score_failed} failed, {report.score_skipped} skipped)" if s.score_url else ""), flush=True)
    for error in report.errors:
        console.print(f"[red]send error:[/red] {error}")
    if report.failed_records:
        return 1
    return 130 if report.interrupted else 0
