"""Session fixtures: a real Kafka broker and a real Redis server on loopback.

Tests of Kafka or Redis behaviour talk to these servers; there are no mocks or
in-memory stand-ins. Each test gets uniquely named topics and its own Redis
database, flushed before use.

Every test is also checked for leaked threads, child processes and file
descriptors (:func:`leak_check`, with ``tests/leaks.py``).
"""

from __future__ import annotations

import itertools
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import leaks
import pytest
import redis as redis_lib
from kafka.admin import KafkaAdminClient

from streamtrain.launcher import KafkaBroker, RedisCluster, RedisServer
from streamtrain.netns import NetNamespace, NetnsUnavailable


@dataclass
class KafkaInfo:
    """The session's broker: its address and a helper that makes fresh topics."""

    broker: KafkaBroker
    admin: KafkaAdminClient

    @property
    def bootstrap(self) -> str:
        """``host:port`` of the broker."""
        return self.broker.bootstrap

    def create_topic(self, partitions: int = 1, prefix: str = "t") -> str:
        """Create a uniquely named topic with ``partitions`` partitions; return its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.admin.create_topics({name: {"num_partitions": partitions, "replication_factor": 1}},
                                 timeout_ms=30_000, wait_for_metadata=True)
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
    # a JVM that starts beside other test runs on two cores can take a while: the test timeouts
    # (180 s where Kafka is used) still bound it
    with KafkaBroker(log_level="WARN", start_timeout_s=150) as broker:
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


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A real Redis Cluster of three masters for the whole session (``redis_cluster.url`` is its
    ``redis+cluster://`` URL); a cluster has only database 0, so tests keep apart by job name."""
    with RedisCluster() as cluster:
        yield cluster


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
def fresh(redis_server) -> Iterator[tuple[redis_lib.Redis, str]]:
    """Another flushed database of the session's Redis (the "empty Redis" a checkpoint is restored into) and
    its URL."""
    url = redis_server.url_for(redis_server.next_db())
    client = redis_lib.Redis.from_url(url)
    client.flushdb()
    try:
        yield client, url
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """``host:port`` of a TCP listener that never answers: a Kafka broker that is down."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


_higher_scoped = leaks.Allowance()
"""What fixtures of a scope above ``function`` started: theirs to stop, never a test's leak."""


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    """Record what a module-, class-, package- or session-scoped fixture starts as it sets up."""
    if fixturedef.scope == "function":
        return (yield)
    before = leaks.Snapshot.take()
    try:
        return (yield)
    finally:
        _higher_scoped.add(before, leaks.Snapshot.take())


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves threads, child processes or file descriptors behind.

    What counts as a leak: a Python thread (daemon or not), a direct child
    process that has not exited, or open file descriptors beyond a tolerance of
    :data:`leaks.FD_TOLERANCE`, that exist after the test's function-scoped
    fixtures are torn down, did not exist when this fixture set up, and are still
    there after a grace of :data:`leaks.GRACE_S` seconds.

    Why fixtures of a higher scope are never blamed: pytest sets up fixtures of
    a higher scope before function-scoped ones, so the session's Kafka and Redis
    and a module's cluster already run when the baseline is taken (and are torn
    down after this check). Whatever such a fixture starts later, say when a test
    asks for it with ``request.getfixturevalue``, is recorded by the
    ``pytest_fixture_setup`` hook above and allowed too. A function-scoped
    fixture sets up after this one and tears down before its check, so what it
    leaves running is the test's leak. What a test body starts on behalf of a
    higher-scoped fixture (restarting a module cluster's server) cannot be told
    apart from a leak: such a test carries the marker below.

    Opt out with ``@pytest.mark.leaks_allowed("why", kinds=("fds",))`` (``kinds``
    defaults to all of threads, processes and fds).
    """
    marker = request.node.get_closest_marker("leaks_allowed")
    kinds = leaks.KINDS
    if marker is not None:
        if not marker.args or not str(marker.args[0]).strip():
            raise pytest.UsageError(f"{request.node.nodeid}: leaks_allowed needs a reason")
        allowed = marker.kwargs.get("kinds", leaks.KINDS)
        if isinstance(allowed, str) or not set(allowed) <= set(leaks.KINDS):
            raise pytest.UsageError(f"{request.node.nodeid}: leaks_allowed kinds must be a tuple drawn "
                                    f"from {leaks.KINDS}, got {allowed!r}")
        kinds = tuple(k for k in leaks.KINDS if k not in allowed)
    before = leaks.Snapshot.take()
    yield
    if not kinds:
        return
    found = leaks.wait_for_no_leaks(before, _higher_scoped, kinds)
    if found:
        pytest.fail(f"the test left behind (after a {leaks.GRACE_S:.0f}s grace):\n  " + "\n  ".join(found),
                    pytrace=False)


@pytest.fixture
def netns() -> Iterator[NetNamespace]:
    """A network namespace linked to this one, removed after the test."""
    ns = NetNamespace()
    try:
        ns.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"this machine cannot create a network namespace (needs root and iproute2): {exc}")
    try:
        yield ns
    finally:
        ns.close()
