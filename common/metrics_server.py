"""The HTTP server of a process's own Prometheus registry (``GET /metrics``), shared by every service
that is not an aiohttp app (parameter servers, trainers, the joiner)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["MetricsServer"]

logger = logging.getLogger(__name__)


class MetricsServer:
    """prometheus_client's own HTTP server for ``registry`` on a daemon thread (``GET /metrics``;
    any path answers). ``port`` 0 binds a free port (tests); :attr:`port` is the bound one.

    Raises:
        OSError: the port cannot be bound (the message names it).
    """

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
        try:
            self._httpd, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror}") from exc
        self.port: int = self._httpd.server_port
        """The port it listens on."""
        logger.info("serving Prometheus metrics on %s:%d", addr, self.port)

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(5.0)
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
