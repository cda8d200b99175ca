"""``streamtrain produce-events``: impressions and their delayed clicks (with the ground truth of every label)
for ``streamtrain join``.

Prints one final line with the exact acknowledged counts, also after Ctrl-C (exit code 130 then, 1 when
sends failed)::

    produced 100000 impressions to impressions and 38121 feedback events to feedback (4 partitions) in 2.1 s ...

See docs/join.md, *The events source*.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Literal, cast

from common import settings as cfg

from .clickevents import ClickEvents, click_stream
from .events_producer import produce_events
from .settings import EventsSettings

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``streamtrain produce-events``."""
    cfg.add_arguments(parser, EventsSettings)


def run(args: argparse.Namespace) -> int:
    """Produce the events, print the exact acknowledged counts; exit 0, 1 (send failures) or 130 (interrupted).

    Raises:
        SettingsError: a bad setting (the stream's spec included).
    """
    s = cfg.from_args(EventsSettings, args)
    try:
        stream = click_stream(s.stream)
    except ValueError as exc:
        raise cfg.SettingsError(f"--stream / STREAMTRAIN_EVENTS_STREAM: {exc}") from None
    events = ClickEvents(stream=stream, rate_per_s=s.rate_per_s,
                         start_ms=int(time.time() * 1000) if s.start_ms is None else s.start_ms,
                         delay_mean_s=s.delay_mean_s, disorder_ms=s.disorder_ms, seed=s.seed, partitions=s.partitions,
                         train_split=s.train_split)
    try:
        report = produce_events(s.bootstrap, s.impressions, s.feedback, events, limit=s.limit,
                                partitions=s.partitions, rate=s.rate, final_watermark_s=s.final_watermark_s,
                                truth_path=s.truth or None, window_s=s.window_s,
                                fmt=cast(Literal["msgpack", "json"], s.format))
    except ValueError as exc:  # the topics are one, or they partition differently
        raise cfg.SettingsError(str(exc)) from None
    print(f"produced {report.impressions} impressions to {report.impressions_topic} and {report.feedback} feedback "
          f"events to {report.feedback_topic} ({report.partitions} partitions) in {report.elapsed_s:.1f} s "
          f"({report.events_per_s:,.0f} events/s); "
          + (f"punctuation at {report.watermark_ms} on every partition" if report.watermark_ms is not None
             else "no punctuation")
          + f"; failed {report.failed}"
          + (f"; truth of {report.truth_rows} impressions in {s.truth}" if s.truth else "")
          + ("; interrupted" if report.interrupted else ""), flush=True)
    for error in report.errors:
        print(f"send error: {error}", file=sys.stderr, flush=True)
    if report.failed:
        return 1
    return 130 if report.interrupted else 0
