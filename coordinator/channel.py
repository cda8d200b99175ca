"""Presence channels: a WebSocket per trainer, so the coordinator learns of a death at once.

A closed channel removes its member at once (:class:`~coordinator.membership.Disconnected`); the lease
stays for a frozen process or a lost network. Every new generation is announced on every channel, and
a request that is not a WebSocket handshake is refused with 400 ``not_a_websocket``.
See docs/architecture.md, *The control plane: membership and assignment*.
"""

from __future__ import annotations

import contextlib
import logging

from aiohttp import WSMsgType, web

from .errors import UnknownMemberError
from .membership import Disconnected
from .routes import ApiError, authenticate
from .runtime import RUNTIME, Runtime, apply_event, now_ms

logger = logging.getLogger(__name__)

__all__ = ["channel", "close_channels"]


async def channel(request: web.Request) -> web.StreamResponse:
    """The presence channel of one live member (docs/architecture.md, *The control plane*)."""
    rt: Runtime = request.app[RUNTIME]
    authenticate(request, rt.settings.job_token, "job")
    # no pings: a closed socket is the signal; a busy trainer slow to pong must not read as dead
    # (frozen processes and lost networks are the lease's)
    ws = web.WebSocketResponse()
    if not ws.can_prepare(request).ok:
        raise ApiError(400, "not_a_websocket", f"{request.path} is a WebSocket: open it with a WebSocket "
                                               "handshake (Upgrade: websocket, Connection: Upgrade, "
                                               "Sec-WebSocket-Version: 13, Sec-WebSocket-Key)")
    member_id = request.match_info["member_id"]
    state = await rt.store.load()
    if member_id not in state.members:
        raise ApiError(404, "unknown_member", f"member {member_id!r} is not a live member")
    await ws.prepare(request)
    previous = rt.channels.get(member_id)
    rt.channels[member_id] = ws
    if previous is not None:
        await previous.close()
    try:
        async for msg in ws:  # trainers send nothing; the point is to learn when it closes
            if msg.type == WSMsgType.ERROR:
                break
    finally:
        if rt.channels.get(member_id) is ws:
            del rt.channels[member_id]
            if not rt.closing:  # the coordinator's own shutdown closes channels: nobody died
                with contextlib.suppress(UnknownMemberError):
                    _, actions = await apply_event(rt, Disconnected(member_id, now_ms=now_ms()))
                    if actions:
                        logger.info("member %s disconnected: removed before its lease ran out", member_id)
    return ws


async def close_channels(app: web.Application) -> None:
    """On shutdown: mark the runtime closing (a closed channel is then no death) and close them all."""
    rt = app.get(RUNTIME)
    if rt is None:
        return
    rt.closing = True
    for ws in list(rt.channels.values()):
        await ws.close(code=1001, message=b"coordinator shutting down")
