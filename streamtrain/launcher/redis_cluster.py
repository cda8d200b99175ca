"""A real Redis Cluster on loopback: three masters (and optionally a replica of each).

Each node is a :class:`~streamtrain.launcher.redis.RedisServer` with ``--cluster-enabled yes``, all with
one fresh password; ``redis-cli --cluster create`` assigns the slots, and the cluster is ready once
``CLUSTER INFO`` says ``cluster_state:ok`` on every node, every node knows all the others and every
replica has had its first sync. Clients use :attr:`RedisCluster.url` (:mod:`common.redis_client`);
print :attr:`RedisCluster.display_url`, never the URL. See README.md, *Redis Cluster*.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote

from common.redis_client import CLUSTER_SCHEME, connect
from common.urls import redact_url

from .process import LaunchError, ServerFolder, ServerState, _die_with_parent, free_port, pid_alive
from .redis import CONFIG_NAME, RedisServer

logger = logging.getLogger(__name__)

NODE_TIMEOUT_MS = 5000
"""``cluster-node-timeout``: how long a node may be unreachable before it is failed over."""


class ClusterNode(RedisServer):
    """One ``redis-server`` of a cluster: a :class:`RedisServer` with cluster mode on.

    Args:
        bus_port: the cluster bus port (a free one when None; Redis's default,
            port + 10000, may be taken or out of range).
        kwargs: as for :class:`RedisServer` (one database: a cluster has only db 0).
    """

    name = "redis-node"

    def __init__(self, *, bus_port: int | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("databases", 1)
        super().__init__(**kwargs)
        self.bus_port = bus_port or free_port(self.host)

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def _prepare(self) -> None:
        super()._prepare()  # requirepass, mode 0600
        assert self.workdir is not None
        with open(self.workdir / CONFIG_NAME, "a", encoding="ascii") as fh:
            fh.write(f"masterauth {self.password}\n")  # a replica authenticates to its master

    def _command(self) -> Sequence[str]:
        return [*super()._command(), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(self.bus_port), "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]

    def replication_linked(self) -> bool:
        """True unless this node is a replica whose link to its master is not up (``INFO
        replication``: ``master_link_status``): a replica still in its first sync cannot be promoted."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=1.0,
                             socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))
        try:
            info = client.info("replication")
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        finally:
            client.close()
        return info.get("role") != "slave" or info.get("master_link_status") == "up"

    def cluster_info(self) -> dict[str, str]:
        """``CLUSTER INFO`` of this node ({} while it does not answer)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=1.0,
                             socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))
        try:
            raw = client.execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
        except (redis.ConnectionError, redis.TimeoutError):
            return {}
        finally:
            client.close()
        if isinstance(raw, bytes | str):
            text = raw.decode() if isinstance(raw, bytes) else raw
            return dict(line.strip().split(":", 1) for line in text.splitlines() if ":" in line)
        return {str(k): str(v) for k, v in raw.items()}


class RedisCluster(ServerFolder):
    """A Redis Cluster of ``masters`` masters and ``replicas`` replicas of each, on loopback.

    Same lifecycle as the other launchers: :meth:`start` (blocks until the
    cluster is ready), :meth:`stop` (every node by its pid), or ``with``.

    Args:
        masters: master nodes (at least 3, as Redis Cluster requires).
        replicas: replicas per master (0 or more).
        password: the password of every node (a fresh random one when None).
        appendonly: AOF persistence on every node, as for :class:`RedisServer`.
        host: the address every node binds and announces.
        workdir: folder of the nodes' folders (a temporary one, removed on stop, when None).
        start_timeout_s: how long the whole cluster may take to become ready.
        stop_timeout_s: how long each node may take to stop before it is killed.
        binary: the ``redis-server`` executable.
        cli: the ``redis-cli`` executable (creates the cluster).

    Raises:
        ValueError: fewer than 3 masters, negative replicas, or a bad password.
        LaunchError: ``binary`` or ``cli`` is not on PATH.
    """

    name = "redis-cluster"

    def __init__(self, *, masters: int = 3, replicas: int = 0, password: str | None = None,
                 appendonly: bool = False, host: str = "127.0.0.1", workdir: Path | None = None,
                 start_timeout_s: float = 60.0, stop_timeout_s: float = 20.0,
                 binary: str = "redis-server", cli: str = "redis-cli") -> None:
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s!r}")
        found = shutil.which(cli)
        if found is None:
            raise LaunchError(f"{cli!r} not found on PATH; run scripts/setup.sh "
                              "(apt-get install -y redis-server)")
        self.cli = found
        self.masters = masters
        self.replicas = replicas
        self.host = host
        self.appendonly = appendonly
        self.start_timeout_s = start_timeout_s
        self.workdir = workdir
        self.password = secrets.token_urlsafe(24) if password is None else password
        """The password of every node (in each node's config file, never on a command line)."""
        self._node_kwargs: dict[str, object] = {"host": host, "password": self.password, "appendonly": appendonly,
                                                "binary": binary, "stop_timeout_s": stop_timeout_s}
        self.nodes: list[ClusterNode] = []
        """Every node; ``redis-cli`` makes the first ``masters`` the masters."""
        for _ in range(masters * (1 + replicas)):
            self.nodes.append(self._new_node())  # the first checks the password
        self.state = ServerState.NEW
        self.ready_after_s: float | None = None

    def _new_node(self) -> ClusterNode:
        """A node whose client and bus ports differ from every other node's."""
        taken = {p for n in self.nodes for p in (n.port, n.bus_port)}
        while True:
            port, bus = free_port(self.host), free_port(self.host)
            if port != bus and not {port, bus} & taken:
                return ClusterNode(port=port, bus_port=bus, **self._node_kwargs)

    # -- addresses --------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis+cluster://:PASSWORD@host:port,...`` naming every node, for
        :func:`common.redis_client.connect` (holds the password: pass it on, never print it)."""
        nodes = ",".join(n.address for n in self.nodes)
        return f"{CLUSTER_SCHEME}://:{quote(self.password, safe='')}@{nodes}"

    @property
    def display_url(self) -> str:
        """:attr:`url` with the password masked, for logs and messages."""
        return redact_url(self.url)

    @property
    def pids(self) -> list[int]:
        """Pids of the nodes that run."""
        return [n.pid for n in self.nodes if n.pid is not None]

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> Self:
        """Start every node, create the cluster and block until it is ready. Idempotent.

        Raises:
            LaunchError: a node did not start, ``redis-cli --cluster create`` failed, or the
                cluster was not ready within ``start_timeout_s``; every node is stopped first.
        """
        if self.state is ServerState.RUNNING:
            return self
        if self.state is not ServerState.NEW:
            raise LaunchError(f"{self.name} cannot be restarted once stopped; make a new one")
        self._ensure_workdir(f"streamtrain-{self.name}-")
        self.state = ServerState.STARTING
        t0 = time.monotonic()
        try:
            for i in range(len(self.nodes)):
                self._start_node(i, t0)
            self._create()
            self._wait_ready(t0 + self.start_timeout_s)
        except BaseException:
            self.stop()  # keeps the folder (the nodes' logs) until cleanup()
            raise
        self.ready_after_s = time.monotonic() - t0
        self.state = ServerState.RUNNING
        logger.info("%s of %d masters, %d replicas each, ready in %.2fs (pids %s)", self.name, self.masters,
                    self.replicas, self.ready_after_s, self.pids)
        return self

    def _start_node(self, i: int, t0: float) -> None:
        """Start node ``i``; a port taken since it was picked (free a moment ago is all
        :func:`free_port` promises) gets the node fresh ports, twice at most."""
        for attempt in (1, 2, 3):
            node = self.nodes[i]
            assert self.workdir is not None
            node.workdir = self.workdir / f"node-{node.port}"
            node.start_timeout_s = max(1.0, self.start_timeout_s - (time.monotonic() - t0))
            try:
                node.start()
                return
            except LaunchError as exc:
                if attempt == 3 or "Address already in use" not in str(exc):
                    raise
                logger.info("%s %s: a port was taken meanwhile; trying other ports", node.name, node.address)
                self.nodes[i] = self._new_node()

    def _create(self) -> None:
        """``redis-cli --cluster create`` over every node, the password in its environment."""
        argv = [self.cli, "--cluster", "create", *(n.address for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        env = {**os.environ, "REDISCLI_AUTH": self.password}
        try:
            res = subprocess.run(argv, cwd=self.workdir, env=env, capture_output=True, check=False,
                                 timeout=max(1.0, self.start_timeout_s), preexec_fn=_die_with_parent)
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(f"{self.name}: redis-cli --cluster create did not finish") from exc
        out = (res.stdout + res.stderr).decode(errors="replace").replace(self.password, "***")
        if res.returncode != 0 or "[OK] All 16384 slots covered" not in out:
            tail = "\n".join(out.splitlines()[-30:])
            raise LaunchError(f"{self.name}: redis-cli --cluster create failed (exit {res.returncode}):\n{tail}")

    def _wait_ready(self, deadline: float) -> None:
        """Until every node says ``cluster_state:ok`` and knows every node, and every replica has
        finished its first sync (until then its master's death would leave the slots unserved)."""
        delay = 0.05
        while True:
            infos = [n.cluster_info() for n in self.nodes]
            if all(i.get("cluster_state") == "ok" and i.get("cluster_known_nodes") == str(len(self.nodes))
                   for i in infos) and all(n.replication_linked() for n in self.nodes):
                return
            for node in self.nodes:
                if node.pid is None or not pid_alive(node.pid):
                    raise LaunchError(f"{node.name} {node.address} exited; last lines of {node.log_path}:\n"
                                      f"{node.log_tail()}")
            if time.monotonic() > deadline:
                states = ", ".join(f"{n.address}: {i.get('cluster_state', 'no answer')}"
                                   for n, i in zip(self.nodes, infos, strict=True))
                raise LaunchError(f"{self.name} was not ready after {self.start_timeout_s:.0f}s ({states})")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    # -- fault injection ----------------------------------------------------------------------------
    def master_of(self, key: str) -> ClusterNode:
        """The node that serves ``key``'s slot now (a master; after a failover, the promoted replica)."""
        client = connect(self.url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            serving = client.get_node_from_key(key)  # type: ignore[attr-defined]  # a cluster client
            return next(n for n in self.nodes if n.port == serving.port)
        finally:
            client.close()

    def kill_master_of(self, key: str) -> ClusterNode:
        """SIGKILL the master that serves ``key``'s slot; returns it. Its replica (``replicas`` >= 1) is
        promoted once the others have missed it for ``cluster-node-timeout`` (:data:`NODE_TIMEOUT_MS`)."""
        node = self.master_of(key)
        node.kill()
        logger.info("%s: killed master %s serving %r", self.name, node.address, key)
        return node

    def stop(self) -> None:
        """Stop every node by its pid (SIGTERM, then SIGKILL); idempotent. Removes the folder
        this object created."""
        for node in reversed(self.nodes):  # replicas first: a master stopping waits for its replicas
            try:
                node.stop()
            except Exception:  # keep stopping the rest
                logger.exception("could not stop %s %s", node.name, node.address)
        if self.state is not ServerState.STARTING:
            self.cleanup()
        self.state = ServerState.STOPPED
