"""A Docker engine of a test's own: ``dockerd`` with its own data root, exec root, socket and pidfile.

The data root is kept between runs (images and build layers are the cache: a second run rebuilds
only what changed); the exec root, with the socket and pidfile, is a fresh folder removed on stop.
One engine at a time uses a data root (a file lock beside it: a second run waits for the first).
The engine leaves the host's firewall and forwarding alone (``--iptables=false --ip-forward=false``)
and makes no default bridge (``--bridge=none``): containers on a user-defined network still reach
each other by name, and a published port is served on the host by ``docker-proxy``. Stopped by its
pid (SIGTERM, which also stops its containerd, then SIGKILL after a grace).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

STOP_GRACE_S = 60.0


class DockerEngine:
    """``dockerd`` on ``data_root``, its socket in a fresh exec root under ``/var/tmp`` (a unix socket's
    path must stay short). :attr:`env` is the environment for ``docker`` and ``docker-compose``."""

    def __init__(self, data_root: Path) -> None:
        self.data_root = data_root
        self.exec_root: Path | None = None
        self.pid: int | None = None
        self._lock: IO[str] | None = None
        self._log: IO[bytes] | None = None

    @property
    def socket(self) -> Path:
        assert self.exec_root is not None
        return self.exec_root / "docker.sock"

    @property
    def log_path(self) -> Path:
        assert self.exec_root is not None
        return self.exec_root / "dockerd.log"

    @property
    def env(self) -> dict[str, str]:
        """The caller's environment, pointed at this engine (without PYTHONPATH: docker-compose is a
        Python program of its own)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DOCKER_CONTEXT")}
        env["DOCKER_HOST"] = f"unix://{self.socket}"
        return env

    def start(self, timeout_s: float = 120.0) -> None:
        """Take the data root's lock (waiting for another run), start dockerd, wait until it answers."""
        self.data_root.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.data_root.with_name(self.data_root.name + ".lock"), "w")  # noqa: SIM115  # held open until stop() (the lock lives as long as the engine)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.exec_root = Path(tempfile.mkdtemp(prefix="st-docker-", dir="/var/tmp"))
        self._log = open(self.log_path, "wb")  # noqa: SIM115  # dockerd writes to it until stop() closes it
        proc = subprocess.Popen(
            ["dockerd", "--data-root", str(self.data_root), "--exec-root", str(self.exec_root),
             "--host", f"unix://{self.socket}", "--pidfile", str(self.exec_root / "docker.pid"),
             "--iptables=false", "--ip-forward=false", "--bridge=none", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = proc.pid
        self._proc = proc
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dockerd exited with {proc.returncode}:\n{self.log_tail()}")
            if self.socket.exists() and self.docker("version", check=False, timeout=20).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"dockerd did not answer within {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def docker(self, *args: str, check: bool = True, timeout: float = 300.0,
               stdin: IO[bytes] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``docker ARGS`` against this engine; raise with its output when it fails and ``check``."""
        result = subprocess.run(["docker", *args], env=self.env, stdin=stdin, capture_output=True, text=True,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} exited with {result.returncode}:\n"
                               f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
        return result

    def log_tail(self, chars: int = 4000) -> str:
        """The end of dockerd's own log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except (OSError, AssertionError):
            return ""

    def stop(self) -> None:
        """Stop dockerd by its pid (SIGTERM, SIGKILL after :data:`STOP_GRACE_S`), remove the exec root,
        release the lock. Idempotent."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGTERM)
                try:
                    self._proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(self.pid, signal.SIGKILL)  # its own session: dockerd and its containerd
                    self._proc.wait(timeout=30)
            except ProcessLookupError:
                pass
            self.pid = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.exec_root is not None:
            shutil.rmtree(self.exec_root, ignore_errors=True)
            self.exec_root = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None
