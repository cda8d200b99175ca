"""The automatic checkpoint of ``streamtrain ps --checkpoint-every N`` (group 0), on a thread of its
own so the apply loop goes on meanwhile; one at a time, started when
:class:`~services.server.core.ServerCore` says (``docs/parameter-plane.md``, "Checkpoints")."""

from __future__ import annotations

import logging
import os
import threading

import redis

from common.outage import REDIS_DOWN

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)


class Checkpointer:
    """Runs a job's automatic checkpoints into ``directory``, one at a time, each on its own thread.

    The apply thread starts one (:meth:`start`) and learns that it ended (:meth:`reap`); :meth:`close`
    refuses new ones and waits for the one running.
    """

    def __init__(self, client: redis.Redis, job: str, directory: str) -> None:
        self.client = client
        self.job = job
        self.directory = directory
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None
        self.saved: list[str] = []
        """Paths of the checkpoints saved, oldest first."""

    def path(self, version: int) -> str:
        """Where the checkpoint due at group-0 version ``version`` goes."""
        return os.path.join(self.directory, f"{self.job}-v{version:012d}.pt")

    def start(self, version: int) -> bool:
        """Start saving the checkpoint due at ``version``. False (nothing started) when closed.

        Raises:
            RuntimeError: one is still running (the core starts one at a time).
        """
        with self._lock:
            if self._closed:
                return False
            if self._thread is not None:
                raise RuntimeError(f"automatic checkpoint started at version {version} while another runs")
            self._thread = threading.Thread(target=self._save, args=(version,), daemon=True,
                                            name=f"ps-{self.job}-checkpoint")
            self._thread.start()
            return True

    @property
    def running(self) -> bool:
        """A checkpoint is started and not yet reaped."""
        return self._thread is not None

    def reap(self) -> bool:
        """True once after the checkpoint started ended (then another may start).

        Raises:
            BaseException: what the checkpoint raised beyond the failures it logs (a bug), raised here
                on the apply thread as when the checkpoint ran on it.
        """
        thread = self._thread
        if thread is None or thread.is_alive():
            return False
        thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the checkpoint running (if any) ends; True when none runs."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def close(self) -> None:
        """Start no more checkpoints and wait for the one running to finish (not cut off half way)."""
        with self._lock:
            self._closed = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            logger.info("ps job=%s: waiting for the automatic checkpoint to finish", self.job)
        self.wait()

    def _save(self, version: int) -> None:
        from ..snapshot.checkpoint import CheckpointError, save_checkpoint

        path = self.path(version)
        try:
            save_checkpoint(self.client, self.job, path)
            self.saved.append(path)
            logger.info("ps job=%s: automatic checkpoint at group-0 version %d saved to %s", self.job, version, path)
        except (CheckpointError, OSError, *REDIS_DOWN) as exc:  # a missed checkpoint must not stop applying
            logger.error("ps job=%s: automatic checkpoint at group-0 version %d failed: %s", self.job, version, exc)
        except BaseException as exc:  # noqa: BLE001 - handed to the apply thread, which raises it (reap)
            self._error = exc
