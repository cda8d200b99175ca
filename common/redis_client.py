"""One way to reach Redis from a URL: a single server or a Redis Cluster.

Every service builds its Redis client here (:func:`connect`, :func:`connect_async` for redis.asyncio):
``redis://`` (``rediss://``, ``unix://``) for one server, ``redis+cluster://host:port[,host:port...]``
for a cluster, whose clients allow the multi-key commands of one slot that redis-py refuses in cluster
pipelines. See docs/parameter-plane.md, *Client paths and hiredis* (*One URL, a server or a cluster*).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster as cluster
from redis.client import EMPTY_RESPONSE, NEVER_DECODE
from redis.commands.helpers import list_or_args
from redis.connection import Connection

from .urls import redact_url

__all__ = ["CLUSTER_SCHEME", "ClusterAddress", "ClusterUnreachable", "connect", "connect_async", "is_cluster_url",
           "parse_cluster_url", "redis_where"]

CLUSTER_SCHEME = "redis+cluster"
"""URL scheme of a Redis Cluster (``redis+cluster://:password@host:port,host:port``)."""


class ClusterUnreachable(redis.ConnectionError):
    """No node of a Redis Cluster answered, or none serves a slot yet (a cluster still forming).

    redis-py says so with a bare ``RedisClusterException`` (or fails on an empty slot map) when a
    client asks for the slot map; this is a ``ConnectionError`` instead, so a service started while
    the whole cluster is down waits it out as it waits out a single server that does not answer
    (``common.outage.REDIS_DOWN``)."""


def _unreachable(exc: BaseException) -> ClusterUnreachable | None:
    """``exc`` of a cluster client's slot-map query as :class:`ClusterUnreachable`, or None when it is
    another error (a node not in cluster mode, nodes that disagree)."""
    if isinstance(exc, cluster.RedisClusterException) and (
            "cannot be connected" in str(exc) or "slots are not covered" in str(exc)):  # down, or forming
        return ClusterUnreachable(str(exc))
    if isinstance(exc, IndexError):  # redis-py's default node of an empty slot map: no slot assigned yet
        return ClusterUnreachable("the Redis Cluster serves no slot yet")
    return None


def is_cluster_url(url: str) -> bool:
    """True when ``url`` names a Redis Cluster (scheme :data:`CLUSTER_SCHEME`)."""
    return url.partition("://")[0].lower() == CLUSTER_SCHEME


@dataclass(frozen=True)
class ClusterAddress:
    """What a ``redis+cluster://`` URL names: the startup nodes and the credentials."""

    nodes: tuple[tuple[str, int], ...]
    """``(host, port)`` of every node named, in order."""
    username: str | None
    """ACL user (None: the default user)."""
    password: str | None = field(repr=False)
    """Password (None: no AUTH)."""


def parse_cluster_url(url: str) -> ClusterAddress:
    """The nodes and credentials of a ``redis+cluster://`` URL.

    Raises:
        ValueError: not a cluster URL, no node, a node without a valid port, a
            database other than 0, or a query string (the message shows the URL
            with its password masked).
    """
    shown = redact_url(url)
    if not is_cluster_url(url):
        raise ValueError(f"not a {CLUSTER_SCHEME}:// URL: {shown!r}")
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ValueError(f"a {CLUSTER_SCHEME}:// URL takes no query or fragment: {shown!r}")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster has only database 0, got path {parts.path!r} in {shown!r}")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        host = host.strip("[]")  # [::1]:7000
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad node {item!r} in {shown!r}: expected host:port")
        nodes.append((host, int(port)))
    return ClusterAddress(tuple(nodes), username, password)


def _packing(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a cluster's node connections: a ``command_packer`` (which redis-py's
    RedisCluster does not pass on) becomes a connection class that uses it."""
    packer = kwargs.pop("command_packer", None)
    if packer is not None:
        base = kwargs.get("connection_class", Connection)

        class PackingConnection(base):  # type: ignore[misc, valid-type]  # a base class chosen at run time
            def __init__(self, **kw: Any) -> None:
                kw.setdefault("command_packer", packer)
                super().__init__(**kw)

        kwargs["connection_class"] = PackingConnection
    return kwargs


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A redis-py client for ``url``: :class:`redis.Redis` for a server, a
    :class:`redis.cluster.RedisCluster` for a ``redis+cluster://`` URL. Both are typed as
    :class:`redis.Redis`, the interface every caller uses: the cluster client answers the same
    commands for a job's keys (one slot), as ``tests/test_streamtrain_redis_cluster.py`` checks.

    ``kwargs`` go to the client (``socket_timeout``, ``command_packer``, ...).
    A cluster client asks the nodes for the slot map when it is made.

    Raises:
        ValueError: a malformed URL.
        ClusterUnreachable: no node of the cluster answered, or none serves a slot yet (a
            ``ConnectionError``: ``common.outage.wait_connected`` waits it out).
    """
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **kwargs)
    where = parse_cluster_url(url)
    # the first node as a redis:// URL: redis-py then builds each node's connection pool from the
    # kwargs, so a connection class (with the command packer) reaches the connections
    (host, port), *rest = where.nodes
    user = quote(where.username or "", safe="")
    auth = f"{user}:{quote(where.password, safe='')}@" if where.password is not None else (
        f"{user}@" if user else "")
    first = f"redis://{auth}{f'[{host}]' if ':' in host else host}:{port}/0"
    return cast(redis.Redis, _SyncCluster(url=first, startup_nodes=[cluster.ClusterNode(h, p) for h, p in rest],
                                          **_packing(kwargs)))


def connect_async(url: str, **kwargs: Any) -> aioredis.Redis:
    """The redis.asyncio twin of :func:`connect` (nothing is sent until the first command; a
    cluster client is typed as :class:`redis.asyncio.Redis` too)."""
    if not is_cluster_url(url):
        return aioredis.Redis.from_url(url, **kwargs)
    where = parse_cluster_url(url)
    return cast(aioredis.Redis, _AsyncCluster(startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in where.nodes],
                                              username=where.username, password=where.password, **kwargs))


def redis_where(client: Any) -> str:
    """``host:port`` of a client's server, or the nodes it started from for a cluster client
    (never a password)."""
    nodes = getattr(client, "nodes_manager", None)
    if nodes is not None:
        return ",".join(nodes.startup_nodes) or "?"
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return str(kw["path"])
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}"


# -- cluster pipelines that allow single-slot multi-key commands ---------------------------------
def _mget(self: Any, keys: Any, *args: Any) -> Any:
    return self.execute_command("MGET", *list_or_args(keys, args))


def _evalsha(self: Any, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
    return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)


def _delete(self: Any, *names: Any) -> Any:
    return self.execute_command("DEL", *names)


def _unlink(self: Any, *names: Any) -> Any:
    return self.execute_command("UNLINK", *names)


_RAW_OPTIONS = ("keys", EMPTY_RESPONSE, NEVER_DECODE)
"""Command options that are not arguments of a response callback (``Redis.parse_response`` drops them)."""


class _SyncPipeline(cluster.ClusterPipeline):
    """A cluster pipeline with MGET, EVALSHA and DEL/UNLINK of several keys (the keys of each
    command, and of a whole transaction, must still share one slot), whose MULTI/EXEC replies
    are parsed as a server's.

    redis-py 8.1's synchronous cluster transaction returns EXEC's replies without the commands'
    response callbacks (an XRANGE entry's fields stay a flat list, SET says ``b"OK"``); the
    asyncio one and every other pipeline apply them. :meth:`execute` applies them here
    (``tests/test_streamtrain_redis_cluster.py`` compares the replies with a plain server's).
    """

    mget = _mget
    evalsha = _evalsha
    delete = _delete
    unlink = _unlink

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        strategy = self._execution_strategy
        if not isinstance(strategy, cluster.TransactionStrategy):
            return super().execute(raise_on_error)
        queued = list(strategy.command_queue)
        replies = super().execute(raise_on_error)
        callbacks = cast(cluster.ClusterNode, self.nodes_manager.default_node).redis_connection.response_callbacks
        out = []
        for reply, cmd in zip(replies, queued, strict=True):
            name = cmd.args[0]
            if (not isinstance(reply, Exception) and name in callbacks
                    and name not in self.cluster_response_callbacks):
                options = {k: v for k, v in cmd.options.items() if k not in _RAW_OPTIONS}
                reply = callbacks[name](reply, **options)
            out.append(reply)
        return out


class _SyncCluster(cluster.RedisCluster):
    """:class:`redis.cluster.RedisCluster` whose pipelines are :class:`_SyncPipeline`, whose
    :meth:`close` closes every node's connections (made from a URL, redis-py's node clients do
    not own their pools, so its own ``close`` leaves their sockets open), and which raises
    :class:`ClusterUnreachable` when no node answers."""

    def __init__(self, **kwargs: Any) -> None:
        try:
            super().__init__(**kwargs)
        except (cluster.RedisClusterException, IndexError) as exc:
            unreachable = _unreachable(exc)
            if unreachable is None:
                raise
            raise unreachable from exc

    def close(self) -> None:
        manager = getattr(self, "nodes_manager", None)
        nodes = [] if manager is None else [*manager.nodes_cache.values(), *manager.startup_nodes.values()]
        super().close()
        for node in nodes:
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> _SyncPipeline:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        pipe.__class__ = _SyncPipeline  # the same object, with _SyncPipeline's methods
        return cast(_SyncPipeline, pipe)


class _AsyncPipeline(aiocluster.ClusterPipeline):
    """The redis.asyncio twin of :class:`_SyncPipeline` (its transactions parse their replies)."""

    mget = _mget
    evalsha = _evalsha
    delete = _delete
    unlink = _unlink


class _AsyncCluster(aiocluster.RedisCluster):
    """:class:`redis.asyncio.cluster.RedisCluster` whose pipelines are :class:`_AsyncPipeline`, and
    which raises :class:`ClusterUnreachable` when no node answers (at its first command)."""

    async def initialize(self, *args: Any, **kwargs: Any) -> _AsyncCluster:
        try:
            await super().initialize(*args, **kwargs)
        except (cluster.RedisClusterException, IndexError) as exc:
            unreachable = _unreachable(exc)
            if unreachable is None:
                raise
            raise unreachable from exc
        return self

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> _AsyncPipeline:
        if shard_hint:
            raise cluster.RedisClusterException("shard_hint is deprecated in cluster mode")
        return _AsyncPipeline(self, transaction)  # type: ignore[abstract]  # redis-py leaves _event_dispatcher unset
