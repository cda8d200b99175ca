"""Start and stop the real servers streamtrain needs, on loopback.

Used by the tests' session fixtures, the benchmarks and ``streamtrain up``.
"""

from common.urls import redact_url

from .kafka import KAFKA_VERSION, KafkaBroker, KafkaCluster, cache_dir, kafka_libs_dir, replication_config
from .process import (
    LaunchError,
    ManagedProcess,
    ServerState,
    await_until,
    free_port,
    pid_alive,
    wait_until,
)
from .redis import RedisServer
from .redis_cluster import RedisCluster
from .service import ServiceProcess

__all__ = [
    # servers
    "KafkaBroker",
    "KafkaCluster",
    "RedisServer",
    "RedisCluster",
    "ServiceProcess",
    "ManagedProcess",
    "ServerState",
    # errors
    "LaunchError",
    # helpers
    "KAFKA_VERSION",
    "cache_dir",
    "free_port",
    "kafka_libs_dir",
    "replication_config",
    "pid_alive",
    "redact_url",
    "wait_until",
    "await_until",
]
