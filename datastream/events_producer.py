"""Write a :class:`~datastream.clickevents.ClickEvents` stream to an impressions and a feedback topic.

:func:`produce_events` sends every event to its topic, keyed by the impression id, to the partition
kafka-python's default partitioner would pick for the key (given explicitly), with an idempotent
``acks=all`` producer, counting an event only once the broker acknowledged it. At the end it writes one
punctuation to every partition of both topics (the last event time plus ``final_watermark_s``), so a
joiner can close the last windows, and, when asked, the ground truth of every label it wrote. See
docs/join.md, *The events source*.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
from kafka.errors import KafkaError

from .clickevents import FEEDBACK, IMPRESSION, ClickEvents
from .join.events import encode_punctuation
from .producer import _ctrl_c_sets
from .topics import ensure_topic, reliable_producer

__all__ = ["EventsReport", "produce_events"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventsReport:
    """What :func:`produce_events` did; every count is exact (acknowledged by the broker, ``acks=all``)."""

    impressions_topic: str
    """The impressions topic."""
    feedback_topic: str
    """The feedback topic."""
    impressions: int
    """Impressions acknowledged."""
    feedback: int
    """Feedback events (clicks) acknowledged."""
    punctuations: int
    """Punctuations acknowledged (one per partition of each topic after a complete run)."""
    failed: int
    """Events and punctuations whose send failed (not on the topics); 0 on success."""
    partitions: int
    """Partition count of both topics."""
    elapsed_s: float
    """Seconds from the first send to the end of the final flush."""
    interrupted: bool
    """True when a stop request (or Ctrl-C) ended production early (then no punctuation is written)."""
    last_event_ms: int | None
    """The latest event time sent; None when nothing was."""
    watermark_ms: int | None
    """The punctuations' event time; None when none was written."""
    truth_rows: int = 0
    """Impressions in the ground-truth file (0 without one)."""
    errors: tuple[str, ...] = field(default=())
    """The first few send errors, for the log."""

    @property
    def events_per_s(self) -> float:
        """Acknowledged impressions and feedback events per second."""
        return (self.impressions + self.feedback) / self.elapsed_s if self.elapsed_s > 0 else 0.0


class _Acks:
    """Counts acknowledgements per kind of message, from the producer's I/O thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked = [0, 0, 0]  # impressions, feedback, punctuations
        self.failed = 0
        self.errors: list[str] = []
        self.ok = [self._ok(kind) for kind in range(3)]

    def _ok(self, kind: int) -> Callable[[object], None]:
        def ok(_metadata: object) -> None:
            with self.lock:
                self.acked[kind] += 1
        return ok

    def fail(self, exc: BaseException) -> None:
        """The errback of every send (and what a send that raised counts as)."""
        with self.lock:
            self.failed += 1
            if len(self.errors) < 5:
                self.errors.append(f"{type(exc).__name__}: {exc}")


def produce_events(bootstrap: str, impressions_topic: str, feedback_topic: str, events: ClickEvents, *,
                   limit: int | None, partitions: int, rate: float | None = None, final_watermark_s: float = 3600.0,
                   truth_path: str | Path | None = None, window_s: float = 30.0,
                   fmt: Literal["msgpack", "json"] = "msgpack", stop: threading.Event | None = None,
                   flush_timeout_s: float = 60.0) -> EventsReport:
    """Produce the events of the first ``limit`` impressions of ``events`` (every click included) and return
    exact acknowledged counts.

    Args:
        bootstrap: Kafka ``host:port`` list.
        impressions_topic: where impressions go; created with ``partitions`` partitions when missing.
        feedback_topic: where clicks go; created alike. Both must end up with the same partition count
            (``events.partitions`` follows it).
        events: the stream.
        limit: impressions to write (``None``: until stopped).
        partitions: partitions of a topic created here.
        rate: events (impressions and clicks) per second of wall time to stay under (``None``: as fast as
            the producer takes them).
        final_watermark_s: the punctuations written at the end say event time has reached the last event's
            time plus this many seconds.
        truth_path: write the ground truth there (JSON lines, :meth:`~datastream.clickevents.Truth.write`):
            every impression sent, with its click if that was sent too, labelled for ``window_s``.
        window_s: the join window the truth's labels are for.
        fmt: encoding of the events, ``msgpack`` or ``json``.
        stop: set it to stop early; Ctrl-C does the same in the main thread.
        flush_timeout_s: how long the final flush may take.

    Raises:
        ValueError: a bad argument, the topics are one, or they have different partition counts.
    """
    if impressions_topic == feedback_topic:
        raise ValueError(f"impressions and feedback need topics of their own, both are {impressions_topic!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 impressions, got {limit}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 events/s, got {rate}")
    if not final_watermark_s >= 0:
        raise ValueError(f"final_watermark_s must be >= 0, got {final_watermark_s}")
    if not window_s >= 0:
        raise ValueError(f"window_s must be >= 0, got {window_s}")
    count = ensure_topic(bootstrap, impressions_topic, partitions)
    feedback_count = ensure_topic(bootstrap, feedback_topic, partitions)
    if count != feedback_count:
        raise ValueError(f"topic {impressions_topic} has {count} partitions and {feedback_topic} {feedback_count}: "
                         "impressions and feedback must partition alike")
    if events.partitions != count:
        events = replace(events, partitions=count)
    blocks = events.blocks(limit, fmt=fmt)  # validates fmt
    stop = stop or threading.Event()
    acks = _Acks()
    topics = {IMPRESSION: impressions_topic, FEEDBACK: feedback_topic}
    sent_imps: list[np.ndarray] = []
    sent_clicks: list[np.ndarray] = []
    last_ms: int | None = None
    sent = raised = 0  # sends handed to the producer; sends that raised
    interrupted = False
    started = time.monotonic()
    logger.info("producing impressions to %s and clicks to %s (%d partitions): %s", impressions_topic,
                feedback_topic, count, events)
    with ExitStack() as stack:
        producer = reliable_producer(bootstrap, client_id="streamtrain-events", linger_ms=5, batch_size=1 << 20)
        stack.callback(producer.close)
        stack.callback(producer.flush, flush_timeout_s)  # runs first: nothing sent is dropped
        sending = threading.Event()
        stack.enter_context(_ctrl_c_sets(stop, sending))
        try:
            for block in blocks:
                kinds, keys, values = block.kind.tolist(), block.keys, block.values
                parts = block.partition.tolist()
                done = 0
                try:
                    for j, kind in enumerate(kinds):
                        if rate is not None:
                            ahead = started + sent / rate - time.monotonic()
                            if ahead > 0.001:
                                stop.wait(ahead)
                        if stop.is_set():
                            interrupted = True
                            break
                        sending.set()
                        try:
                            producer.send(topics[kind], values[j], key=keys[j], partition=parts[j]) \
                                .add_callback(acks.ok[kind]).add_errback(acks.fail)
                            sent += 1
                            done = j + 1
                        except KafkaError as exc:  # the buffer stayed full past max_block_ms: the brokers are away
                            acks.fail(exc)
                            raised += 1
                            interrupted = True
                            break
                        finally:
                            sending.clear()
                finally:  # what was handed to the producer, for the truth
                    if done:
                        kind_sent, index_sent = block.kind[:done], block.index[:done]
                        sent_imps.append(index_sent[kind_sent == IMPRESSION])
                        sent_clicks.append(index_sent[kind_sent == FEEDBACK])
                        block_last = int(block.t_ms[:done].max())
                        last_ms = block_last if last_ms is None else max(last_ms, block_last)
                if interrupted:
                    break
        except KeyboardInterrupt:  # a second Ctrl-C
            interrupted = True
        watermark = None
        if not interrupted:
            watermark = (events.start_ms if last_ms is None else last_ms) + round(final_watermark_s * 1000)
            mark = encode_punctuation(watermark, fmt=fmt)
            for topic in (impressions_topic, feedback_topic):
                for p in range(count):
                    try:
                        producer.send(topic, mark, partition=p).add_callback(acks.ok[2]).add_errback(acks.fail)
                        sent += 1
                    except KafkaError as exc:
                        acks.fail(exc)
                        raised += 1
        producer.flush(flush_timeout_s)
    elapsed = time.monotonic() - started
    truth_rows = 0
    if truth_path is not None:
        imps = np.concatenate(sent_imps) if sent_imps else np.empty(0, np.int64)
        clicks = np.concatenate(sent_clicks) if sent_clicks else np.empty(0, np.int64)
        truth = events.truth(window_s, int(imps.max()) + 1 if len(imps) else 0)
        if interrupted:  # only what was sent: an impression cut off, a click never written
            truth = truth.select(imps, clicks)
        truth.write(truth_path)
        truth_rows = len(truth)
    with acks.lock:
        report = EventsReport(
            impressions_topic=impressions_topic, feedback_topic=feedback_topic, impressions=acks.acked[IMPRESSION],
            feedback=acks.acked[FEEDBACK], punctuations=acks.acked[2],
            failed=sent + raised - sum(acks.acked),  # failed, or not acknowledged by the end of the flush
            partitions=count, elapsed_s=elapsed, interrupted=interrupted, last_event_ms=last_ms,
            watermark_ms=watermark, truth_rows=truth_rows, errors=tuple(acks.errors))
    logger.info("%d impressions to %s and %d clicks to %s acknowledged, %d punctuations at %s (%d failed)%s",
                report.impressions, impressions_topic, report.feedback, feedback_topic, report.punctuations,
                watermark, report.failed, " after a stop request" if interrupted else "")
    return report
