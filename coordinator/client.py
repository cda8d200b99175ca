"""The async client trainers use to talk to the coordinator (:class:`CoordinatorClient`).

A :class:`~coordinator.errors.MemberGoneError` (410) or :class:`~coordinator.errors.UnknownMemberError`
(404) from :meth:`~CoordinatorClient.heartbeat` means the lease is lost: drop the partitions and
register anew. An example: docs/architecture.md, *The control plane: membership and assignment*.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any

import aiohttp

from .assignment import Assignment, Registration
from .errors import (
    AuthError,
    BadRequestError,
    CoordinatorError,
    CoordinatorUnavailableError,
    MemberGoneError,
    UnknownMemberError,
)

_ERRORS: dict[int, type[CoordinatorError]] = {400: BadRequestError, 401: AuthError,
                                              404: UnknownMemberError, 405: BadRequestError,
                                              410: MemberGoneError, 413: BadRequestError}


class CoordinatorClient:
    """HTTP client of one trainer: register, heartbeat, leave."""

    def __init__(self, base_url: str, job_token: str, *, timeout_s: float = 5.0,
                 session: aiohttp.ClientSession | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {job_token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None
        self.member_id: str | None = None
        """Id of the current registration (None before :meth:`register` and after :meth:`leave`)."""

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session if this client made it."""
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None

    async def _post(self, path: str, body: Mapping[str, Any] | None) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
            self._own_session = True
        try:
            async with self._session.post(self.base_url + path, json=body,
                                          headers=self._headers) as resp:
                data = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise CoordinatorUnavailableError(f"coordinator at {self.base_url} unreachable: "
                                              f"{exc!r}") from exc
        if status >= 400:
            message = (data or {}).get("error", {}).get("message", f"HTTP {status}")
            raise _ERRORS.get(status, CoordinatorUnavailableError)(message)
        return data

    def _member_path(self, action: str) -> str:
        if self.member_id is None:
            raise UnknownMemberError("not registered: call register() first")
        return f"/v1/members/{self.member_id}/{action}"

    async def register(self, capabilities: Mapping[str, Any]) -> Registration:
        """Register with ``capabilities`` (device, threads, memory_mb, hostname, ...).

        Raises:
            BadRequestError, AuthError, CoordinatorUnavailableError.
        """
        d = await self._post("/v1/members", {"capabilities": dict(capabilities)})
        reg = Registration(assignment=Assignment.from_json(d), lease_ms=int(d["lease_ms"]),
                           heartbeat_interval_ms=int(d["heartbeat_interval_ms"]))
        self.member_id = reg.member_id
        return reg

    async def heartbeat(self, stats: Mapping[str, Any] | None = None) -> Assignment:
        """Renew the lease, report ``stats``; return the current assignment.

        Raises:
            MemberGoneError / UnknownMemberError: the lease is lost; register anew.
            BadRequestError, AuthError, CoordinatorUnavailableError.
        """
        d = await self._post(self._member_path("heartbeat"), {"stats": dict(stats or {})})
        return Assignment.from_json(d)

    async def channel(self) -> AsyncIterator[int]:
        """Hold this member's presence channel open, yielding each generation the coordinator
        announces; returns when the coordinator closes it (see ``coordinator.channel``).

        Raises:
            CoordinatorUnavailableError: it could not be opened or broke.
        """
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
            self._own_session = True
        url = self.base_url + self._member_path("channel")
        try:
            async with self._session.ws_connect(url, headers=self._headers, timeout=aiohttp.ClientWSTimeout(
                    ws_close=self._timeout.total)) as ws:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        yield int(json.loads(msg.data)["generation"])
                    elif msg.type == aiohttp.WSMsgType.ERROR:
                        raise CoordinatorUnavailableError(f"presence channel broke: {ws.exception()!r}")
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            raise CoordinatorUnavailableError(f"presence channel at {self.base_url} failed: {exc!r}") from exc

    async def leave(self) -> int:
        """Leave gracefully (after committing); return the generation that removed us."""
        d = await self._post(self._member_path("leave"), None)
        self.member_id = None
        return int(d["generation"])
