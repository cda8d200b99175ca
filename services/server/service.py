"""The parameter-server service (``streamtrain ps``): the shell that applies the update log exactly once.

It does the I/O: reads the log and the gradient blobs, loads and replays its group's state, writes
each batch (:mod:`services.server.apply`), sweeps, and runs the apply thread and the automatic
checkpoint's (:mod:`services.server.checkpointer`), doing what :class:`~services.server.core.ServerCore`
decides; the math is in :mod:`services.server.shards` and :mod:`services.server.rows`. The protocol,
its crash cases and why: ``docs/parameter-plane.md`` ("Apply: exactly once, with deltas, in two
halves" and "The server's decisions").
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import numpy as np
import redis
import torch

from common.keys import JobKeys
from common.outage import REDIS_DOWN, Outage, redis_name, url_name, wait_connected

from ..codecs import Sent
from ..deltas import apply_deltas
from ..errors import LayoutError, NoModelError, ParameterPlaneError
from ..metrics import ServerMetrics
from ..optim import slots
from ..protocol import Status, StreamId, Update, after, own_shards
from ..push.updates import blob_keys, load_gradients, row_blob_keys, validate_gradients
from ..settings import ServerSettings
from ..slots import GroupSlot
from ..store import ModelMeta, ParameterStore, connect
from ..tables import RowGrads
from .apply import Housekeeping, Outcome, Persist, WriteResult, finish_accounting, write_batch
from .checkpointer import Checkpointer
from .core import Checkpoint, Instruction, Policy, Reload, ServerCore, SweepBlobs, SweepTables
from .faults import kill_if_due
from .rows import row_steps, sweep_tables, validate_rows
from .shards import Changes, GroupState, Shard, merge, shard_write, steps, tensor_from

logger = logging.getLogger(__name__)

__all__ = ["ServerStatus", "ParameterServer"]


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


_CHUNK_BYTES = 64 << 20
"""Decoded gradients a batch holds before applying them (dense fp32 gradients of a large model
are applied a few updates at a time; top-k ones a whole batch at a time)."""


class _LogMoved(Exception):
    """The log changed under a load (another server of the group persisted): load again."""


class ParameterServer:
    """Applies a job's update log to the shards of one group. Use ``with`` or start()/close().

    Args:
        settings: the server's settings.
        client: a redis-py client to use (closed by close() only if created here).
    """

    def __init__(self, settings: ServerSettings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.keys = JobKeys(settings.job)
        self.gkeys = self.keys.group(settings.group)
        self._own_client = client is None
        self.client = client if client is not None else wait_connected(  # a Redis Cluster all down: wait
            lambda: connect(settings.redis_url), Outage(url_name(settings.redis_url), settings.outage_limit_s, logger))
        self.store = ParameterStore(self.client, settings.job)
        self.status = ServerStatus.INIT
        self.error: BaseException | None = None
        self.applied = 0
        """Updates this server applied (or recorded as rejected) since it started."""
        self.rejected = 0
        """Updates refused at apply time (bad gradient that bypassed push validation)."""
        self._meta: ModelMeta | None = None
        self._state = GroupState()
        self.core = ServerCore(Policy.of(settings))
        """What to do next: reload or read, persist, compact, housekeep, sweep, checkpoint."""
        self.checkpointer = Checkpointer(self.client, settings.job, settings.checkpoint_dir)
        """The automatic checkpoints (``checkpoint_every``), on a thread of their own."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._table_cursors: dict[str, tuple[str, str]] = {}
        """Table -> where its sweep's scans of the rows and seen hashes go on."""
        self.metrics = ServerMetrics(self)
        """This server's Prometheus metrics (served by ``streamtrain ps --metrics-port``)."""

    # -- lifecycle ------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> None:
        """Wait for the job's model (up to ``timeout_s``) and for Redis (up to the outage limit), load
        state, start the apply thread. Idempotent.

        Raises:
            LayoutError: no model within the timeout, or the job's groups differ from the settings.
            DependencyUnavailable: Redis stayed unreachable for ``outage_limit_s``.
        """
        if self.status is ServerStatus.RUNNING:
            return
        deadline = time.monotonic() + timeout_s
        outage = Outage(redis_name(self.client), self.settings.outage_limit_s, logger)
        while True:  # a server started while Redis is away waits for it (up to the outage limit)
            try:
                self.load()
                break
            except NoModelError:
                if time.monotonic() >= deadline:
                    raise
                self._stop.wait(0.05)
            except REDIS_DOWN as exc:
                self._stop.wait(outage.failed(exc))
        outage.recovered()
        self.status = ServerStatus.RUNNING
        self._thread = threading.Thread(target=self._loop, name=f"ps-{self.settings.job}-{self.settings.group}",
                                        daemon=True)
        self._thread.start()
        logger.info("ps job=%s group=%d/%d started at cursor %r", self.settings.job, self.settings.group,
                    self.settings.groups, self._state.cursor)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the apply thread (finishing the update in hand), persist the optimizer state (so
        the next start replays nothing), wait for the automatic checkpoint running, if any, and
        release the client. Idempotent."""
        running = self.status is ServerStatus.RUNNING
        if self.status in (ServerStatus.RUNNING, ServerStatus.FAILED):
            self.status = ServerStatus.CLOSING if running else self.status
        self._stop.set()
        try:
            if self._thread is not None:
                self._thread.join(timeout_s)
            if running and (self._thread is None or not self._thread.is_alive()) and self._state.unpersisted:
                try:
                    self.persist()
                except (redis.RedisError, ParameterPlaneError) as exc:
                    logger.warning("ps job=%s group=%d: could not persist the optimizer state on stop (%s); "
                                   "the next start replays the log", self.settings.job, self.settings.group, exc)
        finally:
            self.checkpointer.close()
            self.metrics.close()
            if self._own_client:
                self.client.close()
            if self.status is not ServerStatus.FAILED:
                self.status = ServerStatus.CLOSED

    @property
    def version(self) -> int:
        """Newest version of this server's group it loaded or published."""
        return self._state.version

    @property
    def table_names(self) -> list[str]:
        """The model's embedding tables (empty before it is loaded)."""
        return [t.name for t in self._meta.tables] if self._meta is not None else []

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

    def wait_checkpoint(self, timeout_s: float | None = None) -> bool:
        """Block until the automatic checkpoint running (if any) ends; True when none runs."""
        return self.checkpointer.wait(timeout_s)

    def _loop(self) -> None:
        outage = Outage(redis_name(self.client), self.settings.outage_limit_s, logger)
        try:
            while not self._stop.is_set():
                try:
                    self.step()
                    self._reap_checkpoint()
                    self._obey(self.core.tick(time.monotonic()))
                    outage.recovered()
                except REDIS_DOWN as exc:
                    # reload once Redis answers: one restarted on its AOF may be a second behind memory
                    self.core.outage()
                    self._stop.wait(outage.failed(exc))
        except BaseException as exc:  # the loop died (or an outage outlasted the limit): record it
            logger.exception("ps job=%s group=%d failed", self.settings.job, self.settings.group)
            self.error = exc
            self.status = ServerStatus.FAILED

    def _obey(self, instructions: Iterable[Instruction]) -> None:
        """Do what the core said (the instructions it answers at their call sites are done there)."""
        for todo in instructions:
            if isinstance(todo, Reload):
                self.load()
            elif isinstance(todo, SweepBlobs):
                self.sweep()
                self.core.blobs_swept(time.monotonic())
            elif isinstance(todo, SweepTables):
                self.sweep_tables()
                self.core.tables_swept(time.monotonic())
            elif isinstance(todo, Checkpoint) and not self.checkpointer.start(todo.version):
                self.core.checkpoint_ended()  # stopping: none starts (and none after it)

    def _reap_checkpoint(self) -> None:
        """Tell the core when the automatic checkpoint running ended (it may start the next)."""
        if self.checkpointer.reap():
            self._obey(self.core.checkpoint_ended())

    # -- state ----------------------------------------------------------------
    def own_shards(self) -> list[int]:
        """Indices of the shards this server's group owns."""
        meta = self._meta or self.store.meta()
        return own_shards(meta.layout, self.settings.groups, self.settings.group)

    def load(self) -> None:
        """(Re)load the group's shards, cursors and persisted optimizer state from Redis (one
        MULTI in the group's slot), after finishing the accounting of its last apply if a crash cut
        it off, then replay the updates applied since the persist to rebuild the optimizer state."""
        meta = self.store.meta(refresh=True)
        if meta.groups != self.settings.groups:
            raise LayoutError(f"job {self.settings.job} is split into {meta.groups} shard groups, "
                              f"this server was started with --groups {self.settings.groups}")
        self._meta = meta
        if finish_accounting(self.client, self.settings.job, self.settings.group):
            logger.info("ps job=%s group=%d: finished the accounting of its last apply (cut off before)",
                        self.settings.job, self.settings.group)
        for attempt in range(8):
            try:
                self._state = self._read_state(meta)
                break
            except _LogMoved:
                if attempt == 7:
                    raise
        self.core.loaded(self._state.version)

    def _read_state(self, meta: ModelMeta) -> GroupState:
        slot = GroupSlot.of(self.client, self.settings.job, meta, self.settings.group)
        own, k = slot.own, slot.opt_slots
        read = slot.read("cursor", "persisted", "version", "versions", "bases", "optimizer_steps", "table_stats",
                         "shards", "optimizer", "deltas")
        # the log (the job's slot) keeps every update after the lowest persisted cursor of all groups,
        # so every update after this group's persisted cursor is still there
        log = cast("list[tuple[bytes, Mapping[bytes, bytes]]]",
                   self.client.xrange(self.keys.update_log, after(read.persisted)))
        st = GroupState(cursor=read.cursor, persisted=read.persisted, version=read.version,
                         table_steps={t.name: int(read.table_stats.get(f"{t.name}:steps", 0)) for t in meta.tables})
        layout = meta.layout
        st.values = np.zeros((1 + k, sum(layout.shards[i].numel for i in own)), dtype=np.float32)
        offset = 0
        for i in own:
            spec = layout.shards[i]
            cols = slice(offset, offset + spec.numel)
            params = tensor_from(read.shards[i], st.values[0, cols], f"shard {i} ({spec.name})")
            base = read.bases.get(i, 0)
            delta_bytes = apply_deltas(params, read.deltas[i], after=base, upto=st.version,
                                       what=f"delta of shard {i} ({spec.name})")
            opt = [torch.from_numpy(st.values[1 + s, cols]) if b is None
                   else tensor_from(b, st.values[1 + s, cols], f"optimizer state of shard {i}")
                   for s, b in ((s, read.optimizer[(i, s)]) for s in range(k))]
            st.shards[i] = Shard(params, opt, read.optimizer_steps.get(i, 0), read.versions.get(i, 0), base,
                                  delta_bytes, offset)
            offset += spec.numel
        done, persisted_at = StreamId.parse(st.cursor), StreamId.parse(st.persisted)
        replay = [(eid.decode(), fields) for eid, fields in log if persisted_at < StreamId.parse(eid) <= done]
        self._replay(st, replay)
        return st

    def _replay(self, st: GroupState, entries: list[tuple[str, Mapping[bytes, bytes]]]) -> None:
        """Rebuild the optimizer state of the updates applied since the persist, in order, then
        restore the parameters as loaded (Redis already publishes their effect; nothing is written
        or counted)."""
        if not entries:
            return
        loaded = st.values[0].copy()
        for eid, update, error in self._load(entries):
            st.unpersisted.append((eid, self._blob_keys(update)))
            if error is not None:
                if update is not None and not self.client.xrange(self.keys.update_log, eid, eid):
                    raise _LogMoved(f"update {eid} left the log during a load")
                continue  # refused when applied (a bad header, or its blobs were missing then too): no step
            update = cast(Update, update)  # no error: it parsed
            st.unpersisted_bytes += sum(len(b) for b in update.gradients.values())
            try:
                decoded = validate_gradients(update, cast(ModelMeta, self._meta).layout,
                                             max_bytes=self.settings.max_update_bytes)
            except ParameterPlaneError:
                continue  # refused when applied: no step
            self._steps(st, [decoded])
        st.values[0] = loaded
        logger.info("ps job=%s group=%d: replayed %d update(s) after persisted %r to rebuild the optimizer "
                    "state", self.settings.job, self.settings.group, len(entries), st.persisted)

    # -- applying --------------------------------------------------------------
    def step(self) -> int:
        """Read up to ``batch`` updates after the cursor (waiting up to ``block_ms``) and apply them
        in one write (see :meth:`apply_entries`).

        Returns the number of updates handled (0 when the compare-and-set was lost).
        """
        todo = self.core.next_round()
        if isinstance(todo, Reload):  # a failed write or an outage: memory may be ahead of Redis
            self.load()
            return self.step()
        start = self._state.cursor or "0-0"
        got = self.client.xread({self.keys.update_log: start}, count=todo.count, block=self.settings.block_ms)
        return self.apply_entries(cast(list, got)[0][1] if got else [])

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
        st = self._state
        outcomes: list[Outcome] = []
        touched: Changes = {}
        covered: list[tuple[str, list[str]]] = []
        grad_bytes = 0
        chunk: list[dict[int, Sent]] = []  # decoded, not yet applied
        chunk_bytes = 0
        started = time.monotonic()
        row_updates: list[tuple[Update, dict[str, RowGrads]]] = []  # accepted updates with gradient rows
        row_blobs: list[str] = []
        self.core.computing()  # the shards are changed in place from here on
        for eid, update, error in self._load(entries, rows=True):
            if self._stop.is_set() and self._thread is not None:
                break
            outcome, nbytes, decoded, rows = self._validate(eid, update, error)
            outcomes.append(outcome)
            covered.append((eid, self._blob_keys(outcome.update)))
            row_blobs += self._row_blob_keys(outcome.update)
            grad_bytes += nbytes
            if decoded is not None:
                chunk.append(decoded)
                chunk_bytes += sum(d.values.nbytes for d in decoded.values())
                if outcome.update.tables:
                    row_updates.append((outcome.update, rows))
            if chunk_bytes >= _CHUNK_BYTES:
                merge(touched, self._steps(st, chunk))
                chunk, chunk_bytes = [], 0
        merge(touched, self._steps(st, chunk))
        if not outcomes:  # nothing computed, nothing changed
            self._housekeep_idle()
            return 0
        meta = cast(ModelMeta, self._meta)
        tables = row_steps(self.client, self.settings.job, self.settings.group, meta, st.table_steps, st.version,
                           row_updates)
        writes = [shard_write(self.core, st, i, changes) for i, changes in sorted(touched.items())]
        plan = self.core.write_plan(time.monotonic(), updates=len(st.unpersisted) + len(covered),
                                    grad_bytes=st.unpersisted_bytes + grad_bytes, state_bytes=self._state_bytes())
        housekeeping = None if plan.housekeeping is None else Housekeeping(plan.housekeeping.horizon_ms)
        n = len(outcomes)
        result = write_batch(self.client, self.settings.job, group=self.settings.group,
                             groups=self.settings.groups, cursor=st.cursor, outcomes=outcomes, shards=writes,
                             persist=self._persist(covered) if plan.persist else None, housekeeping=housekeeping,
                             version=st.version, tables=tables, row_blobs=row_blobs,
                             feed_entries=self.settings.feed_entries,
                             before_exec=lambda: self._fault("kill-before-write", n))
        self._fault("kill-after-write", n)
        if not result.ok:
            logger.warning("ps job=%s group=%d: %d update(s) from %s lost the compare-and-set (%s); reloading",
                           self.settings.job, self.settings.group, n, outcomes[0].update.log_id, result.conflict)
            self._obey([self.core.lost()])
            return 0
        for w in writes:
            sh = st.shards[w.index]
            sh.version = result.version
            if w.full is not None:
                sh.base, sh.delta_bytes = result.version, 0
            else:
                sh.delta_bytes += len(cast(bytes, w.delta))  # no full bytes: a delta
        st.version = max(st.version, result.version)
        st.cursor = outcomes[-1].update.log_id
        for t in tables:
            st.table_steps[t.table] = t.steps
        if housekeeping is not None:
            self._housekept(result)
        if plan.persist:
            st.persisted, st.unpersisted, st.unpersisted_bytes = st.cursor, [], 0
        else:
            st.unpersisted += covered
            st.unpersisted_bytes += grad_bytes
        checkpoints = self.core.written(result.version)
        self.applied += n
        self.metrics.observe_write(outcomes, time.monotonic() - started, published=bool(writes), tables=tables)
        logger.debug("ps job=%s group=%d: %d update(s) %s..%s (%d rejected) -> version %d", self.settings.job,
                     self.settings.group, n, outcomes[0].update.log_id, st.cursor,
                     sum(o.status is Status.REJECTED for o in outcomes), result.version)
        self._obey(checkpoints)  # started on its own thread: the next round goes on meanwhile
        self._reap_checkpoint()
        return n

    def persist(self) -> bool:
        """Persist the optimizer state now, on its own write (a clean stop does this, so the next
        start replays nothing). False when another server of the group moved the cursor."""
        if not self.core.valid or self._meta is None:
            return False
        st = self._state
        result = write_batch(self.client, self.settings.job, group=self.settings.group,
                             groups=self.settings.groups, cursor=st.cursor, outcomes=[], shards=[],
                             persist=self._persist([]))
        if result.ok:
            st.persisted, st.unpersisted, st.unpersisted_bytes = st.cursor, [], 0
        return result.ok

    def sweep(self) -> int:
        """Delete this group's gradient blobs that no update in the log has named for at least
        ``sweep_grace_s`` (what a pusher that died between writing its blobs and pushing, or before
        deleting a refused push's blobs, leaves behind). Returns the number of blobs deleted.

        A blob of a logged update is never touched: the group deletes those itself once its
        persisted optimizer state includes the update, which is before the log drops it.
        """
        found: dict[str, list[bytes]] = {}
        for key in self.client.scan_iter(match=self.gkeys.blobs_pattern, count=1000):
            token = self.gkeys.blob_token(key)
            if token is not None:
                found.setdefault(token, []).append(key)
        if not found:
            self.core.blobs_found(time.monotonic(), (), ())
            return 0
        logged = set()
        for eid, fields in cast("list[tuple[bytes, dict[bytes, bytes]]]", self.client.xrange(self.keys.update_log)):
            try:
                logged.add(Update.from_fields(eid, fields).token)
            except ParameterPlaneError:
                continue
        due = self.core.blobs_found(time.monotonic(), found, logged).tokens
        deleted = 0
        for token in due:
            deleted += self.client.delete(*found[token])
        if deleted:
            logger.info("ps job=%s group=%d: swept %d orphaned gradient blob(s) of %d abandoned push(es)",
                        self.settings.job, self.settings.group, deleted, len(due))
        return deleted

    def sweep_tables(self) -> tuple[int, int]:
        """One step of each bounded embedding table's sweep (``services.tables.store.sweep_rows``):
        rows not written for the table's expiry time go, and beyond its row cap the least recently
        written are evicted. Returns (rows expired, rows evicted)."""
        if self._meta is None:
            return 0, 0
        return sweep_tables(self.client, self.settings, self._meta.tables, self._table_cursors, self.metrics)

    def _housekept(self, result: WriteResult) -> None:
        """Schedule the next housekeeping after a write that carried one (at once when entries
        past the horizon are left)."""
        self.core.housekept(time.monotonic(), result.more)
        if result.forgotten:
            logger.info("ps job=%s group=%d: dropped the clocks of %d departed member(s)", self.settings.job,
                        self.settings.group, result.forgotten)
        if result.trimmed:
            logger.debug("ps job=%s group=%d: trimmed %d applied_samples entries past the audit horizon",
                         self.settings.job, self.settings.group, result.trimmed)

    def _housekeep_idle(self) -> None:
        """With no update to apply, write the housekeeping on its own when it is due (departed
        members' fields; entries crossing the horizon): nothing moves the cursor or the version."""
        housekeeping = self.core.idle(time.monotonic())
        if housekeeping is None or self._stop.is_set():
            return
        result = write_batch(self.client, self.settings.job, group=self.settings.group,
                             groups=self.settings.groups, cursor=self._state.cursor, outcomes=[], shards=[],
                             housekeeping=Housekeeping(housekeeping.horizon_ms))
        if result.ok:
            self._housekept(result)
        else:  # another server of the group moved the cursor: reload before the next round
            self.core.housekeeping_refused(time.monotonic())

    def _state_bytes(self) -> int:
        """Bytes of the group's optimizer state (0 for an optimizer without state)."""
        k = slots(cast(ModelMeta, self._meta).optimizer)
        return 4 * k * sum(sh.params.numel() for sh in self._state.shards.values())

    def _persist(self, covered: list[tuple[str, list[str]]]) -> Persist:
        st = self._state
        return Persist(state=[(i, j, t) for i, sh in sorted(st.shards.items()) for j, t in enumerate(sh.opt)],
                       steps={i: sh.step for i, sh in st.shards.items()},
                       covered=[*st.unpersisted, *covered])

    def _load(self, entries: Sequence[tuple[bytes | str, Mapping[bytes, bytes]]], *, rows: bool = False
              ) -> list[tuple[str, Update | None, ParameterPlaneError | None]]:
        """(id, update, error) of each entry: the update with its gradient bytes (one MGET for all
        of them; with ``rows`` its gradient rows for this group too), or, when it is refused, the
        error and the update as far as it parsed."""
        parsed: list[tuple[str, Update | None, ParameterPlaneError | None]] = []
        for entry_id, fields in entries:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            try:
                parsed.append((eid, Update.from_fields(eid, fields), None))
            except ParameterPlaneError as exc:
                parsed.append((eid, None, exc))
        loaded = iter(load_gradients(self.client, self.settings.job, [u for _, u, _ in parsed if u is not None],
                                     groups=self.settings.groups, group=self.settings.group, rows=rows))
        out = []
        for eid, update, error in parsed:
            if update is not None:
                got = next(loaded)
                update, error = (update, got) if isinstance(got, ParameterPlaneError) else (got, None)
            out.append((eid, update, error))
        return out

    def _validate(self, eid: str, update: Update | None, error: ParameterPlaneError | None
                  ) -> tuple[Outcome, int, dict[int, Sent] | None, dict[str, RowGrads]]:
        """Decode and check every gradient of one update: its outcome, its gradient bytes, its
        decoded gradients (None when refused) and its gradient rows of this group's rows."""
        if error is not None:
            return self._reject(eid, error, update), 0, None, {}
        update = cast(Update, update)  # no error: it parsed
        nbytes = sum(len(b) for b in update.gradients.values()) + sum(len(b) for b in update.rows.values())
        try:
            decoded = validate_gradients(update, cast(ModelMeta, self._meta).layout,
                                         max_bytes=self.settings.max_update_bytes)
            rows = validate_rows(cast(ModelMeta, self._meta), update, group=self.settings.group,
                                 groups=self.settings.groups, max_bytes=self.settings.max_update_bytes)
        except ParameterPlaneError as exc:
            return (dataclasses.replace(self._reject(eid, exc, update), grad_bytes=update.wire_bytes),
                    nbytes, None, {})
        return (Outcome(dataclasses.replace(update, gradients={}, rows={}), Status.APPLIED,
                        grad_bytes=update.wire_bytes), nbytes, decoded, rows)

    def _steps(self, st: GroupState, updates: Sequence[Mapping[int, Sent]]) -> Changes:
        """One optimizer step per update, in order, on the group's shards (:func:`~services.server.shards.steps`)."""
        return steps(cast(ModelMeta, self._meta).optimizer, st, updates, group=self.settings.group,
                     groups=self.settings.groups)

    def _reject(self, eid: str, exc: ParameterPlaneError, update: Update | None = None) -> Outcome:
        logger.error("ps job=%s group=%d: update %s refused, parameters untouched: %s",
                     self.settings.job, self.settings.group, eid, exc)
        self.rejected += 1
        if update is None:  # not even its header parsed
            update = Update(member_id="?", generation=0, clock=1, gradients={}, log_id=eid)
        return Outcome(dataclasses.replace(update, gradients={}), Status.REJECTED, reason=str(exc))

    def _row_blob_keys(self, update: Update | None) -> list[str]:
        """This group's row-gradient blob key of ``update`` (none when it has none, or its header did
        not parse)."""
        if update is None:
            return []
        return row_blob_keys(self.settings.job, update, group=self.settings.group)

    def _blob_keys(self, update: Update | None) -> list[str]:
        """This group's gradient blob keys of ``update`` (none when its header did not parse)."""
        if update is None:
            return []
        return blob_keys(self.settings.job, update, groups=self.settings.groups, group=self.settings.group)

    def _fault(self, where: str, n: int) -> None:
        """SIGKILL this process at ``where`` when the write of the next ``n`` updates includes update ``fault_at``."""
        kill_if_due(self.settings.fault, self.settings.fault_at, where, self.applied, n)
