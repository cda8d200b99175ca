"""Headless Chromium driven over the Chrome DevTools Protocol with aiohttp's websocket client.

Just what a page test needs: open a page, evaluate JavaScript, collect what the
page logged as an error, take a screenshot. No Playwright or Selenium::

    async with chromium(tmp_path / "profile") as page:
        await page.navigate("http://127.0.0.1:8700/")
        await page.wait_for("window.ready === true")
        assert page.errors() == []
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from streamtrain.launcher import await_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
"""Path of the Chromium binary (Debian's ``chromium``; ``scripts/setup_tests.sh`` installs it), or None."""

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic")
"""A quiet headless browser that talks to nothing but the pages it is sent to."""


class CdpError(RuntimeError):
    """A DevTools command failed, or JavaScript evaluated on the page threw."""


class Page:
    """One page target over its DevTools websocket; events are kept in :attr:`events`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        """Every event received, in order (``{"method", "params"}``)."""
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    async def _read(self) -> None:
        try:
            async for msg in self._ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                future = self._pending.pop(data["id"], None) if "id" in data else None
                if future is not None and not future.done():
                    future.set_result(data)
                elif "method" in data:
                    self.events.append(data)
        finally:  # the browser went away: fail every caller rather than let it hang
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("DevTools connection closed"))
            self._pending.clear()

    async def send(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send a command and return its ``result``.

        Raises:
            CdpError: the browser answered with an error.
            TimeoutError: no answer within ``timeout_s``.
        """
        msg_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        await self._ws.send_json({"id": msg_id, "method": method, "params": params})
        reply = await asyncio.wait_for(future, timeout_s)
        if "error" in reply:
            raise CdpError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript ``expression`` on the page (promises are awaited).

        Raises:
            CdpError: the expression threw.
        """
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(f"{expression!r} threw: "
                           f"{details.get('exception', {}).get('description') or details.get('text')}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0, poll_s: float = 0.2) -> Any:
        """Evaluate ``expression`` until it is truthy; return that value.

        Raises:
            TimeoutError: still falsy after ``timeout_s`` (the message has the page's errors).
        """
        try:
            return await await_until(lambda: self.evaluate(expression), timeout_s, interval_s=poll_s,
                                     what=f"{expression!r} to be truthy")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; page errors: {self.errors()}") from None

    async def navigate(self, url: str, timeout_s: float = 30.0) -> None:
        """Load ``url`` and wait until the document is complete."""
        await self.send("Page.enable")
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise CdpError(f"navigating to {url}: {result['errorText']}")
        await self.wait_for("document.readyState === 'complete'", timeout_s)

    async def screenshot(self) -> bytes:
        """A PNG of the whole page (not only the window)."""
        size = (await self.send("Page.getLayoutMetrics"))["cssContentSize"]
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                                 clip={"x": 0, "y": 0, "width": size["width"],
                                       "height": size["height"], "scale": 1})
        return base64.b64decode(result["data"])

    def errors(self) -> list[str]:
        """What the page reported as an error so far: uncaught exceptions, ``console.error``
        and browser log entries of level error (a failed resource load, a CSP refusal ...)."""
        out = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                out.append("exception: " + (details.get("exception", {}).get("description")
                                            or details.get("text", "?")))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = [str(a.get("value", a.get("description", ""))) for a in params.get("args", [])]
                out.append(f"console.{params['type']}: " + " ".join(args))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                out.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
        return out

    async def close(self) -> None:
        """Close the websocket and stop reading."""
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


async def _devtools_port(profile: Path, proc: asyncio.subprocess.Process, log: Path,
                         timeout_s: float) -> int:
    """The port Chromium chose (``--remote-debugging-port=0`` writes it to DevToolsActivePort)."""
    active = profile / "DevToolsActivePort"

    def port() -> int | None:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            lines = active.read_text().splitlines()
            if len(lines) >= 2:
                return int(lines[0])
        if proc.returncode is not None:
            raise ProcessLookupError
        return None

    try:
        return await await_until(port, timeout_s, what="chromium's DevTools port")
    except (TimeoutError, ProcessLookupError):
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"chromium did not open its DevTools port within {timeout_s}s "
                           f"(exit status {proc.returncode}); its log ends:\n{tail}") from None


@contextlib.asynccontextmanager
async def chromium(profile: Path, *, width: int = 1400, height: int = 1000,
                   timeout_s: float = 30.0) -> AsyncIterator[Page]:
    """A fresh headless Chromium (profile in ``profile``, log in ``profile/../chromium.log``) and
    its first page, with the Runtime and Log domains enabled; the browser is stopped on exit.

    Raises:
        RuntimeError: Chromium is not installed, or did not start within ``timeout_s``.
    """
    if CHROMIUM is None:
        raise RuntimeError("chromium is not installed (scripts/setup_tests.sh installs it)")
    profile.mkdir(parents=True, exist_ok=True)
    log = profile.parent / "chromium.log"
    with open(log, "wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
            f"--window-size={width},{height}", "about:blank",
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: its helpers stop with it
    try:
        port = await _devtools_port(profile, proc, log, timeout_s)
        async with aiohttp.ClientSession() as http:

            async def pages() -> list[dict[str, Any]]:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                    return [t for t in await resp.json() if t.get("type") == "page"]

            try:
                first = (await await_until(pages, timeout_s, what="chromium's first page"))[0]
            except TimeoutError:
                raise RuntimeError(f"chromium opened no page within {timeout_s}s") from None
            ws = await http.ws_connect(first["webSocketDebuggerUrl"], max_msg_size=256 << 20)
            page = Page(ws)
            try:
                await page.send("Runtime.enable")
                await page.send("Log.enable")
                yield page
            finally:
                await page.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
