"""A real ``redis-server`` on a loopback port, persistence off unless asked for."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence

from .process import LaunchError, ManagedProcess, free_port

logger = logging.getLogger(__name__)


class RedisServer(ManagedProcess):
    """``redis-server`` bound to 127.0.0.1 on a free port.

    Args:
        port: the port (a free one when None).
        appendonly: turn AOF persistence on (``appendfsync everysec``), so a
            killed and restarted server on the same ``workdir`` keeps its data.
        databases: number of logical databases (tests use one per test).
        binary: the ``redis-server`` executable.
    """

    name = "redis"

    def __init__(self, *, port: int | None = None, appendonly: bool = False,
                 databases: int = 64, binary: str = "redis-server", **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        found = shutil.which(binary)
        if found is None:
            raise LaunchError(f"{binary!r} not found on PATH; run scripts/setup.sh "
                              "(apt-get install -y redis-server)")
        if databases < 1:
            raise ValueError(f"databases must be at least 1, got {databases}")
        self.binary = found
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.appendonly = appendonly
        self.databases = databases

    @property
    def url(self) -> str:
        """``redis://host:port/0`` for redis-py's ``from_url``."""
        return f"redis://{self.host}:{self.port}/0"

    def _command(self) -> Sequence[str]:
        assert self.workdir is not None
        argv = [self.binary, "--bind", self.host, "--port", str(self.port),
                "--dir", str(self.workdir), "--save", "", "--daemonize", "no",
                "--databases", str(self.databases), "--logfile", "",
                "--protected-mode", "no"]
        if self.appendonly:
            argv += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            argv += ["--appendonly", "no"]
        return argv

    def _probe_ready(self) -> bool:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:
            client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0,
                                 socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))
            try:
                return bool(client.ping())
            finally:
                client.close()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
