"""Produce a source to a training topic as shards, counting only acknowledged records.

:func:`produce` sends shards round-robin over the partitions with an idempotent ``acks=all`` producer,
at most ``max_in_flight_shards`` unacknowledged, and counts a record in its :class:`ProduceReport` only
once the broker acknowledged it. See docs/records.md, *Producing: only acknowledged records count*.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
from rich.console import Console
from rich.progress import Progress, ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from common.outage import DEFAULT_LIMIT_S, Outage

from .examples import Examples
from .records import encode_shard
from .sources import Source, SourceError, load_source
from .topics import broker_reachable, ensure_topic, reliable_producer

__all__ = ["ProduceReport", "default_producer_id", "iter_shards", "produce"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProduceReport:
    """What :func:`produce` did; every count is exact."""

    topic: str
    """The topic written to."""
    producer_id: str
    """Producer id written into every shard."""
    records: int
    """Records acknowledged by the broker (``acks=all``)."""
    shards: int
    """Shards acknowledged by the broker."""
    failed_records: int
    """Records whose send failed (not on the topic); 0 on success."""
    next_seq: int
    """One past the last sequence number handed out (acknowledged records have seq < next_seq)."""
    partitions: int
    """Partition count of the topic."""
    elapsed_s: float
    """Seconds from the first send to the end of the final flush."""
    interrupted: bool
    """True when a stop request (or Ctrl-C) ended production early."""
    errors: tuple[str, ...] = field(default=())
    """The first few send errors, for the log."""

    @property
    def records_per_s(self) -> float:
        """Acknowledged records per second."""
        return self.records / self.elapsed_s if self.elapsed_s > 0 else 0.0


def default_producer_id() -> str:
    """A producer id that no other run uses: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def iter_shards(source: Source, shard_size: int, limit: int | None = None) -> Iterator[Examples]:
    """Re-chunk the source's blocks into :class:`Examples` of ``shard_size`` records (the last may be
    short), IDs included; dense ones unpack as ``x, y``.

    Stops after ``limit`` records when given. Labels keep the first block's kind.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    parts: list[Examples] = []
    pending = total = 0
    y_dtype = None
    for block in source:
        if limit is not None and total + len(block) > limit:
            block = block.slice(0, limit - total)
        y = block.y
        if y_dtype is None:
            y_dtype = y.dtype
        elif y_dtype.kind != y.dtype.kind and (y_dtype.kind in "iu") != (y.dtype.kind in "iu"):
            raise SourceError(f"source {source.name}: labels changed from {y_dtype} to {y.dtype} mid-stream")
        total += len(block)
        done = 0
        while done < len(block):
            take = min(shard_size - pending, len(block) - done)
            parts.append(block.slice(done, done + take))
            done += take
            pending += take
            if pending == shard_size:
                yield _join(parts, source, y_dtype)
                parts, pending = [], 0
        if limit is not None and total >= limit:
            break
    if pending:
        yield _join(parts, source, y_dtype)


def _join(parts: list[Examples], source: Source, y_dtype: np.dtype | None) -> Examples:
    try:
        joined = parts[0] if len(parts) == 1 else Examples.concat(parts)  # one part stays a view
    except ValueError as exc:
        raise SourceError(f"source {source.name}: blocks disagree ({exc})") from None
    return joined if joined.y.dtype == y_dtype else replace(joined, y=joined.y.astype(y_dtype))


class _Acks:
    """Counts acknowledgements from the producer's I/O thread and bounds shards in flight."""

    def __init__(self, max_in_flight: int) -> None:
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(max_in_flight)
        self.records = self.shards = self.failed = 0
        self.errors: list[str] = []

    def sent(self, n: int) -> tuple[Callable[[object], None], Callable[[BaseException], None]]:
        """The send's callbacks (success, failure) for a shard of ``n`` records."""
        def ok(_metadata: object) -> None:
            with self.lock:
                self.records += n
                self.shards += 1
            self.slots.release()

        def failed(exc: BaseException) -> None:
            with self.lock:
                self.failed += n
                if len(self.errors) < 5:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            self.slots.release()
        return ok, failed


@contextmanager
def _ctrl_c_sets(stop: threading.Event, sending: threading.Event) -> Iterator[None]:
    """While inside, Ctrl-C sets ``stop`` instead of raising (main thread only).

    A second Ctrl-C raises ``KeyboardInterrupt`` (to get out of a source blocked on
    input), but never while ``sending`` is set, so every send gets its callbacks.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(_signum: int, _frame: object) -> None:
        if stop.is_set() and not sending.is_set():
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def produce(bootstrap: str, topic: str, source: Source | str, *, partitions: int = 1,
            shard_size: int = 256, rate: float | None = None, limit: int | None = None,
            split: str = "all", producer_id: str | None = None, progress: bool = False,
            stop: threading.Event | None = None, max_in_flight_shards: int = 256,
            flush_timeout_s: float = 60.0, console: Console | None = None,
            outage_limit_s: float = DEFAULT_LIMIT_S) -> ProduceReport:
    """Produce ``source`` to ``topic`` as shards and return exact acknowledged counts.

    Args:
        bootstrap: Kafka ``host:port`` list.
        topic: training topic; created with ``partitions`` partitions when missing.
        source: a :class:`Source` or a spec for :func:`load_source`.
        shard_size: records per shard.
        rate: records per second to stay under (``None``: as fast as acknowledged).
        limit: stop after this many records (``None``: until the source ends).
        split: split of a source given as a spec.
        producer_id: id written into the shards; default :func:`default_producer_id`.
        progress: show a progress bar with records/s on the console.
        stop: set it to stop early; Ctrl-C does the same in the main thread.
        max_in_flight_shards: unacknowledged shards allowed before waiting.
        flush_timeout_s: how long the final flush may take.
        outage_limit_s: how long the brokers may stay unreachable (one log line when an outage
            starts, one when it ends) before ``DependencyUnavailable`` names them.

    Raises:
        ValueError: a bad argument. SourceError: a bad source.
    """
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 records/s, got {rate}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if max_in_flight_shards < 1:
        raise ValueError(f"max_in_flight_shards must be >= 1, got {max_in_flight_shards}")
    src = load_source(source, split) if isinstance(source, str) else source
    shards = iter_shards(src, shard_size, limit)  # validates shard_size
    pid = producer_id or default_producer_id()
    stop = stop or threading.Event()
    count = ensure_topic(bootstrap, topic, partitions)
    acks = _Acks(max_in_flight_shards)
    outage = Outage(f"Kafka at {bootstrap}", outage_limit_s, logger)
    seq = 0
    started = time.monotonic()
    logger.info("producing %s to %s (%d partitions) as producer %s", src, topic, count, pid)
    with ExitStack() as stack:
        producer = reliable_producer(bootstrap, client_id=f"streamtrain-producer-{pid}",
                                     linger_ms=5, batch_size=1 << 20)
        stack.callback(producer.close)
        stack.callback(producer.flush, flush_timeout_s)  # runs first: nothing sent is dropped
        sending = threading.Event()
        stack.enter_context(_ctrl_c_sets(stop, sending))
        bar, task = _progress(stack, progress, console, topic)
        interrupted = False
        try:
            for i, shard in enumerate(shards):
                while not acks.slots.acquire(timeout=0.1):  # backpressure: wait for acknowledgements
                    if stop.is_set():
                        break
                    if broker_reachable(producer._sender._client):  # kafka-python keeps its client on the sender
                        outage.recovered()
                    else:  # logs the start of an outage; raises once it outlasts the limit
                        outage.failed(ConnectionError("no connection to any broker"))
                else:
                    outage.recovered()
                    if rate is not None:
                        stop.wait(max(0.0, started + seq / rate - time.monotonic()))
                    if stop.is_set():
                        acks.slots.release()
                    else:
                        sending.set()
                        value = encode_shard(shard.x, shard.y, ids=shard.ids, producer_id=pid, first_seq=seq)
                        ok, failed = acks.sent(len(shard))
                        producer.send(topic, value, partition=i % count).add_callback(ok).add_errback(failed)
                        seq += len(shard)
                        sending.clear()
                        if bar is not None and i % 16 == 0:
                            bar.update(task, completed=acks.records)
                        continue
                interrupted = True
                break
        except KeyboardInterrupt:  # a second Ctrl-C while the source was blocked
            interrupted = True
        producer.flush(flush_timeout_s)
        if bar is not None:
            bar.update(task, completed=acks.records)
    elapsed = time.monotonic() - started
    with acks.lock:
        report = ProduceReport(topic=topic, producer_id=pid, records=acks.records, shards=acks.shards,
                               failed_records=acks.failed + (seq - acks.records - acks.failed),
                               next_seq=seq, partitions=count, elapsed_s=elapsed,
                               interrupted=interrupted, errors=tuple(acks.errors))
    logger.info("producer %s: %d records in %d shards acknowledged on %s (%d failed)%s",
                pid, report.records, report.shards, topic, report.failed_records,
                " after a stop request" if interrupted else "")
    return report


class _RateColumn(ProgressColumn):
    """Acknowledged records per second."""

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:,.0f} records/s" if task.speed else "- records/s")


def _progress(stack: ExitStack, enabled: bool, console: Console | None,
              topic: str) -> tuple[Progress | None, TaskID]:
    if not enabled:
        return None, TaskID(0)
    bar = Progress(TextColumn("[bold]{task.description}"), TextColumn("{task.completed:,} records"),
                   _RateColumn(), TimeElapsedColumn(),
                   console=console or Console(stderr=True), transient=False)
    stack.enter_context(bar)
    return bar, bar.add_task(f"produce → {topic}", total=None)
