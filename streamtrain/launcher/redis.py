"""A real ``redis-server`` on a loopback port, password-protected, persistence off unless asked for.

The password never appears on the server's command line (it is in a config file
only the owner can read), in our log lines or in our errors: print
:attr:`RedisServer.display_url` or :func:`redact_url`, never :attr:`RedisServer.url`.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from common.urls import redact_url

from .process import LaunchError, ManagedProcess, free_port

logger = logging.getLogger(__name__)

_PASSWORD_RE = re.compile(r"[!#-&(-\[\]-~]+")
"""Printable ASCII without spaces, quotes or backslashes: safe in a redis.conf line unquoted."""

CONFIG_NAME = "redis.conf"
"""The config file written into the server's folder (mode 0600; holds ``requirepass``)."""


class RedisServer(ManagedProcess):
    """``redis-server`` bound to ``host`` (127.0.0.1) on a free port, with ``requirepass``.

    Args:
        host: the address it binds (and :attr:`url` names).
        port: the port (a free one when None).
        password: the password clients must give (a fresh random one when None);
            printable ASCII without spaces, quotes or backslashes.
        appendonly: turn AOF persistence on (``appendfsync everysec``), so a
            killed and restarted server on the same ``workdir`` keeps its data.
        databases: number of logical databases (tests use one per test).
        binary: the ``redis-server`` executable.

    Raises:
        ValueError: ``password`` is empty or has characters a config line cannot
            hold (the message never contains the password), or ``databases`` < 1.
        LaunchError: ``binary`` is not on PATH.
    """

    name = "redis"

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, password: str | None = None,
                 appendonly: bool = False, databases: int = 64, binary: str = "redis-server",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        found = shutil.which(binary)
        if found is None:
            raise LaunchError(f"{binary!r} not found on PATH; run scripts/setup.sh "
                              "(apt-get install -y redis-server)")
        if databases < 1:
            raise ValueError(f"databases must be at least 1, got {databases}")
        if password is None:
            password = secrets.token_urlsafe(24)
        if not _PASSWORD_RE.fullmatch(password):
            raise ValueError(f"password ({len(password)} characters) must be non-empty printable "
                             "ASCII without spaces, quotes or backslashes")
        self.binary = found
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self.appendonly = appendonly
        self.databases = databases

    def url_for(self, db: int = 0) -> str:
        """``redis://:PASSWORD@host:port/db`` for redis-py's ``from_url`` (holds the password:
        pass it on, never print it; see :attr:`display_url`)."""
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/{db}"

    @property
    def url(self) -> str:
        """:meth:`url_for` database 0."""
        return self.url_for(0)

    @property
    def display_url(self) -> str:
        """:attr:`url` with the password masked, for logs and messages."""
        return redact_url(self.url)

    def _prepare(self) -> None:
        assert self.workdir is not None
        path = self.workdir / CONFIG_NAME
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(f"requirepass {self.password}\n")
        os.chmod(path, 0o600)  # also when the file was already there

    def _command(self) -> Sequence[str]:
        assert self.workdir is not None
        argv = [self.binary, str(self.workdir / CONFIG_NAME), "--bind", self.host,
                "--port", str(self.port), "--dir", str(self.workdir), "--save", "",
                "--daemonize", "no", "--databases", str(self.databases), "--logfile", "",
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
            client = redis.Redis(host=self.host, port=self.port, password=self.password,
                                 socket_timeout=1.0, socket_connect_timeout=1.0,
                                 retry=Retry(NoBackoff(), 0))
            try:
                return bool(client.ping())
            finally:
                client.close()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
