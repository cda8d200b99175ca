"""The trainer service: consume assigned partitions, compute gradients, push them.

This module is the shell: it does the I/O and nothing else. What a trainer
knows and the rules that change it (clocks, the push in flight, what the
replica covers, assignments, resynchronising) live in :mod:`trainers.state`;
what it reports (heartbeat stats, the loss average, freshness, phase timings)
in :mod:`trainers.progress`; the arithmetic of a step in :mod:`trainers.step`.

The loop in :meth:`Trainer._train` reads top to bottom as what a trainer
does each step::

    move   = state.follow()                       (train, idle, reassign or leave)
    batch  = next batch from my partitions        (prefetched, decoded off-thread)
    wait   until the consistency model allows this clock
    params = pull the shards that changed         (skipped when the replica meets the bound)
    grads  = forward + backward on the batch
    push   grads + the batch's offsets, atomically (overlaps the next step)

With local steps (``local_steps`` H > 1, :mod:`trainers.local`) the wait and the pull open a window,
each step is a step of the inner optimizer on the replica, and the push comes after the window's H
steps: the pseudo-gradient with the offsets of all H batches, at one clock. A window closes early
when no batch comes within a poll (the stream ran dry) and before the trainer leaves; it is dropped
(its records left to the committed offsets) on a reassignment, a resync or an outage.

How a push ended goes to the state, which says what to do (adopt its
error-feedback state, resynchronise) and keeps an unsettled push until the
outage is over. A refused push or a clock-bound timeout resynchronises; a Redis
outage is ridden out; both run at the top of the next turn of the loop, so a
fault during a recovery is recovered from the same way.

Around it: registration and heartbeats with the coordinator (a background
task), the presence channel, evaluation on held-out data, progressive
validation of a binary model (each step's logits, computed before its gradient
is applied anywhere, collected into windows on the step's thread and scored on
a thread of their own: :mod:`trainers.progressive`), and a drain (on
SIGTERM, or when the coordinator drains this member) that settles the push in
flight, mirrors the committed offsets to Kafka and leaves the membership.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import importlib
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from common.outage import REDIS_DOWN, Outage, redis_name, url_name, wait_connected
from common.tasks import cancel_and_wait
from coordinator import CoordinatorClient, MemberGoneError, UnknownMemberError
from coordinator.errors import CoordinatorError
from datastream import Batch, ShardConsumer, load_source
from datastream.jagged import Jagged
from services import (
    Feedback,
    FencedError,
    OffsetConflictError,
    ParameterStore,
    Pusher,
    Snapshot,
    committed_offsets,
    connect,
    read_job_clocks,
    starting_clock,
    wait_for_clock,
    was_committed,
)
from services.consistency import MAX_POLL_S, ClockWait, Consistency, StalenessTimeout
from services.tables import RowGrads

from .device import plan_device
from .evaluate import EvalResult, evaluate
from .local import LocalSteps, check_model, inner_optimizer, server_optimizer
from .metrics import TrainerMetrics, TrainerReport
from .models import build_model
from .prefetch import PullAhead, overlaps
from .progress import PHASE_LOG, Progress
from .progressive import ClosedWindow, ProgressiveWindow, WindowScore, score_window
from .rowcache import RowCache, TableBound
from .settings import TrainerSettings
from .state import Adopt, Instruction, Move, Outcome, Resync, TrainerState, low_covered, needs_pull
from .step import Replica, StepResult
from .tables import RowFetcher, plan_lookups, table_inputs, table_required, wait_consistency

logger = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_S = 0.1
"""Pause of a turn with nothing to consume."""
POLL_S = 0.2
"""Longest wait for a batch before the loop turns again."""
LOCAL_STEPS_POLL_S = 0.002
"""Longest pause between two reads of the clocks while a window of local steps waits for its own
previous window to be applied (once a window: a read every 2 ms costs the servers nothing that
counts, where the default backoff to 50 ms added up to 50 ms to every window)."""
MAX_UNSCORED = 64
"""Progressive-validation windows waiting for the scoring thread at most; a window closed beyond
that is dropped (counted in the log): windows far smaller than the scoring thread keeps up with."""


async def next_batch(consumer: ShardConsumer, timeout_s: float = POLL_S) -> Batch | None:
    """The consumer's next batch: one decoded already at once, else the first within ``timeout_s``
    (waited for on a worker thread); None when none came.

    A batch of dead-lettered records only has no rows (``len`` 0) but covers their offsets: it is a
    batch like any other, pushed as an offsets-only update (dropping it would leave a gap before
    the next push's offsets, which the parameter plane refuses)."""
    batch = consumer.poll(0)
    if batch is None:
        batch = await asyncio.to_thread(consumer.poll, timeout_s)
    return batch


class PushRefused(Exception):
    """The parameter plane refused a push (fenced, or offsets out of line): resynchronise."""


@dataclass(frozen=True)
class _Computed:
    """What one hand-off to the worker thread did: the wait, the pull if any, the step."""

    wait: ClockWait | None
    """None for a local step inside a window (the window's first step waited)."""
    snapshot: Snapshot | None
    """The new snapshot when it pulled, else None."""
    result: StepResult | None
    """None for an empty batch (a clock tick)."""
    seconds: dict[str, float]
    """Seconds of each phase: wait, pull, compute."""
    windows: list[ClosedWindow] = field(default_factory=list)
    """Progressive-validation windows the step's logits closed (to be scored)."""
    covers: int | None = None
    """With :attr:`snapshot`: the clock it covers (``TrainerState.covers``)."""


@dataclass(frozen=True)
class PushReport:
    """How one push ended, as the push thread saw it (:func:`send_push`)."""

    outcome: Outcome
    """Committed, refused, or cut off by a Redis outage."""
    feedback: Feedback
    """The error-feedback state it leaves behind (the state says whether to adopt it)."""
    produced_ts_ms: int
    """Oldest produce timestamp of the batch it carried (``Batch.produced_ts_ms``)."""
    error: Exception | None = None
    """The refusal or the Redis error (None when committed)."""
    wire_bytes: int = 0
    """Encoded bytes sent (when committed)."""
    raw_bytes: int = 0
    """The same gradients as float32 (when committed)."""


def send_push(pusher: Pusher, grads: Mapping[str, torch.Tensor] | None, batch: Batch, *, clock: int,
              generation: int, rows: Sequence[RowGrads] = ()) -> PushReport:
    """Encode ``grads`` and push them atomically with ``batch``'s offsets; say how it ended. Runs on
    the push thread, and changes nothing: the state decides what the outcome means.

    Which errors mean what is decided here, once: a refusal (fenced, offsets or clock out of line)
    is :data:`Outcome.REFUSED`; every ``common.outage.REDIS_DOWN`` error (a Redis Cluster's
    CLUSTERDOWN too) is :data:`Outcome.UNREACHABLE`, since the push may have gone through.

    Raises:
        BadGradientError: the model produced a gradient the parameter plane cannot take (nothing
            was pushed); and what else ``Pusher.send`` raises that no retry cures.
    """
    prepared = pusher.prepare(grads, generation=generation, clock=clock, offsets=batch.offsets,
                              samples=batch.samples, batch_size=len(batch), produced_ts_ms=batch.produced_ts_ms,
                              rows=rows)
    feedback, ts = prepared.feedback, batch.produced_ts_ms
    try:
        sent = pusher.send(prepared)
    except (FencedError, OffsetConflictError) as exc:
        return PushReport(Outcome.REFUSED, feedback, ts, error=exc)
    except REDIS_DOWN as exc:
        return PushReport(Outcome.UNREACHABLE, feedback, ts, error=exc)
    return PushReport(Outcome.COMMITTED, feedback, ts, wire_bytes=sent.wire_bytes, raw_bytes=sent.raw_bytes)


class Trainer:
    """One trainer: ``await Trainer(settings).run()``; ``stop()`` asks it to drain and leave."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.plan = plan_device(settings.device, settings.threads, settings.mixed_precision,
                                flush_denormal=settings.flush_denormal)
        self.replica = Replica(build_model(settings.model, seed=settings.seed), self.plan,
                               row_dtype=getattr(torch, settings.row_dtype),
                               keep_logits=settings.progressive_every > 0)
        self.progressive = (ProgressiveWindow(settings.progressive_every) if self.replica.keep_logits else None)
        """Progressive validation of a binary model: its training logits scored in windows
        (:mod:`trainers.progressive`); None for other models or when off."""
        self._score_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="progressive")
        self._scoring: collections.deque[concurrent.futures.Future[WindowScore]] = collections.deque()
        """Closed windows being scored, oldest first (scikit-learn's checks take milliseconds: off the step)."""
        self._unscored_dropped = 0
        if self.progressive is not None:  # scikit-learn takes a second or more to import: not with the first window
            self._score_pool.submit(importlib.import_module, "sklearn.metrics")
        self.redis = wait_connected(  # a Redis Cluster all down: wait for it, as for a server at its first command
            lambda: connect(settings.redis_url), Outage(url_name(settings.redis_url), settings.outage_limit_s, logger))
        self.store = ParameterStore(self.redis, settings.job)
        # A reply slower than a second is as good as none: the lease is a few seconds.
        self.coordinator = CoordinatorClient(settings.coordinator_url, settings.job_token, timeout_s=1.0)
        self.consumer: ShardConsumer | None = None
        self.pusher: Pusher | None = None
        self.state = TrainerState()
        """Clocks, the push in flight, replica coverage and assignments (:mod:`trainers.state`)."""
        self.progress = Progress(started=time.monotonic())
        """Steps, loss, freshness and phase timings for heartbeats and logs (:mod:`trainers.progress`)."""
        self.snapshot: Snapshot | None = None
        """The version the replica holds (the base of the next delta pull)."""
        self.last_eval: EvalResult | None = None
        self.heartbeat_interval_s = 0.5
        self._redis_outage = Outage(redis_name(self.redis), settings.outage_limit_s, logger)
        self._stop = asyncio.Event()
        self._push_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="push")
        self._sending: asyncio.Future[PushReport] | None = None
        """The push thread's future of the push in flight (which push that is, the state records)."""
        self._eval_data: tuple[torch.Tensor, torch.Tensor] | None = None
        self._eval_ids: dict[str, Jagged] = {}
        """The held-out records' categorical features (models with embedding tables)."""
        spec = self.replica.spec
        self.tables = {t.name: t for t in spec.tables}
        """The model's embedding tables (their rows live in the parameter plane only)."""
        self.row_cache = RowCache(self.tables, settings.row_cache_rows)
        """The rows this trainer keeps between steps (at most ``row_cache_rows`` per table)."""
        self.rows: RowFetcher | None = None
        """Fetches a batch's rows (set once the model's meta is known)."""
        self.ahead: PullAhead | None = None
        """The pull for the next step while this one computes (``--overlap-pulls``; made on the first
        step that can use one, :mod:`trainers.prefetch`)."""
        self.local: LocalSteps | None = None
        """The window of local steps with ``local_steps`` > 1 (set on joining); None: a push per step."""
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._heartbeat_lock = asyncio.Lock()
        self._background: list[asyncio.Task[None]] = []
        self.metrics = TrainerMetrics(self.report)
        """This trainer's Prometheus metrics (served by ``streamtrain trainer --metrics-port``)."""

    # -- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the trainer to finish the batch in hand, commit it and leave."""
        self._stop.set()

    async def run(self) -> int:
        """Train until stopped, drained by the coordinator, or ``max_steps``; returns an exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        try:
            if self.settings.eval_source:
                self._eval_data = await asyncio.to_thread(self._load_eval_data)
            await self._join()
            await self._train()
            try:
                await self._push_window()  # the local steps in hand, if any
                await self._settle_push()
            except PushRefused as exc:
                logger.info("last push not committed (%s); its records go to the next owner", exc)
            await self._mirror_offsets_to_kafka()
            return 0
        finally:
            await cancel_and_wait(self._heartbeat_task)
            await self._leave()  # before the presence channel closes: a closed channel reads as a death
            for task in self._background:
                await cancel_and_wait(task)
            await self._close()

    def report(self) -> TrainerReport:
        """What this trainer's metrics show, read when Prometheus scrapes."""
        return TrainerReport(
            steps=self.progress.steps, clock=self.state.clock, staleness=self.state.staleness,
            loss=self.progress.loss_ema, version=self.snapshot.version if self.snapshot is not None else None,
            last_eval=self.last_eval, consumer=self.consumer.stats() if self.consumer is not None else None,
            row_cache=self.row_cache.stats() if self.tables else None,
            row_pull_bytes=self.rows.pulled_bytes if self.rows is not None else 0,
            progressive=self.progress.last_window)

    async def _close(self) -> None:
        if self.consumer is not None:
            await asyncio.to_thread(self.consumer.close)
        self._push_pool.shutdown(wait=True)
        if self.ahead is not None:
            self.ahead.close()
            logger.info("%d of %d pulls ahead were taken by the next step", self.ahead.taken, self.ahead.started)
        self._score_pool.shutdown(wait=False, cancel_futures=True)
        await self.coordinator.close()
        self.redis.close()

    # -- membership -------------------------------------------------------------------------------

    def _capabilities(self) -> dict[str, object]:
        caps: dict[str, object] = {"device": self.plan.kind, "threads": self.plan.threads,
                                   "hostname": socket.gethostname()[:64]}
        if self.plan.kind == "cuda":
            props = torch.cuda.get_device_properties(self.plan.device)
            caps.update(gpu_name=props.name, gpu_memory_mb=props.total_memory >> 20)
        return caps

    async def _join(self) -> None:
        """Register (retrying while the coordinator is unreachable), store the model if first."""
        while True:
            try:
                reg = await self.coordinator.register(self._capabilities())
                break
            except CoordinatorError as exc:
                if not exc.retriable or self._stop.is_set():
                    raise
                logger.warning("coordinator not reachable yet (%s); retrying", exc)
                await asyncio.sleep(0.5)
        self.heartbeat_interval_s = reg.heartbeat_interval_ms / 1000
        if self._heartbeat_task is None:  # the lease runs from now on: renew it from now on
            self._heartbeat_task = asyncio.create_task(self._heartbeats(), name="heartbeats")
            self._background.append(asyncio.create_task(self._presence(), name="presence"))
            if self.settings.commit_to_kafka:
                self._background.append(asyncio.create_task(self._kafka_mirror(), name="kafka-mirror"))
        config = reg.assignment.config
        check_model(config, self.replica.spec)
        meta = await self._with_redis(
            self.store.init_model, self.replica.initial_tensors(),
            optimizer=server_optimizer(config), tables=self.replica.spec.tables)
        if config.local_steps > 1 and self.local is None:  # its inner state lives on through a new member id
            self.local = LocalSteps(self.replica.params, inner_optimizer(config, self.replica.params.values()),
                                    config.local_steps)
        if self.tables:
            self.rows = RowFetcher(self.redis, self.settings.job, self.tables, meta.groups, self.row_cache)
        options = {"density": self.settings.topk_density} if "topk" in config.codec else {}
        pusher = await self._with_redis(Pusher, self.redis, self.settings.job, reg.member_id, codec=config.codec,
                                        codec_options=options, momentum=meta.optimizer.trainer_momentum,
                                        row_dtype=self.settings.row_dtype, dense_below=self.settings.dense_below,
                                        density_warmup_steps=self.settings.density_warmup_steps)
        if pusher.codec.parts[0].info.sparsifier and not meta.optimizer.sparse:
            logger.warning("optimizer %s is dense: with codec %s every coordinate still moves at every step "
                           "(a full write per update), and the bursts of accumulated top-k gradients make "
                           "its momentum overshoot; lazyadam or dgc step only where the gradient is",
                           meta.optimizer.name, config.codec)
        start = await self._with_redis(starting_clock, self.redis, self.settings.job, reg.member_id)
        # the Pusher and the state's member id change together (no await between): the state tells
        # the current Pusher to adopt the feedback of pushes made under the current id only
        self.pusher = pusher
        self.state.joined(reg.member_id, start, reg.assignment)
        if self.consumer is None:
            self.consumer = ShardConsumer(
                self.settings.kafka_bootstrap, config.topic,
                max_records_per_batch=self.settings.batch_size, prefetch=self.settings.prefetch,
                group_id=f"streamtrain-{self.settings.job}" if self.settings.commit_to_kafka else None,
                outage_limit_s=self.settings.outage_limit_s)
        logger.info("member %s joined job %s: generation %d, partitions %s, %s, clock %d",
                    reg.member_id, self.settings.job, reg.generation, list(reg.partitions),
                    config.codec, start)

    async def _leave(self) -> None:
        if self.coordinator.member_id is None:
            return
        member = self.coordinator.member_id
        try:
            generation = await self.coordinator.leave()
            logger.info("member %s left; generation is now %d", member, generation)
        except CoordinatorError as exc:
            logger.warning("member %s could not leave cleanly (%s); its lease will expire", member, exc)

    async def _heartbeats(self) -> None:
        """Renew the lease and report stats; note new assignments for the loop to follow."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            await self._heartbeat()

    async def _kafka_mirror(self) -> None:
        """Every few seconds, copy committed offsets to Kafka's group (never delays heartbeats:
        the group's first commit waits for Kafka to create its offsets topic)."""
        while True:
            await asyncio.sleep(5.0)
            try:
                await self._mirror_offsets_to_kafka()
            except Exception as exc:  # noqa: BLE001 - informational only: Redis holds the truth
                logger.debug("could not mirror offsets to Kafka: %s", exc)

    async def _heartbeat(self) -> None:
        async with self._heartbeat_lock:  # the heartbeat task and the presence channel both call it
            try:
                self.state.heard(await self.coordinator.heartbeat(self._stats()))
            except (MemberGoneError, UnknownMemberError) as exc:
                logger.warning("member %s lost its lease (%s); registering anew",
                               self.coordinator.member_id, exc)
                self.state.lease_lost()
                self.coordinator.member_id = None
                await self._join()
            except CoordinatorError as exc:
                logger.warning("heartbeat failed (%s); training on with the current assignment", exc)

    async def _presence(self) -> None:
        """Hold the presence channel open, so the coordinator sees this process die the moment its
        socket closes, and fetch the new assignment as soon as it announces a new generation."""
        while True:
            try:
                async for generation in self.coordinator.channel():
                    current = self.state.assignment
                    if current is None or generation != current.generation:
                        await self._heartbeat()
            except CoordinatorError as exc:
                logger.debug("presence channel closed (%s); reopening", exc)
            await asyncio.sleep(0.2)  # the coordinator restarted, or we registered anew

    def _score(self, windows: list[ClosedWindow]) -> None:
        """Hand closed progressive-validation windows to the scoring thread."""
        for window in windows:
            if len(self._scoring) >= MAX_UNSCORED:
                self._unscored_dropped += 1
                if self._unscored_dropped == 1:
                    logger.warning("progressive validation: windows of %d records close faster than they are "
                                   "scored; dropping some (raise --progressive-every)", window.logits.size)
                continue
            self._scoring.append(self._score_pool.submit(score_window, window))

    def _scored(self) -> None:
        """Move the windows scored so far, in order, to the progress for the next heartbeat."""
        while self._scoring and self._scoring[0].done():
            future = self._scoring.popleft()
            try:
                self.progress.scored([future.result()])
            except Exception:  # scoring is informational: it never stops training
                logger.exception("progressive validation: a window could not be scored")

    def _stats(self) -> dict[str, object]:
        self._scored()
        held_out = self.last_eval
        accuracy = held_out.accuracy if held_out is not None else None
        binary = held_out is not None and self.replica.spec.binary  # its loss is the log loss
        lag = self.consumer.stats().lag if self.consumer is not None else {}
        cache = self.row_cache.stats() if self.tables else None
        return self.progress.heartbeat_stats(time.monotonic(), clock=self.state.clock - 1,
                                             staleness=self.state.staleness, accuracy=accuracy, lag=lag,
                                             row_cache=(cache.hits, cache.misses) if cache is not None else None,
                                             auc=held_out.auc if held_out is not None else None,
                                             log_loss=held_out.loss if binary and held_out is not None else None)

    async def _assign_from_committed(self) -> None:
        """Restart the consumer on the wanted partitions from their committed offsets."""
        wanted = self.state.wanted
        assert self.consumer is not None and wanted is not None
        positions = await asyncio.to_thread(committed_offsets, self.redis, self.settings.job, wanted.partitions)
        await asyncio.to_thread(self.consumer.assign, positions)
        self.state.assigned(wanted)
        logger.info("member %s generation %d: consuming %s", wanted.member_id, wanted.generation,
                    positions or "nothing")

    async def _with_redis(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a worker thread, retried through a Redis outage (up to the limit)."""
        while True:
            try:
                result = await asyncio.to_thread(fn, *args, **kwargs)
            except REDIS_DOWN as exc:
                await asyncio.sleep(self._redis_outage.failed(exc))
                continue
            self._redis_outage.recovered()
            return result

    # -- recovery ---------------------------------------------------------------------------------

    async def _resync(self, reason: str) -> None:
        """After a refused push or a clock-bound timeout: learn the current assignment, restart from
        the committed offsets, one clock past the last committed push (:meth:`TrainerState.resync`)."""
        logger.info("member %s resynchronising: %s", self.coordinator.member_id, reason)
        with contextlib.suppress(PushRefused):  # let it land (or fail) before reading the offsets
            await self._settle_push()
        self._drop_window("resynchronising")
        self.state.resync()
        self.row_cache.clear()  # the clock may go back: rows cached at later clocks are not trusted
        await self._heartbeat()
        if self.state.wanted is not None:
            await self._assign_from_committed()

    async def _ride_out(self, exc: BaseException) -> None:
        """Redis went away: wait until it answers (giving up after ``outage_limit_s`` with an error
        naming it), settle the push that was in flight with ``was_committed``, and resume from the
        committed offsets with a fresh replica (a Redis restarted on its AOF may be a second behind
        what this trainer saw)."""
        await asyncio.sleep(self._redis_outage.failed(exc))
        await self._with_redis(self.redis.ping)  # retries until Redis answers, or gives up
        with contextlib.suppress(PushRefused, *REDIS_DOWN):
            await self._settle_push()
        committed: bool | None = None
        if (push := self.state.unsettled) is not None:
            committed = await self._with_redis(was_committed, self.redis, self.settings.job,
                                               push.member_id, push.clock)
            logger.info("member %s: push at clock %d was %s before the outage", push.member_id, push.clock,
                        "committed" if committed else "not committed")
        self._do(self.state.outage_settled(committed))
        self.snapshot = None
        self.row_cache.clear()  # a Redis restarted on its AOF may be behind the rows cached
        await self._resync("redis outage")

    # -- the training loop ------------------------------------------------------------------------

    async def _train(self) -> None:
        max_steps = self.settings.max_steps
        recover: Callable[[], Awaitable[None]] | None = None
        while not self._stop.is_set() and not (max_steps and self.progress.steps >= max_steps):
            try:
                if recover is not None:
                    run, recover = recover, None
                    await run()
                    continue
                await self._turn()
                self._redis_outage.recovered()
            except (PushRefused, StalenessTimeout) as exc:
                recover = functools.partial(self._resync, str(exc))
            except REDIS_DOWN as exc:
                recover = functools.partial(self._ride_out, exc)

    async def _turn(self) -> None:
        """One turn of the loop: follow the assignment, then step on a batch (or idle, or tick)."""
        move = self.state.follow()
        if move is Move.LEAVE:
            logger.info("member %s is drained by the coordinator: settling and leaving",
                        self.coordinator.member_id)
            self.stop()
            return
        if move is Move.REASSIGN:
            self._drop_window("reassigned")
            await self._settle_push()
            await self._assign_from_committed()
            move = self.state.follow()
        if move is not Move.TRAIN:
            await asyncio.sleep(IDLE_S)
            return
        assert self.consumer is not None
        batch = await next_batch(self.consumer)
        if batch is None and self.local is not None and self.local.open:
            await self._push_window()  # the stream ran dry: push the steps in hand
        elif batch is None:
            await self._tick_if_others_wait()
        elif self.local is not None:  # local steps: the window's batches decoded already, in one hand-off
            await self._step([batch, *self._ready(self.local.steps - len(self.local.batches) - 1)])
        else:
            await self._step([batch])

    def _ready(self, most: int) -> list[Batch]:
        """Up to ``most`` batches the consumer has decoded already (none waited for)."""
        assert self.consumer is not None
        ready: list[Batch] = []
        while len(ready) < most and (batch := self.consumer.poll(0)) is not None:
            ready.append(batch)
        return ready

    async def _step(self, batches: Sequence[Batch], *, tick: bool = False) -> None:
        """Wait for the clock bound, pull, compute, and hand the push to the push thread.

        ``batches``: one batch; with local steps, consecutive batches of one window (its first may
        open it), computed one after another in one hand-off to the worker thread: a window's step
        then costs its compute and not a hand-off each (0.2-0.3 ms, a sixth of a digits step).
        ``tick``: an empty batch that only advances our clock (not counted as a step).
        """
        state = self.state
        if not state.step_allowed():
            return
        assert state.assignment is not None
        t0 = time.monotonic()
        generation, config = state.assignment.generation, state.assignment.config
        dense = Consistency(config.consistency, config.staleness)
        bound = TableBound(*config.table_bound()) if self.tables else None
        local = self.local if not tick else None
        assert local is not None or len(batches) == 1, "several batches in one step are local steps"
        opens = local is None or not local.open  # with local steps, a window's first step waits and pulls
        assert state.member_id is not None
        computed = await asyncio.to_thread(self._compute_all, batches, state.member_id, state.clock, dense,
                                           bound, state.last_wait, state.covers, state.first_clock, opens)
        each = (time.monotonic() - t0) / len(batches)
        for batch, done in zip(batches, computed, strict=True):
            await self._stepped(batch, done, generation, local, each, tick=tick)

    async def _stepped(self, batch: Batch, done: _Computed, generation: int, local: LocalSteps | None,
                       elapsed: float, *, tick: bool) -> None:
        """What follows the computation of one step on the event loop: the state learns of its wait
        and pull, a local step joins its window (pushed when full), a step's gradient goes to the
        push thread; then progress (``elapsed``: the step's seconds), scoring and evaluation."""
        state = self.state
        if done.wait is not None:
            state.waited(done.wait)
            self.progress.applied(done.wait.own_applied, time.time() * 1000)
        if done.snapshot is not None:
            assert done.wait is not None
            self.snapshot = done.snapshot
            assert done.covers is not None
            state.pulled(done.covers)
        if local is not None:  # a local step: the push waits for the window's last
            local.stepped(batch)
            for phase, seconds in done.seconds.items():
                self.progress.phase(phase, seconds)
        else:
            t1 = time.monotonic()
            await self._settle_push()  # the previous push must have landed before this one
            for phase, seconds in (*done.seconds.items(), ("push_wait", time.monotonic() - t1)):
                self.progress.phase(phase, seconds)
            grads = done.result.grads if done.result is not None else None
            rows = done.result.row_grads if done.result is not None else []
            self._send(grads, batch, generation, rows)
        if tick:
            return
        self.progress.stepped(len(batch), elapsed, done.result.loss if done.result is not None else None)
        self._score(done.windows)
        if local is not None and local.full:
            await self._push_window()
        if (report := self.progress.phase_report()) is not None:
            logger.info("member %s: %s %s", self.coordinator.member_id, PHASE_LOG,
                        ", ".join(f"{k} {v:.1f}" for k, v in report.items()))
        if self._eval_data is not None and self.progress.steps % self.settings.eval_every == 0:
            await self._evaluate()

    def _compute_all(self, batches: Sequence[Batch], member_id: str, clock: int, dense: Consistency,
                     bound: TableBound | None, known: ClockWait | None, covers: int | None, own_from: int,
                     opens: bool) -> list[_Computed]:
        """Runs on a worker thread: :meth:`_wait_pull_compute` of each of ``batches`` in order, the
        first one opening a window of local steps when ``opens`` (the rest are its later steps)."""
        return [self._wait_pull_compute(batch, member_id, clock, dense, bound, known, covers, own_from,
                                        opens and j == 0) for j, batch in enumerate(batches)]

    def _wait_pull_compute(self, batch: Batch, member_id: str, clock: int, dense: Consistency,
                           bound: TableBound | None, known: ClockWait | None, covers: int | None,
                           own_from: int, opens: bool = True) -> _Computed:
        """Runs on a worker thread (one hand-off per step): wait for the clock bound, pull what the
        bound needs into the model's parameters (and the batch's rows of the embedding tables: the
        row cache's, or pulled), then forward and backward on the batch. It reads the state only
        through its arguments and changes nothing but the replica's parameters, the row cache and the
        progressive-validation window (only this thread touches it). ``member_id``, ``clock`` and
        ``own_from`` are the state's, read together: a registration anew while a step waits must not
        make it wait on the new id's clocks with the old id's clock.

        With local steps, only the step that ``opens`` a window waits and pulls (an empty batch too:
        the window's later steps compute on what it pulled), and begins the window; every step is a
        step of the inner optimizer on the replica. That wait also needs this member's own windows
        up to the previous clock applied, and the pull always follows it: the pseudo-gradient is taken
        from the pull, and a window started on parameters lacking its own previous windows would push
        their progress again (one trainer under SSP s = 2 with H = 16 on digits ended at chance)."""
        local = self.local
        t0 = time.monotonic()
        snapshot, base = None, self.snapshot if covers is not None else None
        pulling = self.ahead
        ahead = pulling.take(base, member_id) if pulling is not None else None  # pulled while the last step computed
        t_take = time.monotonic() - t0
        wait = None
        # a window starts on its own previous windows: its pseudo-gradient is taken from its pull
        own_through = clock - 1 if local is not None and clock - 1 >= own_from else None
        if opens:
            wait = wait_for_clock(self.redis, self.settings.job, member_id, clock,
                                  consistency=wait_consistency(dense, bound),
                                  timeout_s=self.settings.staleness_timeout_s,
                                  max_unapplied=self.settings.max_unapplied,
                                  known=ahead.known(clock) if ahead is not None else known, own_from=own_from,
                                  own_through=own_through, max_poll_s=LOCAL_STEPS_POLL_S if local else MAX_POLL_S)
        t1 = time.monotonic()
        if pulling is not None and ahead is not None:
            pulling.swap(self.replica.params, ahead)
            snapshot, base, covers = ahead.snapshot, ahead.snapshot, low_covered(ahead.low)
        newest = ahead is not None and wait is not None and wait.required is None  # ASP: take the newest ready
        if wait is not None and (local is not None or (len(batch) and not newest and needs_pull(covers, wait))):
            snapshot = self.store.pull(base, out=self.replica.tensors)
            covers = low_covered(wait.min_applied)
        if opens and local is not None:
            local.begin()
        if wait is not None and local is None and self.settings.overlap_pulls and overlaps(dense, 1):
            held = snapshot if snapshot is not None else base
            if held is not None:  # the pull for the next step, while this one computes
                if self.ahead is None:
                    self.ahead = PullAhead(self.redis, self.settings.job, self.replica.tensors)
                self.ahead.start(held, member_id, self.replica.tensors)
        t2 = time.monotonic()
        phases = {"wait": t1 - t0 - t_take, "pull": t2 - t1 + t_take}  # waiting for the pull ahead is pulling
        if not len(batch):
            return _Computed(wait, snapshot, None, phases, covers=covers)
        lookups = rows = None
        if self.rows is not None and bound is not None:
            lookups = plan_lookups(self.tables, batch.ids, len(batch), groups=self.rows.groups)
            covered = wait.min_applied if wait is not None and wait.min_applied is not None else -1
            fetched = self.rows.fetch(lookups, clock=clock, bound=bound, required=table_required(bound, clock),
                                      covers=covered)
            rows = fetched.rows
        t3 = time.monotonic()
        result = self.replica.step(batch.x, batch.y, lookups, rows, inner=local.inner if local is not None else None)
        seconds = {**phases, "compute": time.monotonic() - t3}
        if lookups is not None:
            seconds["rows"] = t3 - t2
        windows = []
        if self.progressive is not None and result.logits is not None:  # scored on the scoring thread (_score)
            windows = self.progressive.add(result.logits, batch.y.numpy())
        return _Computed(wait, snapshot, result, seconds, windows, covers)

    def _send(self, grads: Mapping[str, torch.Tensor] | None, batch: Batch, generation: int,
              rows: Sequence[RowGrads] = ()) -> None:
        """Hand the push of ``grads`` and ``batch``'s offsets to the push thread, at the next clock
        (the push before it is settled)."""
        assert self.pusher is not None
        clock = self.state.pushing()
        self._sending = asyncio.get_running_loop().run_in_executor(
            self._push_pool, functools.partial(send_push, self.pusher, grads, batch, clock=clock,
                                               generation=generation, rows=rows))

    async def _push_window(self) -> None:
        """Push the window of local steps in hand, if any: its pseudo-gradient with the offsets of
        every batch it stepped on, at one clock (:mod:`trainers.local`).

        Raises:
            PushRefused: the push before it was refused, or the window's offsets have a gap (the
                window is dropped either way: its records go to the next owner).
        """
        local, assignment = self.local, self.state.assignment
        if local is None or not local.open:
            return
        if assignment is None:  # registered anew: nothing may be pushed under the old assignment
            self._drop_window("registered anew")
            return
        try:
            delta, batch = local.close()
        except ValueError as exc:
            raise PushRefused(f"window of local steps not pushed: {exc}") from exc
        t1 = time.monotonic()
        await self._settle_push()
        self.progress.phase("push_wait", time.monotonic() - t1)
        self._send(delta, batch, assignment.generation)

    def _drop_window(self, why: str) -> None:
        """Drop the window of local steps in hand (its records stay uncommitted: whoever owns their
        partitions next reads them again from the committed offsets)."""
        if self.local is not None and self.local.open:
            logger.info("member %s: %s; %d local step(s) not pushed, their records go to the next owner",
                        self.coordinator.member_id, why, len(self.local.batches))
        if self.local is not None:
            self.local.discard()

    async def _settle_push(self) -> None:
        """Wait for the push in flight, tell the state how it ended, and do what the state says.

        Raises:
            PushRefused: the state says resynchronise (the push was refused).
            redis.ConnectionError and the other ``REDIS_DOWN`` errors: Redis went away during the
                push; the state keeps it unsettled until ``was_committed`` says (:meth:`_ride_out`).
        """
        push = self.state.in_flight
        if push is None:
            return
        sending, self._sending = self._sending, None
        assert sending is not None, "the state has a push in flight that was never sent"
        report = await sending
        instructions = self.state.push_ended(report.outcome, report.feedback)
        if report.outcome is Outcome.REFUSED and not instructions:
            logger.info("member %s: push at clock %d refused (%s); made under an earlier member id, "
                        "nothing to resynchronise", push.member_id, push.clock, report.error)
        self._do(instructions, report.error)
        if report.outcome is Outcome.UNREACHABLE:
            assert report.error is not None
            raise report.error
        if report.outcome is Outcome.COMMITTED:
            assert self.pusher is not None
            self.progress.pushed(push.clock, report.wire_bytes, report.produced_ts_ms)
            self.metrics.pushed(self.pusher.codec.name, report.wire_bytes, report.raw_bytes)

    def _do(self, instructions: list[Instruction], error: Exception | None = None) -> None:
        """Do what the state says about a push that ended (:mod:`trainers.state`).

        Raises:
            PushRefused: told to resynchronise (``error``: the refusal, for the log).
        """
        for instruction in instructions:
            if isinstance(instruction, Adopt):
                assert self.pusher is not None and isinstance(instruction.feedback, Feedback)
                self.pusher.adopt(instruction.feedback)
            elif isinstance(instruction, Resync):
                raise PushRefused(f"push at clock {instruction.clock} refused: {error}") from error

    async def _tick_if_others_wait(self) -> None:
        """With no data, advance our clock when others are ahead, so we never hold them back."""
        assignment = self.state.assignment
        if self.pusher is None or assignment is None:
            return
        clocks = await asyncio.to_thread(read_job_clocks, self.redis, self.settings.job)
        if self.state.should_tick(assignment.config.consistency, clocks.live, clocks.pushed):
            await self._step([Batch(torch.empty(0, 0), torch.empty(0), {}, [], 0, 0)], tick=True)

    # -- evaluation and offsets --------------------------------------------------------------------

    def _load_eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        held_out = load_source(self.settings.eval_source, split="test").read(limit=self.settings.eval_limit)
        self._eval_ids = held_out.ids
        return (torch.from_numpy(held_out.x).float().to(self.plan.device),
                torch.from_numpy(held_out.y).to(self.plan.device))

    async def _evaluate(self) -> None:
        assert self._eval_data is not None and self.snapshot is not None
        x, y = self._eval_data
        spec = self.replica.spec
        if spec.classification:
            y = y.long()
        inputs = None
        if self.rows is not None:  # the held-out records' rows, pulled as they are now
            inputs = table_inputs(self.tables, self._eval_ids, self.rows.pull, self.plan.device)
        self.last_eval = await asyncio.to_thread(
            evaluate, self.replica.model, spec.loss_fn, x, y, version=self.snapshot.version,
            classification=spec.classification, binary=spec.binary, inputs=inputs)
        logger.info("version %d: held-out loss %.4f accuracy %s", self.last_eval.version,
                    self.last_eval.loss, self.last_eval.accuracy)

    async def _mirror_offsets_to_kafka(self) -> None:
        """Copy our partitions' committed offsets to Kafka's group so its tools show the lag."""
        assignment = self.state.assignment
        if not self.settings.commit_to_kafka or self.consumer is None or assignment is None:
            return
        if not assignment.partitions:
            return
        committed = await asyncio.to_thread(committed_offsets, self.redis, self.settings.job,
                                            assignment.partitions)
        offsets = {p: n for p, n in committed.items() if n is not None}
        if offsets:
            await asyncio.to_thread(self.consumer.commit, offsets)
