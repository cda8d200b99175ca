"""The parameter-server service (``streamtrain ps``): applies the update log exactly once.

Several servers may split the shards: server ``group`` of ``groups`` owns the
shards ``i`` with ``i % groups == group`` (:func:`services.protocol.group_of`). Each group keeps its data in its own
Redis hash slot (:class:`common.keys.GroupKeys`: under Redis Cluster, its own
node): its shards (full bytes plus versioned deltas), its version, its cursor
(the last update it applied), its optimizer state as of its last persist, and
the gradient blobs pushed for its shards. The job's slot holds the update log
and the accounting. A server holds its group's shards and optimizer state in
memory. In each round it:

1. reads up to ``batch`` pending updates (XREAD after its cursor) and its
   group's gradient blobs of them (one MGET in its slot);
2. for each of them in log order, decodes and validates its group's gradients
   (and the header's shard list, which every group checks alike; an update's
   top-k gradients together) and applies one optimizer step to its shards in
   memory: exactly the math of applying the updates one by one. A sparse
   optimizer (``lazyadam``, ``dgc``) touches only the coordinates a top-k
   gradient carries, in every shard of an update at once; a refused update is
   recorded as rejected and the others still apply;
3. writes the group's half with ``lua/apply.lua`` (:mod:`services.server.apply`),
   which succeeds only if its cursor and the shard versions are still what it
   read (compare-and-set), and in the same atomic step bumps the group's
   version once, publishes each changed shard's *delta* at that version,
   rewrites the full bytes of a shard that is due for compaction (its deltas
   since its last full write outgrew ``compact_fraction`` of it, it is
   ``compact_every`` versions old, or the whole shard changed), moves the
   cursor past the batch, and keeps the plan of step 4 in ``unaccounted``;
4. writes the job's half with ``lua/account.lua``: the group's verdict on each
   update (once: HSETNX), and for the group that completes an update (the
   last of the groups to report it): the member's ``applied_clocks``, its
   ``applied_samples`` entry and the ``unapplied`` count, so those happen
   exactly once per update.
5. Every ``persist_every`` updates (or once the gradients applied since hold
   as many bytes as the optimizer state; at every write for optimizers
   without state, and on a clean stop) step 3 also persists the group's
   optimizer state, step counts and *persisted cursor* and deletes the group's
   blobs of the updates it now includes; step 4 reports the persisted cursor,
   and the log drops the updates every group's persisted state includes.

Killed before 3, nothing was written and the batch is redone on restart;
killed between 3 and 4, the restarted server finds the plan in
``unaccounted`` and records it first (:func:`services.server.apply.finish_accounting`;
a plan recorded twice counts once); killed after 4, the cursor has moved past
the batch. A restarted server reads its shards, its persisted optimizer state,
and replays the updates between its persisted cursor and its cursor to rebuild
the optimizer state exactly, without writing or counting them again (the state
depends on the gradients only: weight decay is decoupled, see
:mod:`services.optim`). A CAS failure (another server of the same group won)
reloads from Redis; so does any failure between 2 and 3 (memory is then ahead
of Redis). Every ``sweep_every_s`` the server deletes its group's gradient
blobs that no logged update has named for ``sweep_grace_s`` (a pusher that
died between its blobs and its push).
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
from typing import cast

import numpy as np
import redis
import torch

from common.keys import JobKeys
from common.outage import REDIS_DOWN, Outage, redis_name, url_name, wait_connected

from ..codecs import Sent
from ..deltas import apply_deltas, encode_delta
from ..errors import BadGradientError, LayoutError, ParameterPlaneError
from ..metrics import ServerMetrics
from ..optim import clip_factor, slots, sparse_steps, step
from ..protocol import Status, StreamId, Update, after, group_of, own_shards
from ..push.updates import blob_keys, load_gradients, row_blob_keys, validate_gradients
from ..settings import ServerSettings
from ..store import ModelMeta, ParameterStore, connect
from ..tables import RowGrads, decode_row_grads, group_of_ids
from ..tables.apply import RowBatch, TableWrites, kinds
from ..tables.store import load_rows, sweep_rows
from .apply import Housekeeping, Outcome, Persist, ShardWrite, WriteResult, finish_accounting, write_batch

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


@dataclass
class _Shard:
    """One of the group's shards, in memory."""

    params: torch.Tensor
    """Its values (contiguous float32: a view of row 0 of :attr:`_GroupState.values`)."""
    opt: list[torch.Tensor]
    """Its optimizer state tensors (views of the following rows)."""
    step: int
    """Optimizer steps applied."""
    version: int
    """The model version that last changed it (compare-and-set)."""
    base: int
    """The model version of its full bytes in Redis."""
    delta_bytes: int
    """Bytes of its deltas published after ``base``."""
    offset: int = 0
    """Where its values start in the rows of :attr:`_GroupState.values`."""


@dataclass
class _GroupState:
    """The group's shards and optimizer state (the server's own; Redis has what it published)."""

    cursor: str = ""
    """Last update applied."""
    persisted: str = ""
    """Last update the persisted optimizer state includes."""
    version: int = 0
    """Newest model version seen."""
    shards: dict[int, _Shard] = field(default_factory=dict)
    values: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), dtype=np.float32))
    """The group's shards one after another (float32, ``1 + slots`` rows): row 0 their values, row
    ``1 + s`` their optimizer state slot ``s``. The shards' tensors are views of it, so a sparse
    optimizer gathers and scatters the coordinates an update touches in every shard, values and
    state together, at once (:func:`services.optim.sparse_steps`)."""
    unpersisted: list[tuple[str, list[str]]] = field(default_factory=list)
    """(update id, gradient blob keys) of the updates applied since the last persist."""
    unpersisted_bytes: int = 0
    """Gradient bytes of those updates."""
    table_steps: dict[str, int] = field(default_factory=dict)
    """Embedding table -> its step count (updates that carried its gradient rows), as written
    with the group's rows (``GroupKeys.table_stats``)."""


_CHUNK_BYTES = 64 << 20
"""Decoded gradients a batch holds before applying them (dense fp32 gradients of a large model
are applied a few updates at a time; top-k ones a whole batch at a time)."""


class _LogMoved(Exception):
    """The log changed under a load (another server of the group persisted): load again."""


def _tensor(blob: bytes | None, out: np.ndarray, what: str) -> torch.Tensor:
    """``blob``'s float32 values copied into ``out``, as a tensor viewing ``out``."""
    numel = out.size
    if blob is None or len(blob) != 4 * numel:
        raise LayoutError(f"{what}: missing or {0 if blob is None else len(blob)} bytes, expected {4 * numel}")
    out[:] = np.frombuffer(blob, dtype=np.float32)
    return torch.from_numpy(out)


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
        self._state = _GroupState()
        self._state_valid = False
        """False while the in-memory shards may be ahead of Redis (a batch computed, not yet written)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_checkpoint = 0
        self._housekeeping_at = 0.0
        """time.monotonic() from which the next write carries the housekeeping (the first does)."""
        self._sweep_at = 0.0
        """time.monotonic() of the next sweep for orphaned gradient blobs."""
        self._orphans: dict[str, float] = {}
        """Token -> when a sweep first found its blobs with no logged update naming it."""
        self._table_sweep_at = 0.0
        """time.monotonic() of the next step of the tables' sweeps."""
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
            except LayoutError as exc:
                if "has no model" not in str(exc) or time.monotonic() >= deadline:
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
        the next start replays nothing) and release the client. Idempotent."""
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

    def _loop(self) -> None:
        outage = Outage(redis_name(self.client), self.settings.outage_limit_s, logger)
        try:
            while not self._stop.is_set():
                try:
                    self.step()
                    if time.monotonic() >= self._sweep_at:
                        self.sweep()
                        self._sweep_at = time.monotonic() + self.settings.sweep_every_s
                    if time.monotonic() >= self._table_sweep_at:
                        self.sweep_tables()
                        self._table_sweep_at = time.monotonic() + self.settings.table_sweep_every_s
                    outage.recovered()
                except REDIS_DOWN as exc:
                    # reload once Redis answers: one restarted on its AOF may be a second behind memory
                    self._state_valid = False
                    self._stop.wait(outage.failed(exc))
        except BaseException as exc:  # the loop died (or an outage outlasted the limit): record it
            logger.exception("ps job=%s group=%d failed", self.settings.job, self.settings.group)
            self.error = exc
            self.status = ServerStatus.FAILED

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
        self._state_valid = True

    def _read_state(self, meta: ModelMeta) -> _GroupState:
        own = self.own_shards()
        k = slots(meta.optimizer)
        gk = self.gkeys
        pipe = self.client.pipeline(transaction=True)
        pipe.get(gk.cursor)
        pipe.get(gk.persisted)
        pipe.get(gk.version)
        pipe.hgetall(gk.versions)
        pipe.hgetall(gk.bases)
        pipe.hgetall(gk.optimizer_steps)
        pipe.hgetall(gk.table_stats)
        pipe.mget([gk.shard(i) for i in own] or [gk.version])
        pipe.mget([gk.optimizer_state(i, s) for i in own for s in range(k)] or [gk.version])
        for i in own:
            pipe.xrange(gk.deltas(i))
        cursor, persisted, version, versions, bases, steps, stats, blobs, opt_blobs, *streams = pipe.execute()
        # the log (the job's slot) keeps every update after the lowest persisted cursor of all groups,
        # so every update after this group's persisted cursor is still there
        log = cast("list[tuple[bytes, Mapping[bytes, bytes]]]",
                   self.client.xrange(self.keys.update_log, after(persisted or "")))
        st = _GroupState(cursor=(cursor or b"").decode(), persisted=(persisted or b"").decode(),
                         version=int(version or 0),
                         table_steps={t.name: int(stats.get(f"{t.name}:steps".encode(), 0)) for t in meta.tables})
        layout = meta.layout
        st.values = np.zeros((1 + k, sum(layout.shards[i].numel for i in own)), dtype=np.float32)
        offset = 0
        for j, i in enumerate(own):
            spec = layout.shards[i]
            cols = slice(offset, offset + spec.numel)
            params = _tensor(blobs[j], st.values[0, cols], f"shard {i} ({spec.name})")
            base = int(bases.get(str(i).encode(), 0))
            delta_bytes = apply_deltas(params, streams[j], after=base, upto=st.version,
                                       what=f"delta of shard {i} ({spec.name})")
            opt = [torch.from_numpy(st.values[1 + s, cols]) if b is None
                   else _tensor(b, st.values[1 + s, cols], f"optimizer state of shard {i}")
                   for s, b in enumerate(opt_blobs[j * k:(j + 1) * k])]
            st.shards[i] = _Shard(params, opt, int(steps.get(str(i).encode(), 0)),
                                  int(versions.get(str(i).encode(), 0)), base, delta_bytes, offset)
            offset += spec.numel
        done, persisted_at = StreamId.parse(st.cursor), StreamId.parse(st.persisted)
        replay = [(eid.decode(), fields) for eid, fields in log if persisted_at < StreamId.parse(eid) <= done]
        self._replay(st, replay)
        return st

    def _replay(self, st: _GroupState, entries: list[tuple[str, Mapping[bytes, bytes]]]) -> None:
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
        if not self._state_valid:
            self.load()  # a failed write left the in-memory shards ahead of Redis
        start = self._state.cursor or "0-0"
        got = self.client.xread({self.keys.update_log: start}, count=self.settings.batch,
                                block=self.settings.block_ms)
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
        touched: dict[int, list[np.ndarray | None]] = {}
        covered: list[tuple[str, list[str]]] = []
        grad_bytes = 0
        chunk: list[dict[int, Sent]] = []  # decoded, not yet applied
        chunk_bytes = 0
        started = time.monotonic()
        row_updates: list[tuple[Update, dict[str, RowGrads]]] = []  # accepted updates with gradient rows
        row_blobs: list[str] = []
        self._state_valid = False  # the shards are changed in place from here on
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
                self._merge(touched, self._steps(st, chunk))
                chunk, chunk_bytes = [], 0
        self._merge(touched, self._steps(st, chunk))
        if not outcomes:
            self._state_valid = True  # nothing computed, nothing changed
            self._housekeep_idle()
            return 0
        tables = self._row_steps(st, row_updates)
        writes = [self._shard_write(i, changes) for i, changes in sorted(touched.items())]
        persist = self._persist_due(len(covered), grad_bytes)
        housekeeping = self._housekeeping_due()
        n = len(outcomes)
        result = write_batch(self.client, self.settings.job, group=self.settings.group,
                             groups=self.settings.groups, cursor=st.cursor, outcomes=outcomes, shards=writes,
                             persist=self._persist(covered) if persist else None, housekeeping=housekeeping,
                             version=st.version, tables=tables, row_blobs=row_blobs,
                             feed_entries=self.settings.feed_entries,
                             before_exec=lambda: self._fault("kill-before-write", n))
        self._fault("kill-after-write", n)
        if not result.ok:
            logger.warning("ps job=%s group=%d: %d update(s) from %s lost the compare-and-set (%s); reloading",
                           self.settings.job, self.settings.group, n, outcomes[0].update.log_id, result.conflict)
            self.load()
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
        if persist:
            st.persisted, st.unpersisted, st.unpersisted_bytes = st.cursor, [], 0
        else:
            st.unpersisted += covered
            st.unpersisted_bytes += grad_bytes
        self._state_valid = True
        self.applied += n
        self.metrics.observe_write(outcomes, time.monotonic() - started, published=bool(writes), tables=tables)
        logger.debug("ps job=%s group=%d: %d update(s) %s..%s (%d rejected) -> version %d", self.settings.job,
                     self.settings.group, n, outcomes[0].update.log_id, st.cursor,
                     sum(o.status is Status.REJECTED for o in outcomes), result.version)
        self._maybe_checkpoint(result.version)
        return n

    def persist(self) -> bool:
        """Persist the optimizer state now, on its own write (a clean stop does this, so the next
        start replays nothing). False when another server of the group moved the cursor."""
        if not self._state_valid or self._meta is None:
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
        for key in self.client.scan_iter(match=self.gkeys.key("grad", "*"), count=1000):
            token = key.decode().rsplit(":", 2)[-2]
            found.setdefault(token, []).append(key)
        if not found:
            self._orphans.clear()
            return 0
        logged = set()
        for eid, fields in cast("list[tuple[bytes, dict[bytes, bytes]]]", self.client.xrange(self.keys.update_log)):
            try:
                logged.add(Update.from_fields(eid, fields).token)
            except ParameterPlaneError:
                continue
        now = time.monotonic()
        self._orphans = {t: self._orphans.get(t, now) for t in found if t not in logged}
        due = [t for t, first in self._orphans.items() if now - first >= self.settings.sweep_grace_s]
        deleted = 0
        for token in due:
            deleted += self.client.delete(*found[token])
            del self._orphans[token]
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
        expired = evicted = 0
        now_ms = int(time.time() * 1000)
        for spec in self._meta.tables:
            if not spec.expire_after_s and not spec.max_rows:
                continue
            cursor, seen_cursor = self._table_cursors.get(spec.name, ("0", "0"))
            done = sweep_rows(self.client, self.settings.job, self.settings.group, spec, self.settings.groups,
                              now_ms=now_ms, cursor=cursor, seen_cursor=seen_cursor,
                              count=self.settings.table_sweep_count, feed_entries=self.settings.feed_entries)
            self._table_cursors[spec.name] = (done.cursor, done.seen_cursor)
            self.metrics.table_rows("expired", spec.name, done.expired)
            self.metrics.table_rows("evicted", spec.name, done.evicted)
            expired, evicted = expired + done.expired, evicted + done.evicted
            if done.expired or done.evicted:
                logger.debug("ps job=%s group=%d: table %s: %d row(s) expired, %d evicted, %d left", self.settings.job,
                             self.settings.group, spec.name, done.expired, done.evicted, done.rows)
        return expired, evicted

    def _housekeeping_due(self) -> Housekeeping | None:
        """The housekeeping the next write carries: once every ``housekeeping_s`` (so ordinary
        writes pay nothing), None in between."""
        if time.monotonic() < self._housekeeping_at:
            return None
        return Housekeeping(horizon_ms=round(self.settings.audit_horizon_s * 1000))

    def _housekept(self, result: WriteResult) -> None:
        """Schedule the next housekeeping after a write that carried one (at once when entries
        past the horizon are left)."""
        self._housekeeping_at = time.monotonic() + (0.0 if result.more else self.settings.housekeeping_s)
        if result.forgotten:
            logger.info("ps job=%s group=%d: dropped the clocks of %d departed member(s)", self.settings.job,
                        self.settings.group, result.forgotten)
        if result.trimmed:
            logger.debug("ps job=%s group=%d: trimmed %d applied_samples entries past the audit horizon",
                         self.settings.job, self.settings.group, result.trimmed)

    def _housekeep_idle(self) -> None:
        """With no update to apply, write the housekeeping on its own when it is due (departed
        members' fields; entries crossing the horizon): nothing moves the cursor or the version."""
        housekeeping = self._housekeeping_due()
        if housekeeping is None or self._stop.is_set():
            return
        result = write_batch(self.client, self.settings.job, group=self.settings.group,
                             groups=self.settings.groups, cursor=self._state.cursor, outcomes=[], shards=[],
                             housekeeping=housekeeping)
        if result.ok:
            self._housekept(result)
        else:  # another server of the group moved the cursor: reload before the next round
            self._housekeeping_at = time.monotonic() + self.settings.housekeeping_s
            self._state_valid = False

    def _persist_due(self, updates: int, grad_bytes: int) -> bool:
        st = self._state
        k = slots(cast(ModelMeta, self._meta).optimizer)
        if k == 0:
            return True  # only step counts to write
        state_bytes = 4 * k * sum(sh.params.numel() for sh in st.shards.values())
        return (len(st.unpersisted) + updates >= self.settings.persist_every
                or st.unpersisted_bytes + grad_bytes >= state_bytes)

    def _persist(self, covered: list[tuple[str, list[str]]]) -> Persist:
        st = self._state
        return Persist(state=[(i, j, t) for i, sh in sorted(st.shards.items()) for j, t in enumerate(sh.opt)],
                       steps={i: sh.step for i, sh in st.shards.items()},
                       covered=[*st.unpersisted, *covered])

    def _shard_write(self, i: int, changes: list[np.ndarray | None]) -> ShardWrite:
        """What to publish for shard ``i`` after a batch changed it: a delta, and the full bytes
        when it is due for compaction (or changed everywhere)."""
        sh = self._state.shards[i]
        if any(c is None for c in changes):
            return ShardWrite(i, sh.version, delta=None, full=sh.params)
        if len(changes) == 1:
            idx = changes[0]
        else:  # the union of sorted index sets: a mask is ~10x cheaper than np.unique here
            mask = np.zeros(sh.params.numel(), dtype=bool)
            for c in changes:
                mask[c] = True
            idx = np.flatnonzero(mask)
        delta = encode_delta(cast(np.ndarray, idx), sh.params.numpy()[idx])
        s = self.settings
        compact = (sh.delta_bytes + len(delta) > s.compact_fraction * 4 * sh.params.numel()
                   or self._state.version + 1 - sh.base >= s.compact_every)
        return ShardWrite(i, sh.version, delta=delta, full=sh.params if compact else None)

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
            rows = self._validate_rows(update)
        except ParameterPlaneError as exc:
            return (dataclasses.replace(self._reject(eid, exc, update), grad_bytes=update.wire_bytes),
                    nbytes, None, {})
        return (Outcome(dataclasses.replace(update, gradients={}, rows={}), Status.APPLIED,
                        grad_bytes=update.wire_bytes), nbytes, decoded, rows)

    def _validate_rows(self, update: Update) -> dict[str, RowGrads]:
        """The gradient rows of this group's rows in ``update``, checked: tables the model has (the
        header's list, which every group checks alike), IDs this group owns.

        Raises:
            BadGradientError, PayloadError: naming what is wrong.
        """
        tables = {t.name: t for t in cast(ModelMeta, self._meta).tables}
        unknown = [t for t in update.tables if t not in tables]
        if unknown:
            raise BadGradientError(f"update from {update.member_id}: gradient rows of table(s) {unknown}, which "
                                   f"the model does not have (tables: {sorted(tables)})")
        blob = update.rows.get(self.settings.group)
        if blob is None:
            return {}
        parts = decode_row_grads(blob, tables, max_bytes=self.settings.max_update_bytes,
                                 what=f"gradient rows of update {update.log_id} for group {self.settings.group}")
        out = {}
        for p in parts:
            if p.table not in update.tables:
                raise BadGradientError(f"update {update.log_id}: gradient rows of table {p.table!r}, which its "
                                       f"header does not name")
            foreign = group_of_ids(p.ids, self.settings.groups) != self.settings.group
            if foreign.any():
                raise BadGradientError(f"update {update.log_id}: {int(foreign.sum())} gradient row(s) of table "
                                       f"{p.table!r} sent to group {self.settings.group}, which does not own them")
            out[p.table] = p
        return out

    def _row_steps(self, st: _GroupState, updates: Sequence[tuple[Update, Mapping[str, RowGrads]]]
                   ) -> list[TableWrites]:
        """Apply the gradient rows of ``updates`` (accepted, in log order) to this group's rows: load
        every row they touch in one round trip, step each update in turn (admission included), and
        return what to write (``services.tables.apply``: tables of one kind in one batch)."""
        if not updates:
            return []
        specs = {t.name: t for t in cast(ModelMeta, self._meta).tables}
        named = sorted({t for u, _ in updates for t in u.tables})
        wanted = {t: np.unique(np.concatenate([rows[t].ids for _, rows in updates if t in rows]
                                              or [np.empty(0, np.int64)])) for t in named}
        loaded = load_rows(self.client, self.settings.job, self.settings.group, specs, wanted)
        now_ms = int(time.time() * 1000)
        writes = []
        for kind in kinds([specs[t] for t in named]):
            batch = RowBatch.load(kind, loaded, st.table_steps)
            batch.apply([(u.tables, rows) for u, rows in updates], now_ms)
            writes += batch.writes(st.version + 1)
        return writes

    def _steps(self, st: _GroupState, updates: Sequence[Mapping[int, Sent]]) -> dict[int, list[np.ndarray | None]]:
        """One optimizer step per update, in order, on the group's shards. A sparse optimizer steps
        all the shards an update touches at once (:func:`services.optim.sparse_steps`); a dense one
        goes shard by shard, so a shard's values and state stay in the CPU cache across the
        updates (the same math as update by update: a shard's steps keep their order, and each
        update's clipping factor is its own). Returns shard -> the indices each step changed
        (None: all of them)."""
        cfg = cast(ModelMeta, self._meta).optimizer
        g, groups = self.settings.group, self.settings.groups
        mine = [{i: d for i, d in decoded.items() if group_of(i, groups) == g} for decoded in updates]
        factors = [clip_factor(cfg, list(m.values())) for m in mine]
        changed: dict[int, list[np.ndarray | None]] = {}
        if cfg.sparse:
            for m, factor in zip(mine, factors, strict=True):
                parts = []
                for i in sorted(m):
                    sh = st.shards[i]
                    sh.step += 1
                    parts.append((sh.offset, sh.params.numel(), m[i], sh.step))
                    changed.setdefault(i, []).append(m[i].indices)
                sparse_steps(cfg, st.values, parts, factor)
            return changed
        for i in sorted({i for m in mine for i in m}):
            sh = st.shards[i]
            for m, factor in zip(mine, factors, strict=True):
                if i in m:
                    sh.step += 1
                    changed.setdefault(i, []).append(step(cfg, sh.params, m[i], sh.opt, sh.step, factor))
        return changed

    @staticmethod
    def _merge(touched: dict[int, list[np.ndarray | None]], changed: Mapping[int, list[np.ndarray | None]]) -> None:
        for i, changes in changed.items():
            touched.setdefault(i, []).extend(changes)

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
        s = self.settings
        if s.fault == where and self.applied < s.fault_at <= self.applied + n:
            logger.warning("ps: injected fault %s at update %d: SIGKILL", where, s.fault_at)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_checkpoint(self, version: int) -> None:
        every = self.settings.checkpoint_every
        if not every or self.settings.group != 0 or version // every <= self._last_checkpoint // every:
            return
        from ..snapshot.checkpoint import CheckpointError, save_checkpoint

        self._last_checkpoint = version
        path = os.path.join(self.settings.checkpoint_dir, f"{self.settings.job}-v{version:012d}.pt")
        try:
            save_checkpoint(self.client, self.settings.job, path)
        except (CheckpointError, OSError, *REDIS_DOWN) as exc:  # a missed checkpoint must not stop applying
            logger.error("ps job=%s: automatic checkpoint at group-0 version %d failed: %s", self.settings.job,
                         version, exc)
