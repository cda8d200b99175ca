"""Running a coordinator in-process for tests: ``async with running_coordinator(settings) as client``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp.test_utils import TestClient, TestServer

from .app import create_app
from .settings import CoordinatorSettings


@contextlib.asynccontextmanager
async def running_coordinator(settings: CoordinatorSettings) -> AsyncIterator[TestClient]:
    """The coordinator app on a test server (a free loopback port) and an HTTP client for it;
    the app's background tasks run, and everything is closed on exit."""
    client = TestClient(TestServer(create_app(settings)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
