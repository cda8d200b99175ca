"""Produce a source to a training topic as shards, counting only acknowledged records.

:func:`produce` sends shards round-robin over the partitions with an idempotent ``acks=all`` producer,
at most ``max_in_flight_shards`` unacknowledged, and counts a record in its :class:`ProduceReport` only
once the broker acknowledged it. See docs/records.md, *Producing: only acknowledged records count*.

With a replica's URL (``score_url``), :class:`ScoreSampler` POSTs every Nth record, with its label, to the
replica's ``/v1/predict`` before the record is produced: the replica answers it from a model no trainer
has trained on it yet, and computes the AUC of those answers (the served AUC). Scoring never fails
production: a failure is counted and logged at most once a minute, and the time spent on it is bounded.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.parse
import urllib.request
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

__all__ = ["ProduceReport", "ScoreSampler", "default_producer_id", "iter_shards", "produce"]

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
    scored: int = 0
    """Sampled records a replica answered before they were produced (``score_url``)."""
    score_failed: int = 0
    """Sampled records whose request to the replica failed (unreachable, not ready, refused)."""
    score_skipped: int = 0
    """Sampled records not sent to the replica: scoring was over its share of the time
    (:data:`SCORE_TIME_SHARE`) or waiting after a failure."""

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


SCORE_TIMEOUT_S = 0.5
"""Longest wait for the replica's answer to one request of sampled records."""
SCORE_TIME_SHARE = 0.1
"""Most of the producer's time scoring may take: after a request of ``t`` seconds (answered or failed),
sampled records are skipped for ``t * (1 / share - 1)`` seconds, so a slow, hanging or absent replica
slows production by at most this share (a paced producer's wait before a send is not counted)."""
SCORE_LOG_EVERY_S = 60.0
"""Scoring failures are logged at most this often (with the count since the last line)."""


class ScoreSampler:
    """Scores every ``every``-th record of the stream (by sequence number) on a serving replica before the
    producer sends it: one ``POST {url}/v1/predict`` of ``{"records": [...]}`` per shard, each record in the
    training topic's JSON form with its label (``{"x": [...], "ids": {feature: [ids]}, "y": label}``).

    Only the standard library: the data plane does not depend on the serving package. A failure (refused,
    timed out, a 503 while the replica loads its first state) is counted, never raised; ``time_share``
    (default :data:`SCORE_TIME_SHARE`) bounds the producer's time it takes.

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL, or ``every`` < 1.
    """

    def __init__(self, url: str, token: str = "", every: int = 10, *, timeout_s: float = SCORE_TIMEOUT_S,
                 time_share: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"score URL must be http://host:port or https://host:port, got {url!r}")
        if every < 1:
            raise ValueError(f"score_every must be >= 1, got {every}")
        time_share = SCORE_TIME_SHARE if time_share is None else time_share
        if not 0 < time_share <= 1:
            raise ValueError(f"time_share must be in (0, 1], got {time_share}")
        self.url, self.every, self.timeout_s = url.rstrip("/"), every, timeout_s
        self._parts = parts
        self._path = parts.path.rstrip("/") + "/v1/predict"
        self._headers = {"Content-Type": "application/json", "Connection": "keep-alive",
                         **({"Authorization": f"Bearer {token}"} if token else {})}
        self._pause = 1 / time_share - 1
        self._clock = clock
        self._conn: http.client.HTTPConnection | None = None
        self._resume_at = 0.0
        self._logged_at: float | None = None
        self._unlogged = 0
        self.scored = self.failed = self.skipped = 0
        self.seconds = 0.0
        """Time spent scoring (requests, answered or not)."""
        self.last_error = ""

    def sampled(self, first_seq: int, n: int) -> range:
        """Indices in a shard of ``n`` records starting at sequence number ``first_seq`` of the records sampled."""
        start = -first_seq % self.every
        return range(start, n, self.every)

    def before_send(self, shard: Examples, first_seq: int, idle_s: float = 0.0) -> None:
        """Score the sampled records of ``shard`` (its first record has sequence number ``first_seq``);
        ``idle_s``: how long the producer would wait anyway before sending it (a paced producer's time
        ahead of its rate), which scoring may take without counting against its share."""
        rows = self.sampled(first_seq, len(shard))
        if not rows:
            return
        now = self._clock()
        if now < self._resume_at:
            self.skipped += len(rows)
            return
        body = json.dumps({"records": [_json_record(shard, i) for i in rows]}, separators=(",", ":")).encode()
        error = self._post(body)
        done = self._clock()
        self.seconds += done - now
        self._resume_at = done + max(0.0, done - now - idle_s) * self._pause
        if error is None:
            self.scored += len(rows)
            return
        self.failed += len(rows)
        self.last_error = error
        self._unlogged += len(rows)
        if self._logged_at is None or self._clock() - self._logged_at >= SCORE_LOG_EVERY_S:
            logger.warning("scoring sampled records on %s failed for %d record(s)%s: %s", self.url, self._unlogged,
                           "" if self._logged_at is None else f" in the last {SCORE_LOG_EVERY_S:.0f} s", error)
            self._logged_at, self._unlogged = self._clock(), 0

    def _post(self, body: bytes) -> str | None:
        """POST ``body``; None when answered 200, else why not."""
        try:
            if self._conn is None:
                kind = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
                self._conn = kind(self._parts.hostname or "", self._parts.port, timeout=self.timeout_s)
            self._conn.request("POST", self._path, body=body, headers=self._headers)
            resp = self._conn.getresponse()
            answer = resp.read()
            if resp.status == 200:
                return None
            try:
                reason = str(json.loads(answer).get("error", ""))[:200]
            except (ValueError, AttributeError):
                reason = answer[:200].decode(errors="replace")
            if resp.will_close:
                self.close()
            return f"HTTP {resp.status}" + (f": {reason}" if reason else "")
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    def wait_ready(self, timeout_s: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout_s`` for the replica's ``GET /v2/health/ready`` to answer 200 (polled every
        0.2 s; ``stop`` ends the wait); whether it did. Never raises: a replica that stays away only costs
        the served AUC its first records."""
        deadline = self._clock() + timeout_s
        ready_url = f"{self.url}/v2/health/ready"
        while not stop.is_set():
            try:
                with urllib.request.urlopen(ready_url, timeout=self.timeout_s) as resp:
                    if resp.status == 200:
                        logger.info("the replica at %s is ready: producing", self.url)
                        return True
            except (OSError, http.client.HTTPException):
                pass
            if self._clock() >= deadline:
                logger.warning("the replica at %s is not ready after %.0f s: producing anyway (the records "
                               "before it is are not scored)", self.url, timeout_s)
                return False
            stop.wait(0.2)
        return False

    def close(self) -> None:
        """Close the connection to the replica (the next request opens one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _json_record(shard: Examples, i: int) -> dict[str, object]:
    """Record ``i`` of ``shard`` in the training topic's single-record JSON form, its label included."""
    record: dict[str, object] = {}
    if shard.x.shape[1]:
        record["x"] = shard.x[i].tolist()
    if shard.ids:
        record["ids"] = {name: col.values[col.offsets[i]:col.offsets[i + 1]].tolist()
                         for name, col in shard.ids.items()}
    record["y"] = shard.y[i].item()
    return record


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
            outage_limit_s: float = DEFAULT_LIMIT_S, score_url: str = "", score_token: str = "",
            score_every: int = 10, score_wait_s: float = 0.0) -> ProduceReport:
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
        score_url: a serving replica's base URL: every ``score_every``-th record is scored there, with
            its label, before it is sent (:class:`ScoreSampler`); empty: off.
        score_token: the bearer token of the replica's model routes.
        score_every: the share of the stream scored: every Nth record.
        score_wait_s: wait up to this long for the replica to be ready before producing (0: not at all), so
            the stream's first records are scored too.

    Raises:
        ValueError: a bad argument. SourceError: a bad source.
    """
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 records/s, got {rate}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if max_in_flight_shards < 1:
        raise ValueError(f"max_in_flight_shards must be >= 1, got {max_in_flight_shards}")
    scorer = ScoreSampler(score_url, score_token, score_every) if score_url else None  # validates the URL
    src = load_source(source, split) if isinstance(source, str) else source
    shards = iter_shards(src, shard_size, limit)  # validates shard_size
    pid = producer_id or default_producer_id()
    stop = stop or threading.Event()
    count = ensure_topic(bootstrap, topic, partitions)
    acks = _Acks(max_in_flight_shards)
    outage = Outage(f"Kafka at {bootstrap}", outage_limit_s, logger)
    seq = 0
    if scorer is not None and score_wait_s > 0:
        scorer.wait_ready(score_wait_s, stop)
    started = time.monotonic()
    logger.info("producing %s to %s (%d partitions) as producer %s", src, topic, count, pid)
    with ExitStack() as stack:
        producer = reliable_producer(bootstrap, client_id=f"streamtrain-producer-{pid}",
                                     linger_ms=5, batch_size=1 << 20)
        stack.callback(producer.close)
        stack.callback(producer.flush, flush_timeout_s)  # runs first: nothing sent is dropped
        if scorer is not None:
            stack.callback(scorer.close)
            logger.info("scoring every %d-th record on %s before producing it", scorer.every, scorer.url)
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
                    if scorer is not None and not stop.is_set():  # before the send: no trainer trained on them
                        ahead = started + seq / rate - time.monotonic() if rate is not None else 0.0
                        scorer.before_send(shard, seq, idle_s=max(0.0, ahead))  # a paced producer's wait is free
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
                               interrupted=interrupted, errors=tuple(acks.errors),
                               scored=scorer.scored if scorer else 0, score_failed=scorer.failed if scorer else 0,
                               score_skipped=scorer.skipped if scorer else 0)
    if scorer is not None:
        logger.info("scored %d sampled records on %s before producing them (%d failed, %d skipped; %.1f s "
                    "spent scoring)%s", scorer.scored, scorer.url, scorer.failed, scorer.skipped, scorer.seconds,
                    f"; last error: {scorer.last_error}" if scorer.last_error else "")
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
