"""Topics and producers shared by the producer and the DLQ writer.

Topics we create keep ``min(3, brokers)`` copies of each partition, and with three an
``acks=all`` write needs two in sync (:func:`topic_replication`); every producer we make
is idempotent with ``acks=all`` (:func:`reliable_producer`). Together: one broker of three
may die without losing an acknowledged record, stopping writes, or duplicating a retried one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient
from kafka.errors import KafkaTimeoutError, TopicAlreadyExistsError

__all__ = ["MAX_MESSAGE_BYTES", "dlq_topic", "ensure_topic", "broker_reachable", "reliable_producer",
           "topic_replication"]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""``max.message.bytes`` of the topics we create: room for shards larger than Kafka's 1 MB default."""


def dlq_topic(topic: str) -> str:
    """Name of the dead-letter topic of ``topic``."""
    return f"{topic}.dlq"


def topic_replication(brokers: int) -> tuple[int, dict[str, str]]:
    """``(replication factor, topic configs)`` of a topic created on a cluster of ``brokers`` live
    brokers: ``min(3, brokers)`` copies, and ``min.insync.replicas=2`` with three of them."""
    if brokers < 1:
        raise ValueError(f"brokers must be >= 1, got {brokers}")
    copies = min(3, brokers)
    return copies, ({"min.insync.replicas": "2"} if copies >= 3 else {})


def reliable_producer(bootstrap: str, *, client_id: str, **config: Any) -> KafkaProducer:
    """A ``KafkaProducer`` that is idempotent with ``acks=all`` (a retried batch is written once, and
    acknowledged only once every in-sync copy has it), with ``max_request_size`` room for our
    largest messages; ``config`` adds other kafka-python settings."""
    return KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                         max_request_size=MAX_MESSAGE_BYTES, client_id=client_id, **config)


def ensure_topic(bootstrap: str, topic: str, partitions: int, *, configs: dict[str, str] | None = None,
                 timeout_s: float = 30.0) -> int:
    """Create ``topic`` with ``partitions`` partitions unless it exists; return its partition count.

    A new topic is replicated as :func:`topic_replication` says for the brokers that are up, with ``configs``
    (such as ``cleanup.policy``) beside our own. An existing topic keeps its partition count (logged when it
    differs), replication and configs. A topic the broker lists before its partitions are in the metadata (just
    created by someone else) is read again until they are, within ``timeout_s``.
    """
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="streamtrain-datastream",
                             request_timeout_ms=int(timeout_s * 1000))
    deadline = time.monotonic() + timeout_s
    try:
        if topic not in admin.list_topics():
            brokers = [b for b in admin.describe_cluster()["brokers"] if not b.get("is_fenced")]
            copies, replication = topic_replication(max(1, len(brokers)))
            try:
                admin.create_topics(
                    {topic: {"num_partitions": partitions, "replication_factor": copies,
                             "configs": {"max.message.bytes": str(MAX_MESSAGE_BYTES), **replication,
                                         **(configs or {})}}},
                    timeout_ms=int(timeout_s * 1000), wait_for_metadata=True)
                logger.info("created topic %s with %d partitions, %d copies each", topic, partitions, copies)
                return partitions
            except TopicAlreadyExistsError:  # created concurrently by another process
                pass
        while not (count := len(admin.describe_topics([topic])[0]["partitions"])):
            if time.monotonic() > deadline:
                raise KafkaTimeoutError(f"topic {topic} is listed but has no partitions in the metadata after "
                                   f"{timeout_s:g} s")
            time.sleep(0.1)
        if count != partitions:
            logger.info("topic %s exists with %d partitions (asked for %d); keeping it", topic, count, partitions)
        return count
    finally:
        admin.close()


def broker_reachable(client: Any) -> bool:
    """True while a kafka-python client (a consumer's ``_client``, a producer's ``_sender._client``) holds a connection
    to a broker of the cluster (or, before it knows the cluster, to a bootstrap server). Clients
    keep idle connections open, so a false means the brokers went away, not that data stopped."""
    nodes = [b.node_id for b in client.cluster.brokers()]
    if not nodes:
        return bool(client.bootstrap_connected())
    return any(client.connected(n) for n in nodes)
