"""Topic administration shared by the producer and the DLQ writer."""

from __future__ import annotations

import logging

from kafka.admin import KafkaAdminClient
from kafka.errors import TopicAlreadyExistsError

__all__ = ["MAX_MESSAGE_BYTES", "dlq_topic", "ensure_topic", "broker_reachable"]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""``max.message.bytes`` of the topics we create: room for shards larger than Kafka's 1 MB default."""


def dlq_topic(topic: str) -> str:
    """Name of the dead-letter topic of ``topic``."""
    return f"{topic}.dlq"


def ensure_topic(bootstrap: str, topic: str, partitions: int, *, timeout_s: float = 30.0) -> int:
    """Create ``topic`` with ``partitions`` partitions unless it exists; return its partition count.

    An existing topic keeps its partition count (logged when it differs).
    """
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="streamtrain-datastream",
                             request_timeout_ms=int(timeout_s * 1000))
    try:
        existing = admin.describe_topics([topic]) if topic in admin.list_topics() else []
        if not existing:
            try:
                admin.create_topics(
                    {topic: {"num_partitions": partitions, "replication_factor": 1,
                             "configs": {"max.message.bytes": str(MAX_MESSAGE_BYTES)}}},
                    timeout_ms=int(timeout_s * 1000), wait_for_metadata=True)
                logger.info("created topic %s with %d partitions", topic, partitions)
                return partitions
            except TopicAlreadyExistsError:  # created concurrently by another producer
                existing = admin.describe_topics([topic])
        count = len(existing[0]["partitions"])
        if count != partitions:
            logger.info("topic %s exists with %d partitions (asked for %d); keeping it", topic, count, partitions)
        return count
    finally:
        admin.close()


def broker_reachable(client: object) -> bool:
    """True while a kafka-python client (a consumer's ``_client``, a producer's ``_sender._client``) holds a connection
    to a broker of the cluster (or, before it knows the cluster, to a bootstrap server). Clients
    keep idle connections open, so a false means the brokers went away, not that data stopped."""
    nodes = [b.node_id for b in client.cluster.brokers()]  # type: ignore[attr-defined]
    if not nodes:
        return bool(client.bootstrap_connected())  # type: ignore[attr-defined]
    return any(client.connected(n) for n in nodes)  # type: ignore[attr-defined]
