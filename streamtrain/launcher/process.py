"""A server process that we start, wait on and stop: the shared part of the launchers.

Every server the launcher starts is a child of this process, in its own process
group, with a parent-death signal so that it cannot outlive us even when we are
killed with SIGKILL. We only ever signal pids that we started ourselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import inspect
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self, TypeVar

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

T = TypeVar("T")


class LaunchError(RuntimeError):
    """A server could not be started, or did not become ready in time.

    The message names the server and carries the tail of its log.
    """


class ServerState(str, enum.Enum):
    """Lifecycle of a launched server."""

    NEW = "new"
    """Not started yet."""
    STARTING = "starting"
    """Process spawned, waiting for readiness."""
    RUNNING = "running"
    """Ready and serving."""
    STOPPED = "stopped"
    """Stopped (or failed to start); the process has been reaped."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Ask Linux to SIGTERM the child when its parent dies (no orphans)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def pid_alive(pid: int) -> bool:
    """True when a process with ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


class ServerFolder:
    """What every launcher shares: its folder (``workdir`` when given, else a temporary one made on
    first use and removed by :meth:`cleanup`), and use as a context manager (start on entry; stop
    and clean up on exit). Subclasses provide ``start`` and ``stop``."""

    workdir: Path | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _ensure_workdir(self, prefix: str) -> Path:
        """The folder, made (a temporary one named ``prefix...`` when none was given) if missing."""
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self.workdir

    def cleanup(self) -> None:
        """Remove the temporary folder this object made (kept after a failed start for the logs)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        self.cleanup()


class ManagedProcess(ServerFolder):
    """One server process: spawned, waited on until ready, stopped by its pid.

    Subclasses provide the command line (:meth:`_command`), optional preparation
    of the working folder (:meth:`_prepare`) and a readiness probe
    (:meth:`_probe_ready`). Usable as a context manager.
    """

    name = "server"

    def __init__(self, *, workdir: Path | None = None, start_timeout_s: float = 60.0,
                 stop_timeout_s: float = 20.0) -> None:
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s!r}")
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._own_workdir = workdir is None
        self.workdir = workdir
        self.state = ServerState.NEW
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_fh: BinaryIO | None = None
        self.ready_after_s: float | None = None
        self._launched_at = 0.0

    # -- to override -------------------------------------------------------
    def _prepare(self) -> None:
        """Write configuration into ``self.workdir`` before the process starts."""

    def _command(self) -> Sequence[str]:
        raise NotImplementedError

    def _probe_ready(self) -> bool:
        """Return True once the server answers; called until the start deadline."""
        raise NotImplementedError

    def _environment(self) -> dict[str, str] | None:
        """The child's environment; None inherits ours."""
        return None

    # -- lifecycle ---------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The server's pid while it runs, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        """Where the server's stdout and stderr go."""
        assert self.workdir is not None, "log_path is known once started"
        return self.workdir / f"{self.name}.log"

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log ('' when there is none)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except (OSError, AssertionError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> Self:
        """Start the server and block until it is ready. Idempotent.

        Raises:
            LaunchError: the process exited early or was not ready within
                ``start_timeout_s``; the message holds the log's tail. The
                process is stopped before the error is raised.
        """
        if self.state is ServerState.RUNNING:
            return self
        return self.launch().wait_ready()

    def launch(self) -> Self:
        """Prepare and spawn the process without waiting for it: the first half of :meth:`start`,
        for servers that only become ready together (the nodes of a KRaft quorum). Idempotent.

        Spawn from the thread that will live as long as the server: the parent-death signal
        fires when the spawning *thread* exits.

        Raises:
            LaunchError: it could not be spawned (the process is stopped first).
        """
        if self.state in (ServerState.STARTING, ServerState.RUNNING):
            return self
        if self.state is not ServerState.NEW:
            raise LaunchError(f"{self.name} cannot be restarted once stopped; make a new one")
        self._ensure_workdir(f"streamtrain-{self.name}-")
        self.state = ServerState.STARTING
        self._launched_at = time.monotonic()
        try:
            self._prepare()
            self._spawn(self._command())
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> Self:
        """Block until a launched server is ready: the second half of :meth:`start`. Idempotent.

        Raises:
            LaunchError: as :meth:`start`; also when it was never launched.
        """
        if self.state is ServerState.RUNNING:
            return self
        if self.state is not ServerState.STARTING:
            raise LaunchError(f"{self.name} is {self.state.value}, not launched")
        try:
            self._wait_ready(self._launched_at)
        except BaseException:
            self.stop()
            raise
        self.ready_after_s = time.monotonic() - self._launched_at
        self.state = ServerState.RUNNING
        logger.info("%s ready in %.2fs (pid %s)", self.name, self.ready_after_s, self.pid)
        return self

    def _spawn(self, argv: Sequence[str]) -> None:
        self._log_fh = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        logger.debug("starting %s: %s", self.name, " ".join(argv))
        try:
            self._proc = subprocess.Popen(
                list(argv), cwd=self.workdir, stdin=subprocess.DEVNULL,
                stdout=self._log_fh, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent, env=self._environment(),
            )
        except FileNotFoundError as exc:
            raise LaunchError(f"{self.name}: cannot run {argv[0]!r}: {exc}") from exc

    def _wait_ready(self, t0: float) -> None:
        deadline = t0 + self.start_timeout_s
        delay = 0.05
        while True:
            assert self._proc is not None
            code = self._proc.poll()
            if code is not None:
                raise LaunchError(
                    f"{self.name} exited with code {code} before it was ready; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}")
            if self._probe_ready():
                return
            if self._proc.poll() is not None:
                continue  # exited while we probed: report that, not a time-out
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{self.name} was not ready after {self.start_timeout_s:.0f}s; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _run_tool(self, argv: Sequence[str], what: str, timeout_s: float = 120.0) -> None:
        """Run a short helper command to completion, raising LaunchError on failure."""
        try:
            res = subprocess.run(list(argv), cwd=self.workdir, capture_output=True,
                                 timeout=timeout_s, check=False, preexec_fn=_die_with_parent)
        except FileNotFoundError as exc:
            raise LaunchError(f"{self.name}: cannot run {argv[0]!r} to {what}: {exc}") from exc
        if res.returncode != 0:
            tail = "\n".join((res.stdout + res.stderr).decode(errors="replace").splitlines()[-30:])
            raise LaunchError(f"{self.name}: failed to {what} (exit {res.returncode}):\n{tail}")

    def terminate(self) -> None:
        """SIGTERM the server without waiting (:meth:`stop` waits and reaps): to let several
        servers that depend on each other, such as a KRaft quorum, shut down together."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the server (fault injection); it is then reaped by :meth:`stop`."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def stop(self) -> None:
        """Stop the server by its pid: SIGTERM, then SIGKILL after ``stop_timeout_s``.

        Idempotent; removes the temporary folder this object created.
        """
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            logger.debug("stopping %s (pid %s)", self.name, proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %s) ignored SIGTERM; killing", self.name, proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        if self.state is not ServerState.STARTING:
            self.cleanup()
        self.state = ServerState.STOPPED


def wait_until(predicate: Callable[[], T], timeout_s: float, *, interval_s: float = 0.05,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value, and return that value.

    The predicate is called at least once, and once more after the deadline
    passes, so a slow sleep never turns a success into a time-out.

    Raises:
        TimeoutError: ``predicate`` stayed falsy for ``timeout_s`` seconds; the
            message names ``what`` was awaited.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        expired = time.monotonic() > deadline
        result = predicate()
        if result:
            return result
        if expired:
            raise TimeoutError(f"timed out after {timeout_s:.1f}s waiting for {what}")
        time.sleep(interval_s)


async def await_until(predicate: Callable[[], T | Awaitable[T]], timeout_s: float, *,
                      interval_s: float = 0.05, what: str = "condition") -> T:
    """The async twin of :func:`wait_until`: poll without blocking the event loop.

    ``predicate`` may be a plain function or return an awaitable (an ``async
    def`` function); its awaited result is tested. Returns the first truthy
    value.

    Raises:
        TimeoutError: ``predicate`` stayed falsy for ``timeout_s`` seconds; the
            message names ``what`` was awaited.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        expired = time.monotonic() > deadline
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if expired:
            raise TimeoutError(f"timed out after {timeout_s:.1f}s waiting for {what}")
        await asyncio.sleep(interval_s)
