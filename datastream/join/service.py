"""The joiner's Kafka loop: consume a task's inputs in event-time order, join, and commit the records, the
state's changelog and the input offsets in one Kafka transaction.

Partitions are split between joiners by Kafka's consumer group (the range assignor gives one joiner
partition ``p`` of every input topic: a *task*). Each joiner has one transactional producer,
```<app-id>-<instance-id>``: a restarted joiner aborts what its predecessor left open, and a stale one is
fenced by the group's generation (KIP-447) when it commits. A Kafka error ends the session: the joiner
drops what it had not committed and starts afresh from what was (its clients made anew, its tasks
restored), as a restarted process would, until the outage limit. See docs/join.md, *Exactly once*.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import InvalidProducerEpochError, KafkaError, KafkaTimeoutError, ProducerFencedError
from kafka.structs import OffsetAndMetadata, TopicPartition

from common.outage import DependencyUnavailable, Outage

from ..dlq import dlq_headers
from ..settings import JoinSettings
from ..topics import MAX_MESSAGE_BYTES, dlq_topic, ensure_topic
from .events import Feedback, Impression, JoinDecodeError, Punctuation, decode_event
from .state import JoinRules, Output, Source, TaskState

__all__ = ["JoinError", "JoinStats", "Joiner", "changelog_topic", "rules_of"]

logger = logging.getLogger(__name__)

_RESTORE_WAIT_S = 120.0  # longest a restore waits for a dead joiner's open transaction to end, then to read
_RESTORE_CALL_MS = 15_000  # longest a restore's offset lookup may block (kafka-python's own defaults never end)


def _position(consumer: KafkaConsumer, tp: TopicPartition) -> int:
    """``tp``'s position, looked up for at most :data:`_RESTORE_CALL_MS`."""
    position = consumer.position(tp, timeout_ms=_RESTORE_CALL_MS)
    if position is None:
        raise KafkaTimeoutError(f"no position of {tp.topic}[{tp.partition}] in {_RESTORE_CALL_MS} ms")
    return int(position)


class JoinError(RuntimeError):
    """The joiner cannot go on (its inputs disagree, or it was fenced); the message says why."""


def changelog_topic(app_id: str) -> str:
    """The compacted topic of a join's state."""
    return f"{app_id}.changelog"


def rules_of(s: JoinSettings) -> JoinRules:
    """The event-time rules of ``s``."""
    window_ms = round(s.window_s * 1000)
    return JoinRules(window_ms=window_ms, lateness_ms=round(s.allowed_lateness_s * 1000),
                     retain_ms=window_ms if s.retain_s is None else round(s.retain_s * 1000),
                     max_pending=s.max_pending, label=s.label, negative_rate=s.negative_rate, fmt=s.format)


@dataclass(frozen=True)
class JoinStats:
    """What a joiner has done, over the partitions it owns (counters restored with them)."""

    partitions: list[int]
    counters: dict[str, int]
    """``joined``, ``positives``, ``negatives``, ``negatives_dropped``, ``decided_early``, ``repeat``,
    ``ignored``, ``late.<reason>``, ``dead.<reason>``."""
    pending: int
    early_feedback: int
    watermark_ms: int | None
    """The lowest watermark of its tasks (None before any has one)."""
    transactions: int
    """Transactions committed by this process."""

    def report(self) -> dict[str, Any]:
        """The body of ``POST /v1/join/joiners/<name>`` (less ``url``)."""
        c = self.counters
        lag = None if self.watermark_ms is None else max(0.0, time.time() - self.watermark_ms / 1000)
        return {"partitions": self.partitions, "joined": c.get("joined", 0), "positives": c.get("positives", 0),
                "negatives": c.get("negatives", 0), "negatives_dropped": c.get("negatives_dropped", 0),
                "late": {k[5:]: v for k, v in c.items() if k.startswith("late.")},
                "dead_letters": {k[5:]: v for k, v in c.items() if k.startswith("dead.")},
                "decided_early": c.get("decided_early", 0), "pending": self.pending,
                "early_feedback": self.early_feedback, "watermark_ms": self.watermark_ms,
                "watermark_lag_s": lag, "transactions": self.transactions}


@dataclass
class _Task:
    """Partition ``p`` of every input topic, and its state."""

    p: int
    state: TaskState
    buffers: dict[TopicPartition, deque[tuple[int, Any, Any]]] = field(default_factory=dict)
    """Per input partition: (sort time, decoded event or error, message), in offset order."""
    next_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    last_arrival: dict[TopicPartition, float] = field(default_factory=dict)


class Joiner(ConsumerRebalanceListener):
    """One joiner process: call :meth:`run` until ``stop`` is set."""

    def __init__(self, s: JoinSettings, *, stop: threading.Event | None = None) -> None:
        self.s = s
        self.rules = rules_of(s)
        self.stop = stop or threading.Event()
        self.inputs = [s.impressions, *s.feedback_topics]
        self.changelog = changelog_topic(s.app_id)
        self._tasks: dict[int, _Task] = {}
        self._suspended: dict[int, TaskState] = {}
        self._in_txn = False
        self._last_commit = time.monotonic()
        self._transactions = 0
        self._lock = threading.Lock()  # stats() is read from other threads
        self._stats = JoinStats([], {}, 0, 0, None, 0)
        counts = {t: ensure_topic(s.bootstrap, t, 1) for t in self.inputs}
        if len(set(counts.values())) != 1:
            raise JoinError(f"the input topics must have as many partitions each, so impressions and feedback "
                            f"partition alike; they have {counts}")
        self.partitions = counts[s.impressions]
        # with as many partitions, a record goes to the partition its impression came from (its key's, when the
        # inputs were partitioned by key as kafka-python and the Java client do) rather than hashing its key again
        self._same_partitions = ensure_topic(s.bootstrap, s.topic, s.partitions or self.partitions) == self.partitions
        got = ensure_topic(s.bootstrap, self.changelog, self.partitions, configs={"cleanup.policy": "compact"})
        if got != self.partitions:
            raise JoinError(f"changelog {self.changelog} has {got} partitions, the inputs {self.partitions}: it "
                            f"belongs to another join; choose another --app-id")
        for t in self.inputs:
            ensure_topic(s.bootstrap, dlq_topic(t), 1)
        if s.late:
            ensure_topic(s.bootstrap, s.late, self.partitions)
        self.outage = Outage(f"Kafka at {s.bootstrap}", s.outage_limit_s, logger)
        self.producer, self.consumer = self._clients()

    def _clients(self) -> tuple[KafkaProducer, KafkaConsumer]:
        """A transactional producer (its ``init_transactions`` aborts what a predecessor with our id left
        open) and a consumer subscribed to the inputs in the join's group."""
        s = self.s
        producer = KafkaProducer(
            bootstrap_servers=s.bootstrap, client_id=f"streamtrain-join-{s.instance_id}",
            transactional_id=f"{s.app_id}-{s.instance_id}", acks="all", enable_idempotence=True,
            transaction_timeout_ms=round(s.transaction_timeout_s * 1000), max_request_size=MAX_MESSAGE_BYTES,
            linger_ms=5, batch_size=256 * 1024)
        try:
            producer.init_transactions()
            consumer = KafkaConsumer(
                bootstrap_servers=s.bootstrap, group_id=s.app_id, client_id=f"streamtrain-join-{s.instance_id}",
                enable_auto_commit=False, isolation_level="read_committed", auto_offset_reset="earliest",
                partition_assignment_strategy=[RangePartitionAssignor], max_poll_records=10_000,
                session_timeout_ms=round(s.session_timeout_s * 1000),
                heartbeat_interval_ms=max(1000, round(s.session_timeout_s * 1000) // 4))
        except BaseException:
            producer.close(timeout=0)
            raise
        consumer.subscribe(self.inputs, listener=self)
        return producer, consumer

    # -- the group's callbacks (inside poll) ---------------------------------------------------------------
    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        """Commit what was joined; keep the states (a task kept needs no restore), drop the buffered events."""
        self._commit()
        for task in self._tasks.values():
            self._suspended[task.p] = task.state
        self._tasks = {}

    def on_partitions_lost(self, lost: Iterable[TopicPartition]) -> None:
        """Out of the group (a session that expired): what was not committed cannot be, and the states hold
        it, so abort the transaction and forget them (a task assigned again is restored)."""
        logger.warning("lost partitions %s: aborting what was not committed", sorted({tp.partition for tp in lost}))
        self._abort()
        self._tasks, self._suspended = {}, {}

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        """Resume or restore the tasks of the partitions assigned."""
        by_p: dict[int, set[str]] = {}
        for tp in assigned:
            by_p.setdefault(tp.partition, set()).add(tp.topic)
        tasks: dict[int, _Task] = {}
        for p, topics in sorted(by_p.items()):
            if topics != set(self.inputs):
                raise JoinError(f"partition {p} of {sorted(topics)} was assigned without the same partition of "
                                f"{sorted(set(self.inputs) - topics)}: every input needs the same partition count")
        restored = self._restore([p for p in sorted(by_p) if p not in self._suspended])
        for p in sorted(by_p):
            state = self._suspended.pop(p, None) or restored[p]
            task = _Task(p, state)
            now = time.monotonic()
            for t in self.inputs:
                tp = TopicPartition(t, p)
                task.buffers[tp] = deque()
                task.last_arrival[tp] = now
            tasks[p] = task
        self._suspended.clear()
        self._tasks = tasks
        self._publish()
        logger.info("joining partitions %s of %s", sorted(tasks), ", ".join(self.inputs))

    def _restore(self, partitions: list[int]) -> dict[int, TaskState]:
        """The tasks' states from their changelog partitions, read once no transaction is open on them."""
        if not partitions:
            return {}
        tps = [TopicPartition(self.changelog, p) for p in partitions]
        reader = KafkaConsumer(bootstrap_servers=self.s.bootstrap, isolation_level="read_committed",
                               enable_auto_commit=False, client_id="streamtrain-join-restore",
                               max_partition_fetch_bytes=MAX_MESSAGE_BYTES)
        raw = KafkaConsumer(bootstrap_servers=self.s.bootstrap, enable_auto_commit=False,
                            client_id="streamtrain-join-restore")
        records: dict[int, dict[bytes, bytes]] = {p: {} for p in partitions}
        read = 0
        try:
            deadline = time.monotonic() + _RESTORE_WAIT_S
            while True:  # a dead joiner's open transaction: wait for the broker to end it
                stable = reader.end_offsets(tps, timeout_ms=_RESTORE_CALL_MS)
                high = raw.end_offsets(tps, timeout_ms=_RESTORE_CALL_MS)
                if all(stable[tp] >= high[tp] for tp in tps):
                    break
                if time.monotonic() > deadline:
                    raise JoinError(f"{self.changelog} still has an open transaction after {_RESTORE_WAIT_S} s")
                time.sleep(0.2)
            reader.assign(tps)
            reader.seek_to_beginning(*tps)
            deadline = time.monotonic() + _RESTORE_WAIT_S
            while any(_position(reader, tp) < stable[tp] for tp in tps):
                if time.monotonic() > deadline:
                    raise KafkaTimeoutError(f"{self.changelog} {partitions} not read to {stable} in "
                                            f"{_RESTORE_WAIT_S} s")
                for tp, msgs in reader.poll(timeout_ms=500).items():
                    kept = records[tp.partition]
                    for m in msgs:
                        read += 1
                        if m.value is None:
                            kept.pop(m.key, None)
                        else:
                            kept[m.key] = m.value
        finally:
            reader.close()
            raw.close()
        states = {}
        for p in partitions:
            states[p] = state = TaskState.restore(self.rules, tuple(f"{t}/{p}" for t in self.inputs), records[p])
            logger.info("restored partition %d: %d pending, %d decided, watermark %s", p, len(state.pending),
                        len(state.decided), state.watermark)
        logger.info("read %d changelog records of partitions %s", read, partitions)
        return states

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Join until :attr:`stop` is set; then commit and close.

        Raises:
            JoinError: the join cannot go on: fenced, inputs that disagree, or Kafka unreachable for longer
                than the outage limit (the message names what).
        """
        try:
            while True:
                try:
                    self._session()
                    return
                except JoinError:
                    raise
                except KafkaError as exc:
                    cause = exc.__cause__
                    if isinstance(cause, JoinError):  # raised in a rebalance callback, re-raised by poll
                        raise cause from None
                    self._restart(exc)
        finally:
            self.close()

    def _restart(self, exc: KafkaError) -> None:
        """A Kafka error ended the session: forget what was not committed and start over from what was, with
        new clients (a restarted process's path), once the outage allows."""
        logger.warning("the join's session ended (%s: %s); starting again from what was committed",
                       type(exc).__name__, exc)
        self._tasks, self._suspended, self._in_txn = {}, {}, False
        self.close()
        while True:
            try:
                wait = self.outage.failed(exc)
            except DependencyUnavailable as gone:
                raise JoinError(str(gone)) from exc
            if self.stop.wait(wait):
                raise JoinError(f"stopped while Kafka was unreachable ({exc})")
            try:
                self.producer, self.consumer = self._clients()
                return
            except KafkaError as again:
                exc = again

    def _session(self) -> None:
        """Poll, join and commit until :attr:`stop` is set (then commit)."""
        interval = self.s.commit_interval_ms / 1000
        while not self.stop.is_set():
            polled = self.consumer.poll(timeout_ms=min(100, self.s.commit_interval_ms))
            if polled or self._tasks:
                self.outage.recovered()
            now = time.monotonic()
            for tp, msgs in polled.items():
                task = self._tasks.get(tp.partition)
                if task is None:
                    continue
                buf = task.buffers[tp]
                for m in msgs:
                    buf.append(self._decode(m))
                if msgs:
                    task.last_arrival[tp] = now
            for task in list(self._tasks.values()):
                self._process(task, now)
            if self._in_txn and time.monotonic() - self._last_commit >= interval:
                self._commit()
        self._commit()

    def _decode(self, m: Any) -> tuple[int, Any, Any]:
        try:
            ev = decode_event(m.value)
        except JoinDecodeError as exc:
            return -1, exc, m  # a bad event has no time: handled as soon as it is read
        return ev.t_ms, ev, m

    def _caught_up(self, tp: TopicPartition) -> bool:
        """True when the input partition has nothing more to fetch as of the last poll (a fetch answered, and
        its position is at the end it reported)."""
        high = self.consumer.highwater(tp)
        if high is None:
            return False
        position = self.consumer.position(tp, timeout_ms=0)
        return position is not None and position >= high

    def _process(self, task: _Task, now: float) -> None:
        """Handle the task's buffered events in event-time order, as long as every input that may still
        hold an earlier event has one buffered."""
        buffers = task.buffers
        state = task.state
        idle_s = self.s.idle_s
        caught_up = {tp: self._caught_up(tp) for tp in buffers}  # positions move only in poll
        names = {tp: f"{tp.topic}/{tp.partition}" for tp in buffers}
        quiet = [tp for tp in buffers if now - task.last_arrival[tp] > idle_s]  # idle once their buffer empties
        while True:
            best: TopicPartition | None = None
            best_t = 0
            for tp, buf in buffers.items():
                if buf:
                    if best is None or buf[0][0] < best_t:
                        best, best_t = tp, buf[0][0]
                elif not caught_up[tp]:
                    best = None  # it may hold something earlier: wait for it
                    break
            if best is None:
                break
            _, ev, m = buffers[best].popleft()
            self._begin()
            name = names[best]
            source = Source(best.topic, best.partition, m.offset)
            if isinstance(ev, JoinDecodeError):
                state.count(f"dead.{ev.reason}")
                self._send(Output("dead", ev.imp or b"", m.value, ev.reason, str(ev), source), m, task.p)
            else:
                state.observe(name, ev.t_ms)
                if isinstance(ev, Impression):
                    if best.topic != self.s.impressions:
                        out = [self._misplaced(state, ev.imp, source, "an impression on a feedback topic")]
                    else:
                        out = state.impression(ev, source)
                elif isinstance(ev, Feedback):
                    if best.topic == self.s.impressions:
                        out = [self._misplaced(state, ev.imp, source, "feedback on the impressions topic")]
                    else:
                        out = state.feedback(ev, source)
                else:
                    assert isinstance(ev, Punctuation)
                    out = []
                for o in out:
                    self._send(o, m, task.p)
            for o in state.advance([names[tp] for tp in quiet if not buffers[tp]]):
                self._send(o, None, task.p)
            task.next_offsets[best] = m.offset + 1
        if not any(buffers.values()):  # caught up everywhere: idle inputs may still move the watermark
            idle = [names[tp] for tp in quiet]
            if idle:
                out = state.advance(idle)
                if out:
                    self._begin()
                    for o in out:
                        self._send(o, None, task.p)

    @staticmethod
    def _misplaced(state: TaskState, imp: bytes, source: Source, what: str) -> Output:
        state.count("dead.bad_event")
        return Output("dead", imp, None, "bad_event", f"{what}: every event belongs on its own topic", source)

    def _begin(self) -> None:
        if not self._in_txn:
            self.producer.begin_transaction()
            self._in_txn = True

    def _send(self, o: Output, m: Any, p: int) -> None:
        """Send ``o`` (of task ``p``; ``m`` the input message it answers, if any) in the open transaction."""
        if o.kind == "record":
            self.producer.send(self.s.topic, key=o.key, value=o.value, partition=p if self._same_partitions else None)
            return
        src = o.source
        assert src is not None
        value = o.value if o.value is not None else (m.value if m is not None else None)
        original = list(m.headers or []) if m is not None else []
        if o.kind == "late":
            if self.s.late:
                self.producer.send(self.s.late, key=o.key, value=value, headers=[
                    *original, ("join.reason", o.reason.encode()), ("join.topic", src.topic.encode()),
                    ("join.partition", str(src.partition).encode()), ("join.offset", str(src.offset).encode())])
            return
        self.producer.send(dlq_topic(src.topic), key=f"{src.topic}/{src.partition}/{src.offset}".encode(),
                           value=value, headers=dlq_headers(original, o.reason, o.error, src.topic, src.partition,
                                                            src.offset))
        logger.warning("dead-lettered %s[%d]@%d: %s: %s", src.topic, src.partition, src.offset, o.reason, o.error)

    def _commit(self) -> None:
        """Commit the open transaction: the records sent, every task's changelog and the input offsets."""
        if not self._in_txn:
            self._last_commit = time.monotonic()
            return
        offsets: dict[TopicPartition, OffsetAndMetadata] = {}
        for task in self._tasks.values():
            for key, value in task.state.changelog():
                self.producer.send(self.changelog, key=key, value=value, partition=task.p)
            for tp, off in task.next_offsets.items():
                offsets[tp] = OffsetAndMetadata(off, "", -1)
        try:
            if offsets:
                self.producer.send_offsets_to_transaction(offsets, self.consumer.group_metadata())
            self.producer.commit_transaction()
        except (ProducerFencedError, InvalidProducerEpochError) as exc:
            raise JoinError(f"fenced: another joiner runs as {self.s.app_id}-{self.s.instance_id} (give each "
                            f"joiner its own --instance-id); {type(exc).__name__}: {exc}") from exc
        self._in_txn = False
        self._transactions += 1
        self._last_commit = time.monotonic()
        self._publish()

    def _publish(self) -> None:
        """Take the stats :meth:`stats` returns (on the loop's thread, after a commit: what is committed)."""
        states = [t.state for t in self._tasks.values()]
        counters: Counter[str] = Counter()
        for st in states:
            counters.update(st.counters)
        wms = [st.watermark for st in states if st.watermark is not None]
        stats = JoinStats(partitions=sorted(self._tasks), counters=dict(counters),
                          pending=sum(len(st.pending) for st in states),
                          early_feedback=sum(st.held_count for st in states),
                          watermark_ms=min(wms) if wms else None, transactions=self._transactions)
        with self._lock:
            self._stats = stats

    def stats(self) -> JoinStats:
        """Counters and state sizes as of the last commit (any thread)."""
        with self._lock:
            return self._stats

    def _abort(self) -> None:
        """Abort the open transaction, if any (a failure is left to the broker's timeout or the next joiner
        with our id: nothing of it is visible to a committed read either way)."""
        if self._in_txn:
            self._in_txn = False
            try:
                self.producer.abort_transaction()
            except KafkaError as exc:
                logger.warning("could not abort the open transaction (%s); the broker aborts it", exc)

    def close(self) -> None:
        """Leave the group and close the clients (an open transaction is aborted by the broker's timeout or
        the next joiner with this id); idempotent."""
        try:
            self.consumer.close()
        finally:
            self.producer.close(timeout=5)
