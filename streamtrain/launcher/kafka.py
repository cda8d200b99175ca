"""A real Apache Kafka 4.x broker in KRaft mode on a loopback port.

One combined broker+controller node. The jars come from either ``KAFKA_HOME``
(an unpacked official distribution, ``$KAFKA_HOME/libs``) or the cache that
``scripts/setup.sh`` fills from Maven Central. The broker's main class runs on
the machine's Java directly; the storage is formatted first.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path

from .process import LaunchError, ManagedProcess, free_port

logger = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"
"""The pinned broker version that scripts/setup.sh fetches."""

_LOG4J2 = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = {level}
logger.apache.name = org.apache.kafka
logger.apache.level = {level}
"""


def cache_dir() -> Path:
    """The folder that holds fetched artifacts (outside the repository)."""
    base = os.environ.get("STREAMTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "streamtrain")
    return Path(base)


def kafka_libs_dir() -> Path:
    """Locate the Kafka jars: ``$KAFKA_HOME/libs`` when set, else the setup cache.

    Raises:
        LaunchError: no jars where they should be, with the command that fetches them.
    """
    home = os.environ.get("KAFKA_HOME")
    if home:
        libs = Path(home) / "libs"
        if not any(libs.glob("kafka_2.13-*.jar")):
            raise LaunchError(f"KAFKA_HOME={home} has no libs/kafka_2.13-*.jar; "
                              "point it at an unpacked Apache Kafka 4.x distribution")
        return libs
    libs = cache_dir() / f"kafka-{KAFKA_VERSION}" / "libs"
    if not any(libs.glob("kafka_2.13-*.jar")):
        raise LaunchError(f"Kafka {KAFKA_VERSION} jars not found in {libs}; "
                          "run scripts/setup.sh (or set KAFKA_HOME)")
    return libs


def java_binary() -> str:
    """The java executable: ``$JAVA_HOME/bin/java`` when set, else ``java`` on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and Path(java_home, "bin", "java").exists():
        return str(Path(java_home, "bin", "java"))
    found = shutil.which("java")
    if found is None:
        raise LaunchError("no java on PATH; Kafka needs Java 17 or newer (apt-get install openjdk-17-jre-headless)")
    return found


def random_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding.

    One that starts with ``-`` is drawn again, as Kafka's own ``Uuid.randomUuid()`` does:
    ``kafka-storage format -t -X...`` would read it as an option (1 start in 64 failed so).
    """
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not text.startswith("-"):
            return text


class KafkaBroker(ManagedProcess):
    """A single-node KRaft Kafka broker bound to 127.0.0.1 on free ports.

    Args:
        port: client port (a free one when None).
        heap_mb: JVM heap size; the default keeps it beside the tests on 2 cores.
        extra_config: additional ``server.properties`` entries.
        log_level: log4j level of the broker's own log.
    """

    name = "kafka"

    def __init__(self, *, port: int | None = None, heap_mb: int = 512,
                 extra_config: dict[str, str] | None = None, log_level: str = "INFO",
                 **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        if heap_mb < 128:
            raise ValueError(f"heap_mb must be at least 128, got {heap_mb}")
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.controller_port = free_port()
        self.heap_mb = heap_mb
        self.extra_config = dict(extra_config or {})
        self.log_level = log_level
        self._libs = kafka_libs_dir()
        self._java = java_binary()
        self._admin = None

    @property
    def bootstrap(self) -> str:
        """``host:port`` for Kafka clients."""
        return f"{self.host}:{self.port}"

    def _properties(self) -> dict[str, str]:
        assert self.workdir is not None
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{self.host}:{self.controller_port}",
            "listeners": f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.workdir / "data"),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "log.retention.hours": "168",
        }
        props.update(self.extra_config)
        return props

    def _jvm(self, main: str, *args: str, heap_mb: int, quick: bool = False) -> list[str]:
        """A java command line; ``quick`` trades peak speed for start-up (short tools)."""
        # The broker's heap is fixed and touched at start (Kafka's own scripts also set -Xms to
        # -Xmx): a heap that grows to its maximum over the first hour shows as memory growth in a
        # soak (bench/soak.py saw +14 %/h of the broker's RSS with -Xms256m -Xmx512m).
        tuning = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", f"-Xms{min(heap_mb, 256)}m"] if quick else [
            "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", f"-Xms{heap_mb}m", "-XX:+AlwaysPreTouch"]
        return [self._java, f"-Xmx{heap_mb}m", *tuning,
                "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.workdir}/log4j2.properties",
                "-cp", f"{self._libs}/*", main, *args]

    def _prepare(self) -> None:
        assert self.workdir is not None
        (self.workdir / "server.properties").write_text(
            "".join(f"{k}={v}\n" for k, v in self._properties().items()))
        (self.workdir / "log4j2.properties").write_text(_LOG4J2.format(level=self.log_level))
        # A broker restarted on the same folder keeps its cluster id (and so its data).
        id_file = self.workdir / "cluster.id"
        if not id_file.exists():
            id_file.write_text(random_cluster_id())
        self._run_tool(self._jvm("kafka.tools.StorageTool", "format", "--ignore-formatted",
                                 "-t", id_file.read_text().strip(), "-c", "server.properties",
                                 heap_mb=128, quick=True),
                       "format the KRaft storage")

    def _command(self) -> Sequence[str]:
        return self._jvm("kafka.Kafka", "server.properties", heap_mb=self.heap_mb)

    def _probe_ready(self) -> bool:
        """Ready when the broker answers a metadata request and can create a topic."""
        from kafka.admin import KafkaAdminClient
        from kafka.errors import KafkaError, TopicAlreadyExistsError

        try:
            # Until the port accepts connections, a client would only back off (and leak).
            socket.create_connection((self.host, self.port), timeout=1.0).close()
        except OSError:
            return False
        try:
            if self._admin is None:
                self._admin = KafkaAdminClient(bootstrap_servers=self.bootstrap,
                                               request_timeout_ms=5000,
                                               client_id="streamtrain-launcher")
            with contextlib.suppress(TopicAlreadyExistsError):
                self._admin.create_topics(
                    {"__streamtrain_ready": {"num_partitions": 1, "replication_factor": 1}},
                    timeout_ms=5000, wait_for_metadata=True)
            self._admin.close()
            self._admin = None
            return True
        except (KafkaError, OSError) as exc:
            logger.debug("kafka not ready yet: %s", exc)
            return False

    def stop(self) -> None:  # noqa: D102 - see ManagedProcess.stop
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None
        super().stop()
