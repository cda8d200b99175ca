"""Blocking Kafka probes (reachability, partition offsets) for the coordinator's executor.

kafka-python is synchronous; :class:`KafkaProbe` keeps one consumer (no group,
never subscribes) and is called from a single worker thread, with every call
bounded by ``timeout_ms``. A failed call drops the consumer so the next call
reconnects.
"""

from __future__ import annotations

import logging
import threading

from kafka import KafkaConsumer, TopicPartition

logger = logging.getLogger(__name__)


class KafkaProbe:
    """Reachability and offsets of one topic; thread-safe, lazily connected."""

    def __init__(self, bootstrap: str, timeout_ms: int) -> None:
        self.bootstrap = bootstrap
        self.timeout_ms = timeout_ms
        self._consumer: KafkaConsumer | None = None
        self._lock = threading.Lock()

    def _client(self) -> KafkaConsumer:
        if self._consumer is None:
            # kafka-python 3 starts its IO thread before bootstrapping in __init__ and does
            # not stop it when the bootstrap fails, so build in two steps to close it then.
            consumer = KafkaConsumer.__new__(KafkaConsumer)
            try:
                consumer.__init__(
                    bootstrap_servers=self.bootstrap.split(","),
                    client_id="streamtrain-coordinator", enable_auto_commit=False,
                    request_timeout_ms=max(self.timeout_ms, 1000),
                    bootstrap_timeout_ms=self.timeout_ms)
            except Exception:
                client = getattr(consumer, "_client", None)
                if client is not None:
                    client.close()
                raise
            self._consumer = consumer
        return self._consumer

    def _drop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            consumer.close()

    def ping(self) -> None:
        """Fetch cluster metadata; raise (any kafka-python error) if the broker is unreachable."""
        with self._lock:
            try:
                self._client().topics()
            except Exception:
                self._drop()
                raise

    def offsets(self, topic: str, partitions: int) -> dict[int, tuple[int, int]]:
        """Partition -> (beginning offset, end offset) of ``topic``'s first ``partitions``."""
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        with self._lock:
            try:
                client = self._client()
                begin = client.beginning_offsets(tps, timeout_ms=self.timeout_ms)
                end = client.end_offsets(tps, timeout_ms=self.timeout_ms)
            except Exception:
                self._drop()
                raise
        return {tp.partition: (begin[tp], end[tp]) for tp in tps}

    def close(self) -> None:
        """Close the consumer."""
        with self._lock:
            self._drop()
