"""The dead-letter topic: rejected Kafka messages with the reason they were rejected.

:class:`DeadLetterWriter` writes each rejected message to ``<topic>.dlq`` with its value and headers
plus ``dlq.*`` headers (reason, error, source topic, partition and offset, what a shard claimed), keyed
``<topic>/<partition>/<offset>``, the identity the accounting dedupes on; :func:`parse_dlq_headers`
reads them back. See docs/records.md, *Dead-letter topic*.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kafka import KafkaProducer

from .records import DecodeError
from .topics import dlq_topic, ensure_topic, reliable_producer

__all__ = ["DeadLetterError", "DeadLetterWriter", "DlqEntry", "dlq_headers", "parse_dlq_headers"]

logger = logging.getLogger(__name__)


class DeadLetterError(RuntimeError):
    """A rejected message could not be written to the dead-letter topic (it is not consumed)."""


@dataclass(frozen=True)
class DlqEntry:
    """The dead-letter headers of one entry, parsed."""

    reason: str
    """Why the message was rejected."""
    error: str
    """The message of the decode error."""
    topic: str
    """Source topic."""
    partition: int
    """Source partition."""
    offset: int
    """Source offset (with topic and partition, the entry's identity)."""
    producer_id: str | None
    """Producer id claimed by a rejected shard, when readable."""
    first_seq: int | None
    """First sequence number claimed by a rejected shard, when readable."""
    count: int
    """Records the message claimed to hold (1 when unknown)."""


def parse_dlq_headers(headers: Sequence[tuple[str, bytes]]) -> DlqEntry:
    """Read the ``dlq.*`` headers of a dead-letter message.

    Raises:
        ValueError: a required header is missing.
    """
    h = {k: v.decode() for k, v in headers if k.startswith("dlq.")}
    try:
        return DlqEntry(reason=h["dlq.reason"], error=h.get("dlq.error", ""), topic=h["dlq.topic"],
                        partition=int(h["dlq.partition"]), offset=int(h["dlq.offset"]),
                        producer_id=h.get("dlq.producer"),
                        first_seq=int(h["dlq.seq"]) if "dlq.seq" in h else None,
                        count=int(h.get("dlq.count", "1")))
    except KeyError as exc:
        raise ValueError(f"not a dead-letter message: header {exc.args[0]} missing") from None


def dlq_headers(original: Sequence[tuple[str, bytes]], reason: str, error: str, topic: str, partition: int,
                offset: int, *, count: int = 1, producer_id: str | None = None,
                first_seq: int | None = None) -> list[tuple[str, bytes]]:
    """The headers of a dead-letter message: the original ones (less any ``dlq.*``), then the reason, the
    error (its first 1,000 characters), where the message came from and what it claimed to hold."""
    extra = [("dlq.reason", reason), ("dlq.error", error[:1000]), ("dlq.topic", topic),
             ("dlq.partition", str(partition)), ("dlq.offset", str(offset)), ("dlq.count", str(count))]
    if producer_id is not None:
        extra.append(("dlq.producer", producer_id))
    if first_seq is not None:
        extra.append(("dlq.seq", str(first_seq)))
    return [(k, v) for k, v in original if not k.startswith("dlq.")] + [(k, v.encode()) for k, v in extra]


class DeadLetterWriter:
    """Writes rejected messages to ``<topic>.dlq``; the topic and producer are made on first use."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.dlq_topic = dlq_topic(topic)
        self._producer: KafkaProducer | None = None
        self._pending: list = []

    def send(self, value: bytes | None, headers: Sequence[tuple[str, bytes]], partition: int,
             offset: int, error: DecodeError) -> None:
        """Queue one rejected message; :meth:`flush` makes it durable."""
        if self._producer is None:
            ensure_topic(self.bootstrap, self.dlq_topic, 1)
            self._producer = reliable_producer(self.bootstrap, client_id=f"streamtrain-dlq-{self.topic}")
        self._pending.append(self._producer.send(
            self.dlq_topic, value=value, key=f"{self.topic}/{partition}/{offset}".encode(),
            headers=dlq_headers(headers, error.reason, str(error), self.topic, partition, offset, count=error.count,
                                producer_id=error.producer_id, first_seq=error.first_seq)))
        logger.warning("rejected %s[%d]@%d to %s: %s", self.topic, partition, offset, self.dlq_topic, error)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued message is acknowledged.

        Raises:
            DeadLetterError: one could not be written.
        """
        if not self._pending or self._producer is None:
            return
        self._producer.flush(timeout_s)
        pending, self._pending = self._pending, []
        failed = [f for f in pending if not f.succeeded()]
        if failed:
            cause = failed[0].exception if failed[0].is_done else "timed out"
            raise DeadLetterError(f"{len(failed)} message(s) not written to {self.dlq_topic}: {cause}")

    def close(self) -> None:
        """Flush what is queued and close the producer."""
        try:
            self.flush()
        finally:
            if self._producer is not None:
                self._producer.close()
                self._producer = None
