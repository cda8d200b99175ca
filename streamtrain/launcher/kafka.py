"""Real Apache Kafka 4.x brokers in KRaft mode on loopback ports.

:class:`KafkaBroker` is one combined broker+controller node, alone or one of the nodes of a
:class:`KafkaCluster` (a shared cluster id and a static ``controller.quorum.voters``, which a fixed set
of local nodes needs rather than KIP-853's dynamic quorum), run on the machine's Java with its storage
formatted first; the jars come from ``$KAFKA_HOME/libs`` or the cache ``scripts/setup.sh`` fills from
Maven Central. See README.md, *Local servers*.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from .process import LaunchError, ManagedProcess, ServerFolder, ServerState, free_port, wait_until

if TYPE_CHECKING:
    from kafka.admin import KafkaAdminClient

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


def replication_config(brokers: int) -> dict[str, str]:
    """The cluster-wide replication defaults of a cluster of ``brokers`` nodes.

    Three copies where there are three brokers (fewer where there are fewer), and with three an
    ``acks=all`` write needs two of them in sync: one broker may die without losing an
    acknowledged record or stopping writes. The internal topics (offsets, transactions, share
    state) get the same.
    """
    if brokers < 1:
        raise ValueError(f"brokers must be >= 1, got {brokers}")
    copies = str(min(3, brokers))
    min_isr = "2" if brokers >= 3 else "1"
    return {
        "default.replication.factor": copies,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": copies,
        "transaction.state.log.replication.factor": copies,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": copies,
        "share.coordinator.state.topic.min.isr": min_isr,
    }


class KafkaBroker(ManagedProcess):
    """A KRaft Kafka node (broker and controller) bound to ``host`` (127.0.0.1) on free ports.

    Alone by default; :class:`KafkaCluster` makes N of them one cluster by giving each its
    ``node_id``, the shared ``cluster_id`` and every node's controller address in :attr:`voters`.

    Args:
        host: the address both listeners bind, and the one the broker advertises to clients.
        port: client port (a free one when None).
        controller_port: controller (KRaft quorum) port (a free one when None).
        node_id: ``node.id`` of this node.
        cluster_id: the KRaft cluster id its storage is formatted with (a random one when None;
            a folder formatted before keeps its own).
        heap_mb: JVM heap size; the default keeps it beside the tests on 2 cores.
        extra_config: additional ``server.properties`` entries (they win).
        log_level: log4j level of the broker's own log.
    """

    name = "kafka"

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, heap_mb: int = 512,
                 extra_config: dict[str, str] | None = None, log_level: str = "INFO",
                 node_id: int = 1, controller_port: int | None = None, cluster_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if heap_mb < 128:
            raise ValueError(f"heap_mb must be at least 128, got {heap_mb}")
        if node_id < 0:
            raise ValueError(f"node_id must be >= 0, got {node_id}")
        self.host = host
        self.port = port or free_port(host)
        self.controller_port = controller_port or free_port(host)
        self.node_id = node_id
        self.cluster_id = cluster_id
        self.voters: dict[int, str] = {node_id: f"{self.host}:{self.controller_port}"}
        """``node.id -> host:controller port`` of every controller of the quorum (this node alone
        unless :class:`KafkaCluster` says otherwise)."""
        self.heap_mb = heap_mb
        self.extra_config = dict(extra_config or {})
        self.log_level = log_level
        self._libs = kafka_libs_dir()
        self._java = java_binary()
        self._admin: KafkaAdminClient | None = None

    @property
    def bootstrap(self) -> str:
        """``host:port`` for Kafka clients."""
        return f"{self.host}:{self.port}"

    def _properties(self) -> dict[str, str]:
        assert self.workdir is not None
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": ",".join(f"{n}@{a}" for n, a in sorted(self.voters.items())),
            "listeners": f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.workdir / "data"),
            "num.partitions": "1",
            **replication_config(len(self.voters)),
            "offsets.topic.num.partitions": "4",
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
            id_file.write_text(self.cluster_id or random_cluster_id())
        self._run_tool(self._jvm("kafka.tools.StorageTool", "format", "--ignore-formatted",
                                 "-t", id_file.read_text().strip(), "-c", "server.properties",
                                 heap_mb=128, quick=True),
                       "format the KRaft storage")

    def _command(self) -> Sequence[str]:
        return self._jvm("kafka.Kafka", "server.properties", heap_mb=self.heap_mb)

    def _probe_ready(self) -> bool:
        """Ready when the broker answers and can create a topic; a node of a cluster, when it
        answers and lists itself as an unfenced broker (the cluster checks topic creation once
        every node is up: one node alone has no quorum)."""
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
            if len(self.voters) > 1:
                brokers = self._admin.describe_cluster()["brokers"]
                if not any(b["broker_id"] == self.node_id and not b.get("is_fenced") for b in brokers):
                    return False
                self._admin.close()
                self._admin = None
                return True
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

    def stop(self) -> None:  # see ManagedProcess.stop
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None
        super().stop()


class KafkaCluster(ServerFolder):
    """``brokers`` KRaft nodes on loopback, each broker and controller, as one Kafka cluster.

    Every node has its own ``node.id`` (1..N), client and controller ports and folder
    (``<workdir>/node<id>``), and the same cluster id and static quorum; the cluster-wide
    defaults are :func:`replication_config`'s. With ``brokers=1`` it is one :class:`KafkaBroker`
    as started alone. The nodes are :attr:`nodes`, node ``i`` at index ``i``; :meth:`kill` and
    :meth:`restart` inject faults into one or all of them. Usable as a context manager.

    Args:
        brokers: number of nodes.
        workdir: folder of the nodes' folders (a temporary one, removed on :meth:`cleanup`, when None).
        node_options: passed to every :class:`KafkaBroker` (``heap_mb``, ``log_level``,
            ``extra_config``, ``start_timeout_s`` ...).
    """

    name = "kafka"

    def __init__(self, brokers: int = 3, *, workdir: Path | None = None, **node_options: Any) -> None:
        if brokers < 1:
            raise ValueError(f"brokers must be >= 1, got {brokers}")
        for reserved in ("node_id", "port", "controller_port", "cluster_id"):
            if reserved in node_options:
                raise ValueError(f"{reserved} is chosen per node by KafkaCluster")
        self.cluster_id = random_cluster_id()
        self._options = node_options
        self.workdir = workdir
        self._ensure_workdir("streamtrain-kafka-")
        self.nodes: list[KafkaBroker] = []
        try:
            self.nodes = [self._node(i + 1) for i in range(brokers)]
        except BaseException:  # no jars, no java, a bad option: nothing to keep
            self.cleanup()
            raise
        voters = {n.node_id: f"{n.host}:{n.controller_port}" for n in self.nodes}
        for node in self.nodes:
            node.voters = voters
        self.ready_after_s: float | None = None
        """Seconds the last :meth:`start` took until a topic with every copy could be created."""

    def _node(self, node_id: int, port: int | None = None, controller_port: int | None = None) -> KafkaBroker:
        assert self.workdir is not None
        return KafkaBroker(node_id=node_id, port=port, controller_port=controller_port,
                           cluster_id=self.cluster_id, workdir=self.workdir / f"node{node_id}",
                           **self._options)

    @property
    def bootstrap(self) -> str:
        """``host:port`` of every node, comma-separated, for Kafka clients."""
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def replication_factor(self) -> int:
        """Copies of each partition that topics get by default here: ``min(3, brokers)``."""
        return min(3, len(self.nodes))

    @property
    def pids(self) -> list[int | None]:
        """The nodes' pids, node ``i`` at index ``i`` (None for one that is down)."""
        return [n.pid for n in self.nodes]

    def start(self) -> Self:
        """Start every node that is not running, then wait until each is up and a topic with
        :attr:`replication_factor` copies can be created. Idempotent.

        Raises:
            LaunchError: a node exited or was not ready in time (every node is stopped first), or
                the cluster could not create the topic in the nodes' ``start_timeout_s``.
        """
        t0 = time.monotonic()
        try:
            self._start_nodes([i for i, n in enumerate(self.nodes) if n.state is not ServerState.RUNNING])
            self._wait_replicated(self.nodes[0].start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.ready_after_s = time.monotonic() - t0
        return self

    def _start_nodes(self, indexes: Sequence[int]) -> None:
        """Launch the nodes at ``indexes`` (fresh processes for stopped ones), then wait for each:
        a quorum only forms once a majority of them runs, so none can be waited on alone."""
        for i in indexes:
            old = self.nodes[i]
            if old.state is ServerState.STOPPED:  # killed: a new process on its ports and folder
                self.nodes[i] = self._node(old.node_id, old.port, old.controller_port)
                self.nodes[i].voters = old.voters
        for i in indexes:
            self.nodes[i].launch()
        for i in indexes:
            self.nodes[i].wait_ready()

    def _wait_replicated(self, timeout_s: float) -> None:
        """Wait until a topic with :attr:`replication_factor` copies exists (created here)."""
        from kafka.admin import KafkaAdminClient
        from kafka.errors import KafkaError, TopicAlreadyExistsError

        if len(self.nodes) == 1:
            return  # the node's own probe created one
        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=5000,
                                 client_id="streamtrain-launcher")

        def created() -> bool:
            try:
                with contextlib.suppress(TopicAlreadyExistsError):
                    admin.create_topics({"__streamtrain_ready": {
                        "num_partitions": 1, "replication_factor": self.replication_factor}},
                        timeout_ms=5000, wait_for_metadata=True)
                return True
            except KafkaError as exc:
                logger.debug("kafka cluster not ready yet: %s", exc)
                return False

        try:
            wait_until(created, timeout_s, interval_s=0.5,
                       what=f"a topic with {self.replication_factor} copies on {self.bootstrap}")
        except TimeoutError as exc:
            raise LaunchError(f"kafka cluster {self.bootstrap}: {exc}") from None
        finally:
            admin.close()

    def kill(self, index: int | None = None) -> None:
        """SIGKILL node ``index`` (None: every node) and reap it; :meth:`restart` brings it back."""
        for node in self.nodes if index is None else [self.nodes[index]]:
            node.kill()
            node.stop()

    def restart(self, index: int | None = None, down_s: float = 0.0) -> KafkaBroker | None:
        """SIGKILL node ``index`` (None: every node) unless it is down already, wait ``down_s``, and
        start it again on its ports and folder (its data and cluster id); returns once it is
        ready (for every node: once the cluster is, as :meth:`start`). The restarted node, or None
        for every node."""
        self.kill(index)
        time.sleep(down_s)
        if index is None:
            self.start()
            return None
        try:
            self._start_nodes([index])
        except BaseException:
            self.nodes[index].stop()
            raise
        return self.nodes[index]

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL after its ``stop_timeout_s``). Idempotent.

        Every node gets its SIGTERM before any is waited on: a node stopped after the others
        would wait in its controlled shutdown for a quorum that is gone."""
        for node in self.nodes:
            node.terminate()
        for node in reversed(self.nodes):
            try:
                node.stop()
            except Exception:  # keep stopping the rest
                logger.exception("could not stop kafka node %d", node.node_id)

    def cleanup(self) -> None:
        """Remove the folder this object made (kept after :meth:`stop` for the logs)."""
        for node in self.nodes:
            node.cleanup()
        super().cleanup()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of every node's log, each under its name."""
        return "\n".join(f"--- node {n.node_id} ---\n{n.log_tail(lines)}" for n in self.nodes)

