"""Session fixtures: a real Kafka broker and a real Redis server on loopback.

Tests of Kafka or Redis behaviour talk to these servers; there are no mocks or
in-memory stand-ins. Each test gets uniquely named topics and its own Redis
database, flushed before use.
"""

from __future__ import annotations

import itertools
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis as redis_lib
from kafka.admin import KafkaAdminClient

from streamtrain.launcher import KafkaBroker, RedisServer


@dataclass
class KafkaInfo:
    """The session's broker: its address and a helper that makes fresh topics."""

    broker: KafkaBroker
    admin: KafkaAdminClient
    created: list[str] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        """``host:port`` of the broker."""
        return self.broker.bootstrap

    def create_topic(self, partitions: int = 1, prefix: str = "t") -> str:
        """Create a uniquely named topic with ``partitions`` partitions; return its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.admin.create_topics({name: {"num_partitions": partitions, "replication_factor": 1}},
                                 timeout_ms=30_000, wait_for_metadata=True)
        self.created.append(name)
        return name


@dataclass
class RedisInfo:
    """The session's Redis server and the database index allocator."""

    server: RedisServer
    _dbs: Iterator[int] = field(default_factory=lambda: itertools.cycle(range(1, 64)))

    @property
    def url(self) -> str:
        """URL of database 0."""
        return self.server.url

    def url_for(self, db: int) -> str:
        """URL of database ``db`` (with the server's password)."""
        return self.server.url_for(db)

    def next_db(self) -> int:
        """A database index not used by the previous 62 tests."""
        return next(self._dbs)


@pytest.fixture(scope="session")
def kafka() -> Iterator[KafkaInfo]:
    """A real single-node KRaft Kafka broker for the whole session."""
    with KafkaBroker(log_level="WARN") as broker:
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, client_id="tests")
        info = KafkaInfo(broker=broker, admin=admin)
        try:
            yield info
        finally:
            admin.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisInfo]:
    """A real redis-server for the whole session (password-protected, like every launched one)."""
    with RedisServer() as server:
        yield RedisInfo(server=server)


@pytest.fixture
def redis_url(redis_server: RedisInfo) -> str:
    """URL of a fresh, flushed database of the session's Redis for this test."""
    db = redis_server.next_db()
    url = redis_server.url_for(db)
    client = redis_lib.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


@pytest.fixture
def redis(redis_url: str) -> Iterator[redis_lib.Redis]:
    """A redis-py client on a fresh, flushed database."""
    client = redis_lib.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """``host:port`` of a TCP listener that never answers: a Kafka broker that is down."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
