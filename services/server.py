"""The parameter-server service (``streamtrain ps``): applies the update log exactly once.

Several servers may split the shards: server ``group`` of ``groups`` owns the
shards ``i`` with ``i % groups == group`` and keeps its own cursor (the last
update id it applied). In each round it:

1. reads up to ``batch`` pending updates (XREAD after its cursor);
2. for each of them in log order, decodes and validates *all* of its
   gradients (so every group reaches the same verdict on a bad one; a refused
   update is recorded as rejected and the others still apply) and applies one
   optimizer step to its own shards in memory, from a cache of them loaded
   from Redis: exactly the math of applying the updates one by one;
3. writes the final shards and optimizer state once with ``lua/apply.lua``
   (:mod:`services.apply`), which succeeds only if its cursor and the shard
   versions are still what it read (compare-and-set), and in the same atomic
   step bumps ``model_version`` once, moves the cursor past the batch's last
   update, and counts the group in ``apply_progress`` of every update. The
   group that completes an update's count also raises the member's
   ``applied_clocks``, appends its ``applied_samples`` entry and deletes it
   from the log, so those happen exactly once per update.

Killed before 3, nothing was written and the batch is redone on restart;
killed after 3, the cursor has moved past it. A CAS failure (another server
of the same group won) reloads the cache from Redis; so does any failure
between 2 and 3 (the cache is then ahead of Redis).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import redis
import torch

from streamtrain.keys import JobKeys
from streamtrain.settings import setting

from .apply import Outcome, ShardWrite, write_batch
from .errors import LayoutError, ParameterPlaneError
from .optim import clip_factor, slots, step
from .store import ModelMeta, ParameterStore, connect
from .updates import Update, load_gradients, parse_entry, validate_gradients
from .wire import DEFAULT_MAX_BYTES

logger = logging.getLogger(__name__)

__all__ = ["ServerSettings", "ServerStatus", "ParameterServer"]


@dataclass(frozen=True)
class ServerSettings:
    """Settings of one parameter server (``streamtrain ps``)."""

    redis_url: str = setting("redis://127.0.0.1:6379/0", env="STREAMTRAIN_REDIS_URL",
                             help="Redis holding the parameters")
    job: str = setting("default", env="STREAMTRAIN_JOB", help="job whose model this server applies")
    group: int = setting(0, env="STREAMTRAIN_PS_GROUP", min=0, help="this server's shard group")
    groups: int = setting(1, env="STREAMTRAIN_PS_GROUPS", min=1, max=1024,
                          help="number of shard groups (must match the job's model)")
    block_ms: int = setting(200, env="STREAMTRAIN_PS_BLOCK_MS", min=1, max=60000,
                            help="longest wait for new updates before checking for shutdown")
    batch: int = setting(16, env="STREAMTRAIN_PS_BATCH", min=1, max=10000,
                         help="most pending updates applied per write (one read, one atomic write)")
    max_update_bytes: int = setting(DEFAULT_MAX_BYTES, env="STREAMTRAIN_PS_MAX_UPDATE_BYTES", min=1024,
                                    help="largest gradient accepted per shard")
    checkpoint_every: int = setting(0, env="STREAMTRAIN_PS_CHECKPOINT_EVERY", min=0,
                                    help="group 0 saves a checkpoint every N model versions (0: off)")
    checkpoint_dir: str = setting("checkpoints", env="STREAMTRAIN_PS_CHECKPOINT_DIR",
                                  help="directory of automatic checkpoints")
    torch_threads: int = setting(1, env="STREAMTRAIN_PS_TORCH_THREADS", min=1, max=256,
                                 help="torch intra-op threads of the ps process (1 avoids spinning "
                                      "threads on a shared machine)")
    fault: str = setting("none", env="STREAMTRAIN_PS_FAULT",
                         choices=("none", "kill-before-write", "kill-after-write"),
                         help="TESTING ONLY: SIGKILL this process around the write of update number fault_at")
    fault_at: int = setting(0, env="STREAMTRAIN_PS_FAULT_AT", min=0,
                            help="TESTING ONLY: which update (1-based, counted by this process) faults: "
                                 "the kill hits the write of the batch holding it")

    def __post_init__(self) -> None:
        if self.group >= self.groups:
            raise ValueError(f"group {self.group} must be below groups {self.groups}")


class ServerStatus(str, enum.Enum):
    """Lifecycle of a :class:`ParameterServer`."""

    INIT = "init"
    """Created, not started."""
    RUNNING = "running"
    """Applying updates."""
    CLOSING = "closing"
    """Stop requested."""
    CLOSED = "closed"
    """Stopped cleanly."""
    FAILED = "failed"
    """The apply loop died; ``error`` says why."""


@dataclass
class _GroupState:
    """The server's cache of its shards (source of truth is Redis)."""

    cursor: str = ""
    params: dict[int, torch.Tensor] = field(default_factory=dict)
    opt: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)


def _tensor(blob: bytes | None, numel: int, what: str) -> torch.Tensor:
    if blob is None or len(blob) != 4 * numel:
        raise LayoutError(f"{what}: missing or {0 if blob is None else len(blob)} bytes, expected {4 * numel}")
    return torch.from_numpy(np.frombuffer(blob, dtype=np.float32).copy())


class ParameterServer:
    """Applies a job's update log to the shards of one group. Use ``with`` or start()/close().

    Args:
        settings: the server's settings.
        client: a redis-py client to use (closed by close() only if created here).
    """

    def __init__(self, settings: ServerSettings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.keys = JobKeys(settings.job)
        self._own_client = client is None
        self.client = client if client is not None else connect(settings.redis_url)
        self.store = ParameterStore(self.client, settings.job)
        self.status = ServerStatus.INIT
        self.error: BaseException | None = None
        self.applied = 0
        """Updates this server applied (or recorded as rejected) since it started."""
        self.rejected = 0
        """Updates refused at apply time (bad gradient that bypassed push validation)."""
        self._meta: ModelMeta | None = None
        self._state = _GroupState()
        self._state_valid = False
        """False while the in-memory shards may be ahead of Redis (a batch computed, not yet written)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_checkpoint = 0

    # -- lifecycle ------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> None:
        """Wait for the job's model (up to ``timeout_s``), load state, start the apply thread. Idempotent.

        Raises:
            LayoutError: no model within the timeout, or the job's groups differ from the settings.
        """
        if self.status is ServerStatus.RUNNING:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.load()
                break
            except LayoutError as exc:
                if "has no model" not in str(exc) or time.monotonic() >= deadline:
                    raise
                self._stop.wait(0.05)
        self.status = ServerStatus.RUNNING
        self._thread = threading.Thread(target=self._loop, name=f"ps-{self.settings.job}-{self.settings.group}",
                                        daemon=True)
        self._thread.start()
        logger.info("ps job=%s group=%d/%d started at cursor %r", self.settings.job, self.settings.group,
                    self.settings.groups, self._state.cursor)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the apply thread (finishing the update in hand) and release the client. Idempotent."""
        if self.status in (ServerStatus.RUNNING, ServerStatus.FAILED):
            self.status = ServerStatus.CLOSING if self.status is ServerStatus.RUNNING else self.status
        self._stop.set()
        try:
            if self._thread is not None:
                self._thread.join(timeout_s)
        finally:
            if self._own_client:
                self.client.close()
            if self.status is not ServerStatus.FAILED:
                self.status = ServerStatus.CLOSED

    def __enter__(self) -> ParameterServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the apply thread ends (stop or failure); True when it ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        backoff = 0.05
        try:
            while not self._stop.is_set():
                try:
                    self.step()
                    backoff = 0.05
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    logger.warning("ps job=%s group=%d: redis unavailable (%s); retrying in %.2fs",
                                   self.settings.job, self.settings.group, exc, backoff)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
                    try:
                        self.load()
                    except (redis.ConnectionError, redis.TimeoutError):
                        pass
        except BaseException as exc:  # the loop died: record it, never hang silently
            logger.exception("ps job=%s group=%d failed", self.settings.job, self.settings.group)
            self.error = exc
            self.status = ServerStatus.FAILED

    # -- state ----------------------------------------------------------------
    def own_shards(self) -> list[int]:
        """Indices of the shards this server's group owns."""
        meta = self._meta or self.store.meta()
        return [s.index for s in meta.layout.shards if s.index % self.settings.groups == self.settings.group]

    def load(self) -> None:
        """(Re)load the group's cursor, shards, versions and optimizer state from Redis in one MULTI."""
        meta = self.store.meta(refresh=True)
        if meta.groups != self.settings.groups:
            raise LayoutError(f"job {self.settings.job} is split into {meta.groups} shard groups, "
                              f"this server was started with --groups {self.settings.groups}")
        self._meta = meta
        own = self.own_shards()
        k = slots(meta.optimizer)
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.keys.ps_cursor(self.settings.group))
        pipe.hgetall(self.keys.versions)
        pipe.hgetall(self.keys.optimizer_steps)
        pipe.mget([self.keys.shard(i) for i in own] or [self.keys.shard(0)])
        if k:
            pipe.mget([self.keys.optimizer_state(i, s) for i in own for s in range(k)] or [self.keys.shard(0)])
        res = pipe.execute()
        cursor, versions, steps, blobs = res[:4]
        state = _GroupState(cursor=(cursor or b"").decode())
        shards = meta.layout.shards
        for j, i in enumerate(own):
            state.params[i] = _tensor(blobs[j], shards[i].numel, f"shard {i} ({shards[i].name})")
            state.versions[i] = int(versions.get(str(i).encode(), 0))
            state.steps[i] = int(steps.get(str(i).encode(), 0))
            slot_blobs = res[4][j * k:(j + 1) * k] if k else []
            state.opt[i] = [torch.zeros(shards[i].numel) if b is None else
                            _tensor(b, shards[i].numel, f"optimizer state of shard {i}") for b in slot_blobs]
        self._state = state
        self._state_valid = True

    # -- applying --------------------------------------------------------------
    def step(self) -> int:
        """Read up to ``batch`` updates after the cursor (waiting up to ``block_ms``) and apply them
        in one write (see :meth:`apply_entries`).

        Returns the number of updates handled (0 when the compare-and-set was lost).
        """
        if not self._state_valid:
            self.load()  # a failed write left the in-memory shards ahead of Redis
        start = self._state.cursor or "0-0"
        got = self.client.xread({self.keys.update_log: start}, count=self.settings.batch,
                                block=self.settings.block_ms)
        return self.apply_entries(got[0][1] if got else [])

    def apply_entries(self, entries: Sequence[tuple[bytes | str, Mapping[bytes, bytes]]]) -> int:
        """Apply consecutive log entries (the first one right after the cursor) for this group,
        one after another in memory, then write the result once.

        The math is exactly that of applying them one by one (each update is one
        optimizer step of the shards it touches); a refused update is recorded as
        rejected and the others still apply. When the server is stopping, the
        entries not yet computed are left for the next start.

        Returns:
            The number of entries applied (or recorded as rejected); 0 when the
            compare-and-set failed: nothing was written and the state was reloaded.
        """
        meta = self._meta
        assert meta is not None
        st = self._state
        cursor = st.cursor
        outcomes: list[Outcome] = []
        touched: set[int] = set()
        self._state_valid = False  # the shards are changed in place from here on
        for entry_id, fields in entries:
            if self._stop.is_set() and self._thread is not None:
                break
            eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            outcomes.append(self._compute(eid, fields, touched))
        if not outcomes:
            self._state_valid = True  # nothing computed, nothing changed
            return 0
        k = slots(meta.optimizer)
        writes = [ShardWrite(i, st.versions[i], st.steps[i], (st.params[i], *st.opt[i])) for i in sorted(touched)]
        n = len(outcomes)
        result = write_batch(self.client, self.settings.job, group=self.settings.group,
                             groups=self.settings.groups, cursor=cursor, outcomes=outcomes, shards=writes,
                             slots=k, before_exec=lambda: self._fault("kill-before-write", n))
        self._fault("kill-after-write", n)
        if not result.ok:
            logger.warning("ps job=%s group=%d: %d update(s) from %s lost the compare-and-set (%s); reloading",
                           self.settings.job, self.settings.group, n, outcomes[0].update.log_id, result.conflict)
            self.load()
            return 0
        for i in touched:
            st.versions[i] = result.version
        st.cursor = outcomes[-1].update.log_id
        self._state_valid = True
        self.applied += n
        logger.debug("ps job=%s group=%d: %d update(s) %s..%s (%d rejected) -> version %d", self.settings.job,
                     self.settings.group, n, outcomes[0].update.log_id, st.cursor,
                     sum(o.status == "rejected" for o in outcomes), result.version)
        self._maybe_checkpoint(result.version)
        return n

    def _compute(self, eid: str, fields: Mapping[bytes, bytes], touched: set[int]) -> Outcome:
        """Apply one update to the in-memory shards (one optimizer step each); adds them to ``touched``."""
        meta = self._meta
        assert meta is not None
        st = self._state
        try:
            update = load_gradients(self.client, self.settings.job, parse_entry(eid, fields))
            decoded = validate_gradients(update, meta.layout, max_bytes=self.settings.max_update_bytes)
        except ParameterPlaneError as exc:
            return self._reject(eid, fields, exc)
        own = [i for i in sorted(update.gradients) if i % self.settings.groups == self.settings.group]
        grads = [decoded[i] for i in own]
        factor = clip_factor(meta.optimizer, grads)
        for i, g in zip(own, grads, strict=True):
            st.steps[i] += 1
            step(meta.optimizer, st.params[i], g if factor == 1.0 else g * factor, st.opt[i], st.steps[i])
            touched.add(i)
        return Outcome(dataclasses.replace(update, gradients={}), "applied")

    def _reject(self, eid: str, fields: Mapping[bytes, bytes], exc: ParameterPlaneError) -> Outcome:
        logger.error("ps job=%s group=%d: update %s refused, parameters untouched: %s",
                     self.settings.job, self.settings.group, eid, exc)
        self.rejected += 1
        try:
            update = parse_entry(eid, fields)
        except ParameterPlaneError:
            update = Update(member_id="?", generation=0, clock=1, gradients={}, log_id=eid)
        return Outcome(update, "rejected", reason=str(exc))

    def _fault(self, where: str, n: int) -> None:
        """SIGKILL this process at ``where`` when the write of the next ``n`` updates includes update ``fault_at``."""
        s = self.settings
        if s.fault == where and self.applied < s.fault_at <= self.applied + n:
            logger.warning("ps: injected fault %s at update %d: SIGKILL", where, s.fault_at)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_checkpoint(self, version: int) -> None:
        every = self.settings.checkpoint_every
        if not every or self.settings.group != 0 or version // every <= self._last_checkpoint // every:
            return
        from .checkpoint import save_checkpoint

        self._last_checkpoint = version
        path = os.path.join(self.settings.checkpoint_dir, f"{self.settings.job}-v{version:012d}.pt")
        save_checkpoint(self.client, self.settings.job, path)
