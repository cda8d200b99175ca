"""Record-by-record audit of exactly-once sample accounting (invariant 1).

:func:`audit` reads the training topic up to the committed offsets, the dead-letter topic and the
``applied_samples`` stream, and checks that every record was applied exactly once or sits in the
dead-letter topic; it is exact above each partition's audit floor and counts the records below it
(:attr:`AuditReport.below_floor`). See docs/architecture.md, *Invariants*, and docs/parameter-plane.md,
*Retention: nothing grows with time alone*.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kafka import KafkaConsumer, TopicPartition

from common.redis_client import connect
from datastream import DecodeError, decode_record, dlq_topic, parse_dlq_headers
from services.protocol import AccountingRecord, Status
from services.slots import JobSlot

Sample = tuple[str, int]


@dataclass(frozen=True)
class AuditReport:
    """What the audit found. :attr:`exact` is the verdict."""

    messages: int
    """Kafka messages below the committed offsets."""
    uncommitted: int
    """Messages at or past the committed offsets (not yet accounted for)."""
    expected: int
    """Records in committed, decodable messages: each must be applied exactly once."""
    applied: int
    """Records applied exactly once."""
    dead_letters: int
    """Distinct source messages in the dead-letter topic."""
    missing: list[Sample] = field(default_factory=list)
    """Expected records never applied."""
    duplicated: list[Sample] = field(default_factory=list)
    """Records applied more than once."""
    unexpected: list[Sample] = field(default_factory=list)
    """Applied records that no committed message holds."""
    undecodable_not_in_dlq: list[tuple[int, int]] = field(default_factory=list)
    """(partition, offset) of messages that fail to decode yet are not in the dead-letter topic."""
    rejected_updates: int = 0
    """Updates the parameter servers refused (their samples are not applied), among the entries kept."""
    below_floor: int = 0
    """Records of committed, decodable messages below their partition's audit floor: their
    ``applied_samples`` entries were trimmed past the servers' audit horizon, so they are not
    checked one by one (nor counted in :attr:`expected`)."""
    floors: dict[int, int] = field(default_factory=dict)
    """Partition -> its audit floor (absent: 0, every record is checked)."""

    @property
    def exact(self) -> bool:
        """True when every committed record is applied exactly once or dead-lettered."""
        return not (self.missing or self.duplicated or self.unexpected or self.undecodable_not_in_dlq)


def _read_topic(bootstrap: str, topic: str, until: dict[int, int] | None) -> list[tuple[int, int, bytes, list]]:
    """(partition, offset, value, headers) of every committed message (below ``until`` when given): read as
    the trainers read, so an aborted transaction's records (``streamtrain join`` writes transactionally) are
    no message of the topic."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed",
                             consumer_timeout_ms=2000)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return []
        ends = consumer.end_offsets(tps)
        stop = {tp.partition: min(ends[tp], until.get(tp.partition, 0)) if until is not None else ends[tp]
                for tp in tps}
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out = []
        remaining = {p for p, end in stop.items() if end > 0}
        while remaining:
            polled = consumer.poll(timeout_ms=1000, max_records=5000)
            if not polled:
                positions = {tp.partition: consumer.position(tp) for tp in tps}
                remaining = {p for p in remaining if positions[p] < stop[p]}
                continue
            for tp, records in polled.items():
                for rec in records:
                    if rec.offset < stop[tp.partition]:
                        out.append((tp.partition, rec.offset, rec.value, list(rec.headers or [])))
                if records and records[-1].offset + 1 >= stop[tp.partition]:
                    remaining.discard(tp.partition)
        return out
    finally:
        consumer.close()


def audit(bootstrap: str, topic: str, redis_url: str, job: str) -> AuditReport:
    """Check invariant 1 for ``job`` consuming ``topic``; see :class:`AuditReport`."""
    client = connect(redis_url)
    try:  # one read of the job's slot: the floor moves with the trim, atomically
        read = JobSlot(client, job).read("offsets", "audit_floor", "applied_samples")
    finally:
        client.close()
    committed = {int(p): int(o) for p, o in read.offsets.items()}
    floors = {int(p): int(o) for p, o in read.audit_floor.items()}
    entries = read.applied_samples
    everything = _read_topic(bootstrap, topic, None)
    messages = [m for m in everything if m[1] < committed.get(m[0], 0)]
    dead = {(e.partition, e.offset) for e in (parse_dlq_headers(h) for _, _, _, h in
                                              _read_topic(bootstrap, dlq_topic(topic), None))
            if e.topic == topic}

    expected: set[Sample] = set()
    undecodable = []
    below = 0
    for partition, offset, value, _ in messages:
        if (partition, offset) in dead:
            continue
        try:
            rec = decode_record(value)
        except DecodeError:
            undecodable.append((partition, offset))
            continue
        if offset < floors.get(partition, 0):
            below += rec.count
            continue
        if rec.producer_id is None or rec.first_seq is None:  # a shard names both
            expected.add((f"{topic}/{partition}", offset))
        else:
            expected.update((rec.producer_id, rec.first_seq + i) for i in range(rec.count))

    applied: Counter[Sample] = Counter()
    rejected = 0
    for _, fields in entries:
        record = AccountingRecord.from_fields(fields)
        if record.status is not Status.APPLIED:
            rejected += 1
            continue
        for producer, first, count in record.samples:
            applied.update((producer, first + i) for i in range(count))

    once = {s for s, n in applied.items() if n == 1}
    return AuditReport(
        messages=len(messages), uncommitted=len(everything) - len(messages), expected=len(expected),
        applied=len(once & expected), dead_letters=len(dead),
        missing=sorted(expected - set(applied))[:100],
        duplicated=sorted(s for s, n in applied.items() if n > 1)[:100],
        unexpected=sorted(set(applied) - expected)[:100],
        undecodable_not_in_dlq=undecodable[:100], rejected_updates=rejected, below_floor=below,
        floors=floors)
