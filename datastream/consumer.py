"""The trainers' consumer: explicit assignment, background prefetch, exact offset ranges.

:class:`ShardConsumer` decodes in a background thread and hands out :class:`Batch` objects whose
``offsets`` cover every message consumed exactly once, rejected ones included (they go to the
dead-letter topic); the coordinator, not a Kafka group, decides the assignment.
See docs/records.md, *Consuming: batches with exact offset ranges*.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from common.outage import DEFAULT_LIMIT_S, DependencyUnavailable, Outage

from .dlq import DeadLetterWriter
from .jagged import Jagged, concat_features
from .records import DEFAULT_MAX_RECORD_BYTES, LABEL_KINDS, DecodeError, Records, decode_record, label_kind_of
from .topics import broker_reachable

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "ConsumerClosedError", "ConsumerStats", "ShardConsumer"]

logger = logging.getLogger(__name__)

PARTITION_FETCH_BYTES = 4 << 20
"""Bytes one fetch asks of each partition (``max.partition.fetch.bytes``). A shard larger than this
still comes whole (the broker returns a partition's first record batch whatever its size; topics
take shards up to ``datastream.topics.MAX_MESSAGE_BYTES``, 16 MB). It bounds the first fetch on a
backlog: with 16 MB a partition, a trainer starting on four partitions of 400 KB shards got its
first batch 0.21-0.25 s after assigning them (the whole 63 MB backlog came and was parsed first),
with 4 MB 0.06 s, and read the backlog as fast (1 MB: 0.014 s, a third slower to read)."""


@dataclass(frozen=True)
class Batch:
    """Records for one training step, with the exact Kafka offsets they came from."""

    x: torch.Tensor
    """Dense features, float32 ``[n, d]`` (n may be 0 when every message was rejected; d is 0 on a
    stream whose records carry only IDs)."""
    y: torch.Tensor
    """Labels ``[n]``: int64 for classification, float32 for regression."""
    offsets: dict[int, tuple[int, int]]
    """Partition -> (first offset, next offset) covering every message consumed, rejected ones included."""
    samples: list[tuple[str, int, int]]
    """(producer_id, first_seq, count) runs for the rows of ``x``, in row order. Records of other
    clients are named ``"<topic>/<partition>"`` with their Kafka offset as seq."""
    produced_ts_ms: int
    """Oldest produce timestamp (ms since the epoch) of the messages in the batch."""
    rejected: int
    """Records sent to the dead-letter topic from this offset range."""
    ids: dict[str, Jagged] = field(default_factory=dict)
    """Categorical features (numpy, fresh arrays), in order of first appearance: every feature named by any
    message of the batch, each with ``n`` records; a record whose message lacks a feature has
    zero IDs for it. Empty when no record carries IDs."""
    w: torch.Tensor | None = None
    """Sample weights, float32 ``[n]``, row for row with ``x`` (a record without ``w`` weighs 1.0);
    ``None`` when no record of the batch carries a weight. The trainers weight the loss by them."""

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def next_offsets(self) -> dict[int, int]:
        """Partition -> next offset to consume after this batch (what to commit)."""
        return {p: nxt for p, (_, nxt) in self.offsets.items()}


@dataclass(frozen=True)
class ConsumerStats:
    """Counters of a :class:`ShardConsumer` since it started."""

    messages: int
    """Kafka messages consumed."""
    records: int
    """Records delivered in batches."""
    batches: int
    """Batches assembled."""
    rejected_records: int
    """Records sent to the dead-letter topic."""
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    """Rejected messages per reason."""
    lag: dict[int, int] = field(default_factory=dict)
    """Assigned partition -> messages between the consumer's position and the partition's end
    (its high watermark as of the last fetch); a partition not fetched yet is absent."""


class ConsumerClosedError(RuntimeError):
    """The consumer is closed, or its background thread stopped on an error (the cause is chained)."""


class _Builder:
    """Accumulates decoded messages into one batch."""

    def __init__(self) -> None:
        self.xs: list[np.ndarray] = []
        self.ys: list[np.ndarray] = []
        self.ids: list[tuple[int, dict[str, Jagged]]] = []  # (records, ids) per message
        self.has_ids = False
        self.ws: list[tuple[int, np.ndarray]] = []  # (first row, weights) of the weighted messages only
        self.rows = 0
        self.offsets: dict[int, tuple[int, int]] = {}
        self.samples: list[tuple[str, int, int]] = []
        self.rejected = 0
        self.ts_ms: int | None = None
        self.started = 0.0

    @property
    def empty(self) -> bool:
        return not self.offsets

    def cover(self, partition: int, first: int, offset: int, ts_ms: int | None) -> None:
        """Extend the partition's range to ``offset``; ``first`` is where it starts if new (``ts_ms``
        None: offsets that hold no record, which say nothing of when anything was produced)."""
        if not self.offsets:
            self.started = time.monotonic()
        lo = self.offsets[partition][0] if partition in self.offsets else first
        self.offsets[partition] = (lo, offset + 1)
        if ts_ms is not None:
            self.ts_ms = ts_ms if self.ts_ms is None else min(self.ts_ms, ts_ms)

    def add(self, rec: Records, producer: str, seq: int) -> None:
        self.xs.append(rec.x)
        self.ys.append(rec.y)
        self.ids.append((rec.count, rec.ids))
        self.has_ids = self.has_ids or bool(rec.ids)
        if rec.w is not None:
            self.ws.append((self.rows, rec.w))
        self.rows += rec.count
        last = self.samples[-1] if self.samples else None
        if last is not None and last[0] == producer and last[1] + last[2] == seq:
            self.samples[-1] = (producer, last[1], last[2] + rec.count)
        else:
            self.samples.append((producer, seq, rec.count))

    def build(self, feature_dim: int | None, label_kind: str | None) -> Batch:
        y_dtype = np.float32 if label_kind == "regression" else np.int64
        x = np.empty((self.rows, feature_dim or 0), dtype=np.float32)
        y = np.empty(self.rows, dtype=y_dtype)
        row = 0
        for xa, ya in zip(self.xs, self.ys, strict=True):  # the one copy: message bytes -> batch
            x[row:row + len(xa)] = xa
            y[row:row + len(ya)] = ya
            row += len(xa)
        ids = concat_features(self.ids) if self.has_ids else {}
        w = None
        if self.ws:  # only batches with weighted records pay for weights
            w = np.ones(self.rows, dtype=np.float32)
            for first, wa in self.ws:
                w[first:first + len(wa)] = wa
        import torch  # here, not at the top: the package's other users (the joiner, the producer) never load it

        return Batch(x=torch.from_numpy(x), y=torch.from_numpy(y), offsets=dict(self.offsets),
                     samples=list(self.samples), produced_ts_ms=int(self.ts_ms or 0), rejected=self.rejected,
                     ids=ids, w=None if w is None else torch.from_numpy(w))


class ShardConsumer:
    """Consume assigned partitions of a training topic as :class:`Batch` objects.

    Use as a context manager, or call :meth:`close`. Nothing is consumed until
    :meth:`assign` is called.

    Args:
        bootstrap: Kafka ``host:port`` list.
        topic: the training topic.
        feature_dim: dense features per record (0 for records of IDs only); learned from the first
            valid record when ``None``. Categorical features (``ids``) may vary from record to record.
        label_kind: ``"classification"`` or ``"regression"``; learned likewise when ``None``.
        max_records_per_batch: records per batch (a larger single shard makes its own batch).
        prefetch: batches decoded ahead of the trainer.
        group_id: Kafka consumer group for :meth:`commit` (no group protocol is used).
        dlq: write rejected messages to ``<topic>.dlq`` (they are counted and covered either way).
        max_record_bytes: larger message values are rejected as ``too_large``.
        max_wait_ms: a partial batch is handed out after this long, or as soon as no data is waiting.
        fetch_max_bytes, max_partition_fetch_bytes, fetch_min_bytes, fetch_max_wait_ms: Kafka fetch tuning
            (``max_partition_fetch_bytes``: :data:`PARTITION_FETCH_BYTES`).
        client_id: Kafka client id.
    """

    def __init__(self, bootstrap: str, topic: str, *, feature_dim: int | None = None,
                 label_kind: str | None = None, max_records_per_batch: int = 256, prefetch: int = 4,
                 group_id: str | None = None, dlq: bool = True,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_wait_ms: int = 100,
                 fetch_max_bytes: int = 64 << 20, max_partition_fetch_bytes: int = PARTITION_FETCH_BYTES,
                 fetch_min_bytes: int = 1, fetch_max_wait_ms: int = 100,
                 client_id: str = "streamtrain-consumer", outage_limit_s: float = DEFAULT_LIMIT_S) -> None:
        if feature_dim is not None and feature_dim < 0:
            raise ValueError(f"feature_dim must be >= 0, got {feature_dim}")
        if label_kind is not None and label_kind not in LABEL_KINDS:
            raise ValueError(f"label_kind must be one of {', '.join(LABEL_KINDS)}, got {label_kind!r}")
        for name, value in (("max_records_per_batch", max_records_per_batch), ("prefetch", prefetch),
                            ("max_record_bytes", max_record_bytes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.topic = topic
        self.feature_dim = feature_dim
        self.label_kind = label_kind
        self.max_records_per_batch = max_records_per_batch
        self.group_id = group_id
        self.max_record_bytes = max_record_bytes
        self._max_wait_s = max_wait_ms / 1000
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, group_id=group_id, client_id=client_id,
            # "none": an offset outside the log raises OffsetOutOfRangeError instead of jumping silently;
            # read_committed: a transactional writer's (streamtrain join) aborted records are never trained on
            enable_auto_commit=False, auto_offset_reset="none", isolation_level="read_committed",
            fetch_max_bytes=fetch_max_bytes, max_partition_fetch_bytes=max_partition_fetch_bytes,
            fetch_min_bytes=fetch_min_bytes, fetch_max_wait_ms=fetch_max_wait_ms)
        self._dlq = DeadLetterWriter(bootstrap, topic) if dlq else None
        self._out: queue.Queue[tuple[int, Batch]] = queue.Queue(maxsize=prefetch)  # (epoch, batch)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._epoch = 0  # bumped by every assign(); batches of an older epoch are dropped
        self._positions: dict[int, int] = {}  # partition -> next offset expected (worker-owned)
        self._handed: dict[int, int] = {}  # partition -> next offset after the batches poll() returned
        self._known: set[int] | None = None  # the topic's partitions, from metadata (worker-owned)
        self._builder = _Builder()
        self._stats_lock = threading.Lock()
        self._messages = self._records = self._batches = self._rejected = 0
        self._reasons: Counter[str] = Counter()
        self._lag: dict[int, int] = {}
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._outage = Outage(f"Kafka at {bootstrap}", outage_limit_s, logger)
        self._checked = 0.0  # when the brokers were last checked (monotonic)
        self._thread = threading.Thread(target=self._run, name=f"shard-consumer-{topic}", daemon=True)
        self._thread.start()

    # -- public API (any thread) ------------------------------------------------------------

    def __enter__(self) -> ShardConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def assign(self, positions: Mapping[int, int | None], timeout_s: float = 30.0) -> None:
        """Consume exactly these partitions, each from its start offset (``None``: its beginning).

        Replaces the previous assignment; batches prefetched before are discarded.

        Raises:
            ValueError: a partition does not exist or an offset is negative.
            ConsumerClosedError: the consumer is closed.
        """
        bad = {p: o for p, o in positions.items() if o is not None and o < 0}
        if bad:
            raise ValueError(f"start offsets must be >= 0; got {bad}")
        self._call(lambda: self._do_assign(dict(positions)), timeout_s)
        while True:  # drop batches of the previous assignment
            try:
                self._out.get_nowait()
            except queue.Empty:
                break

    def assignment(self) -> dict[int, int]:
        """Partition -> next offset after the batches :meth:`poll` returned (the assignment's start
        offsets before any); prefetched batches not yet returned do not count."""
        return self._call(lambda: dict(self._handed), 30.0)

    def poll(self, timeout_s: float = 1.0) -> Batch | None:
        """The next batch, or ``None`` when none is ready within ``timeout_s``.

        Raises:
            DependencyUnavailable: the brokers were unreachable for longer than the outage limit.
            ConsumerClosedError: closed, or the background thread failed otherwise (cause chained).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if isinstance(self._error, DependencyUnavailable):
                raise self._error
            if self._error is not None:
                raise ConsumerClosedError(f"consumer of {self.topic} stopped: {self._error}") from self._error
            if self._closed.is_set():
                raise ConsumerClosedError(f"consumer of {self.topic} is closed")
            try:
                epoch, batch = self._out.get(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return None
                continue
            if epoch == self._epoch:
                self._handed.update(batch.next_offsets)
                return batch

    def __iter__(self) -> Iterator[Batch]:
        """Batches until the consumer is closed."""
        while not self._closed.is_set():
            try:
                batch = self.poll(0.5)
            except ConsumerClosedError:
                if self._error is not None:
                    raise
                return
            if batch is not None:
                yield batch

    def commit(self, offsets: Mapping[int, int], timeout_s: float = 30.0) -> None:
        """Record ``partition -> next offset`` in Kafka under ``group_id`` (for lag tools).

        Raises:
            ValueError: no ``group_id`` was given.
        """
        if self.group_id is None:
            raise ValueError("commit() needs a group_id")
        request = {TopicPartition(self.topic, p): OffsetAndMetadata(o, "", -1) for p, o in offsets.items()}
        self._call(lambda: self._consumer.commit(request), timeout_s)

    def end_offsets(self, partitions: list[int] | None = None, timeout_s: float = 30.0) -> dict[int, int]:
        """Partition -> offset after the last message (all partitions of the topic by default)."""
        def ask() -> dict[int, int]:
            self._known = None  # partitions may have been added
            parts = partitions if partitions is not None else sorted(self._partitions())
            ends = self._consumer.end_offsets([TopicPartition(self.topic, p) for p in parts])
            return {tp.partition: o for tp, o in ends.items()}
        return self._call(ask, timeout_s)

    def stats(self) -> ConsumerStats:
        """Counters since the consumer started."""
        with self._stats_lock:
            return ConsumerStats(messages=self._messages, records=self._records, batches=self._batches,
                                 rejected_records=self._rejected, rejected_by_reason=dict(self._reasons),
                                 lag=dict(self._lag))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the background thread and close the Kafka clients (idempotent)."""
        self._closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # -- background thread -----------------------------------------------------------------

    def _call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        if self._closed.is_set() or self._error is not None:
            raise ConsumerClosedError(f"consumer of {self.topic} is closed") from self._error
        future: Future = Future()
        self._commands.put((fn, future))
        return future.result(timeout=timeout_s)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

    def _partitions(self, wanted: set[int] | None = None) -> set[int]:
        """The topic's partitions; metadata is fetched again only when ``wanted`` holds unknown ones."""
        if self._known is None or (wanted is not None and not wanted <= self._known):
            found = self._consumer.partitions_for_topic(self.topic)
            if not found:
                raise ValueError(f"topic {self.topic!r} does not exist")
            self._known = set(found)
        return self._known

    def _do_assign(self, positions: dict[int, int | None]) -> None:
        unknown = set(positions) - self._partitions(set(positions))
        if unknown:
            raise ValueError(f"topic {self.topic!r} has no partition(s) {sorted(unknown)}")
        tps = {p: TopicPartition(self.topic, p) for p in positions}
        begin = [tps[p] for p, o in positions.items() if o is None]
        starts = {tp.partition: o for tp, o in self._consumer.beginning_offsets(begin).items()} if begin else {}
        self._consumer.assign(list(tps.values()))
        resolved = {p: (starts[p] if o is None else o) for p, o in positions.items()}
        for p, o in resolved.items():
            self._consumer.seek(tps[p], o)
        self._positions = dict(resolved)
        self._handed = dict(resolved)
        self._builder = _Builder()
        self._epoch += 1
        with self._stats_lock:
            self._lag = {}
        logger.info("consumer of %s assigned %s (epoch %d)", self.topic, resolved, self._epoch)

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                self._run_commands()
                if not self._positions:
                    self._closed.wait(0.02)
                    continue
                polled = self._consumer.poll(timeout_ms=50, max_records=4096)
                self._check_brokers(bool(polled))
                epoch = self._epoch
                for messages in polled.values():
                    for msg in messages:
                        if self._epoch != epoch:
                            break  # reassigned meanwhile: the rest is from the old assignment
                        self._take(msg)
                if self._epoch == epoch:
                    self._skip_gaps()
                self._note_lag()
                b = self._builder
                if not b.empty and (b.rows >= self.max_records_per_batch or not polled
                                    or time.monotonic() - b.started >= self._max_wait_s):
                    self._emit()
        except BaseException as exc:  # surfaced to poll()
            logger.exception("consumer of %s stopped", self.topic)
            self._error = exc
        finally:
            self._closed.set()
            self._fail_commands()
            try:
                if self._dlq is not None:
                    self._dlq.close()
            finally:
                self._consumer.close(autocommit=False)

    def _fail_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(ConsumerClosedError(f"consumer of {self.topic} is closed"))

    def _check_brokers(self, got_records: bool) -> None:
        """Track a broker outage: one log line when it starts, one when it ends, and
        :class:`DependencyUnavailable` (stopping the consumer) once it outlasts the limit."""
        now = time.monotonic()
        if not got_records and now - self._checked < 1.0:
            return
        self._checked = now
        if got_records or broker_reachable(self._consumer._client):
            self._outage.recovered()
        else:
            self._outage.failed(ConnectionError("no connection to any broker"))

    def _note_lag(self) -> None:
        """Per-partition lag from the high watermarks of the last fetch (no broker request)."""
        lag = {}
        for p, position in self._positions.items():
            end = self._consumer.highwater(TopicPartition(self.topic, p))
            if end is not None:
                lag[p] = max(0, end - position)
        with self._stats_lock:
            self._lag = lag

    def _skip_gaps(self) -> None:
        """Cover the offsets the fetch stepped over that hold no record for us: a transaction's commit or
        abort marker and an aborted transaction's records (read_committed). They go in the batch being
        built (an offsets-only batch when it has no record), so a partition's committed offset reaches
        its end and nothing counts them as lag."""
        for p, expected in self._positions.items():
            position = self._consumer.position(TopicPartition(self.topic, p), timeout_ms=0)
            if position is not None and position > expected:
                self._builder.cover(p, expected, position - 1, None)
                self._positions[p] = position

    def _take(self, msg: Any) -> None:
        p, offset = msg.partition, msg.offset
        if offset < self._positions.get(p, offset + 1):
            return  # not ours any more, or before the seek position
        try:
            rec = decode_record(msg.value, feature_dim=self.feature_dim, label_kind=self.label_kind,
                                max_bytes=self.max_record_bytes)
        except DecodeError as err:
            self._reject(msg, err)
            return
        if self.feature_dim is None:
            self.feature_dim = int(rec.x.shape[1])
        if self.label_kind is None:
            self.label_kind = label_kind_of(rec.y)
        if self._builder.rows and self._builder.rows + rec.count > self.max_records_per_batch:
            epoch = self._epoch
            self._emit()
            if self._epoch != epoch:
                return  # reassigned while handing out the batch: this message is not ours
        b = self._builder
        if rec.producer_id is None:
            producer, seq = f"{self.topic}/{p}", offset
        else:
            producer, seq = rec.producer_id, rec.first_seq or 0
        b.cover(p, self._positions[p], offset, rec.ts_ms if rec.ts_ms is not None else msg.timestamp)
        b.add(rec, producer, seq)
        self._positions[p] = offset + 1
        with self._stats_lock:
            self._messages += 1
        if b.rows >= self.max_records_per_batch:
            self._emit()

    def _reject(self, msg: Any, err: DecodeError) -> None:
        if self._dlq is not None:
            self._dlq.send(msg.value, msg.headers or [], msg.partition, msg.offset, err)
        else:
            logger.warning("rejected %s[%d]@%d (no DLQ): %s", self.topic, msg.partition, msg.offset, err)
        b = self._builder
        b.cover(msg.partition, self._positions[msg.partition], msg.offset, msg.timestamp)
        b.rejected += err.count
        self._positions[msg.partition] = msg.offset + 1
        with self._stats_lock:
            self._messages += 1
            self._rejected += err.count
            self._reasons[err.reason] += 1

    def _emit(self) -> None:
        if self._dlq is not None and self._builder.rejected:
            self._dlq.flush()  # rejected messages are durable before their offsets are handed out
        batch = self._builder.build(self.feature_dim, self.label_kind)
        epoch = self._epoch
        self._builder = _Builder()
        while not self._closed.is_set():
            try:
                self._out.put((epoch, batch), timeout=0.05)
                break
            except queue.Full:
                self._run_commands()  # an assign() while we wait makes this batch stale
                if self._epoch != epoch:
                    return
        else:
            return
        with self._stats_lock:
            self._records += len(batch)
            self._batches += 1
