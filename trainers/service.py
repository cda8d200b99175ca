"""The trainer service: consume assigned partitions, compute gradients, push them.

This module is the shell: it does the I/O (the coordinator, Kafka, the push thread, recovery) and
nothing else. What a trainer knows and the rules that change it live in :mod:`trainers.state`;
how it steps (a push per step, or windows of local steps; chosen once, on joining) in
:mod:`trainers.steps`; what it reports in :mod:`trainers.progress`. The loop, the push outcomes,
resynchronising and riding out an outage: ``docs/architecture.md``, *A trainer, step by step*.
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
from dataclasses import dataclass
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
    was_committed,
)
from services.consistency import Consistency, StalenessTimeout
from services.tables import RowGrads

from . import events
from .device import plan_device
from .evaluate import EvalResult, evaluate
from .local import LocalSteps, check_model, server_optimizer
from .metrics import TrainerMetrics, TrainerReport
from .models import build_model
from .progress import PHASE_REPORT_STEPS, Progress
from .progressive import ClosedWindow, ProgressiveWindow, WindowScore, score_window
from .rowahead import RowsAhead
from .rowcache import RowCache, TableBound
from .settings import TrainerSettings
from .state import Adopt, Instruction, Move, Outcome, Resync, TrainerState
from .step import Replica
from .steps import Computed, StepInputs, Steps, TableRows, choose_steps
from .tables import RowFetcher, table_inputs

logger = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_S = 0.1
"""Pause of a turn with nothing to consume."""
POLL_S = 0.2
"""Longest wait for a batch before the loop turns again."""
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
        self._decoded: collections.deque[Batch] = collections.deque()
        """Batches taken from the consumer ahead of their step (with ``--row-prefetch``: their rows are
        fetched while the step before them computes), in order; stepped on before any other."""
        self.steps: Steps | None = None
        """How this trainer steps, chosen on joining the first time (:mod:`trainers.steps`): a push per
        step, or windows of local steps; it holds the tables' rows and progressive validation."""
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._heartbeat_lock = asyncio.Lock()
        self._background: list[asyncio.Task[None]] = []
        self.metrics = TrainerMetrics(self.report)
        """This trainer's Prometheus metrics (served by ``streamtrain trainer --metrics-port``)."""

    @property
    def local(self) -> LocalSteps | None:
        """The window of local steps (``local_steps`` > 1); None: a push per step, or not joined yet."""
        return self.steps.window if self.steps is not None else None

    @property
    def rows(self) -> RowFetcher | None:
        """Fetches the rows of the model's embedding tables (None: it has none, or not joined yet)."""
        return self.steps.rows.fetcher if self.steps is not None and self.steps.rows is not None else None

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
        if self.steps is not None:
            self.steps.close()
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
        if self.steps is None:  # chosen once: a window's inner optimizer state lives on through a new member id
            ahead = (RowsAhead(self.redis, self.settings.job, self.tables, meta.groups, self.row_cache,
                               self.settings.row_prefetch) if self.settings.row_prefetch else None)
            rows = (TableRows(self.tables, RowFetcher(self.redis, self.settings.job, self.tables, meta.groups,
                                                      self.row_cache), ahead) if self.tables else None)
            self.steps = choose_steps(config, self.redis, self.settings, self.store, self.replica, rows=rows,
                                      progressive=self.progressive)
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
        self._decoded.clear()  # taken under the previous assignment, as the consumer drops its own
        await asyncio.to_thread(self.consumer.assign, positions)
        self.state.assigned(wanted)
        logger.info("member %s generation %d: consuming %s", wanted.member_id, wanted.generation,
                    positions or "nothing")
        events.emit(events.CONSUMING, member=wanted.member_id, generation=wanted.generation, partitions=positions)

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
        batch = self._decoded.popleft() if self._decoded else await next_batch(self.consumer)
        window = self.local
        if batch is None and window is not None and window.open:
            await self._push_window()  # the stream ran dry: push the steps in hand
        elif batch is None:
            await self._tick_if_others_wait()
        else:  # with local steps, the window's batches decoded already come along, in one hand-off
            assert self.steps is not None
            await self._step([batch, *self._ready(self.steps.room())])

    def _ready(self, most: int) -> list[Batch]:
        """Up to ``most`` batches the consumer has decoded already (none waited for)."""
        assert self.consumer is not None
        ready: list[Batch] = []
        while len(ready) < most and self._decoded:
            ready.append(self._decoded.popleft())
        while len(ready) < most and (batch := self.consumer.poll(0)) is not None:
            ready.append(batch)
        return ready

    async def _step(self, batches: Sequence[Batch], *, tick: bool = False) -> None:
        """Wait for the clock bound, pull, compute (:attr:`steps`, on a worker thread), then push.

        ``batches``: one batch; with local steps, consecutive batches of one window (its first may
        open it), computed one after another in one hand-off to the worker thread: a window's step
        then costs its compute and not a hand-off each (0.2-0.3 ms, a sixth of a digits step).
        ``tick``: an empty batch that only advances our clock (not counted as a step).
        """
        state, steps = self.state, self.steps
        if not state.step_allowed():
            return
        assert state.assignment is not None and state.member_id is not None and steps is not None
        t0 = time.monotonic()
        generation, config = state.assignment.generation, state.assignment.config
        given = StepInputs(member_id=state.member_id, clock=state.clock, own_from=state.first_clock,
                           known=state.last_wait, covers=state.covers,
                           base=self.snapshot if state.covers is not None else None,
                           dense=Consistency(config.consistency, config.staleness),
                           bound=TableBound(*config.table_bound()) if self.tables else None,
                           upcoming=() if tick else self._upcoming())
        if tick:
            computed = [await asyncio.to_thread(steps.tick, batches[0], given)]
        else:
            computed = await asyncio.to_thread(steps.compute, batches, given)
        each = (time.monotonic() - t0) / len(batches)
        for batch, done in zip(batches, computed, strict=True):
            await self._stepped(batch, done, generation, each, tick=tick)

    def _upcoming(self) -> tuple[Batch, ...]:
        """The batches decoded after the one in hand, up to ``--row-prefetch`` of them, taken from the
        consumer without waiting (a model with tables only: their rows are fetched ahead)."""
        most = min(self.settings.row_prefetch, self.settings.prefetch) if self.tables else 0
        assert self.consumer is not None
        while len(self._decoded) < most and (batch := self.consumer.poll(0)) is not None:
            self._decoded.append(batch)
        return tuple(self._decoded)

    async def _stepped(self, batch: Batch, done: Computed, generation: int, elapsed: float, *, tick: bool) -> None:
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
        if done.in_window:
            self._window_step(batch, done)
        else:
            await self._push_step(batch, done, generation)
        if tick:
            return
        self.progress.stepped(len(batch), elapsed, done.result.loss if done.result is not None else None)
        self._score(done.windows)
        if done.in_window and self.local is not None and self.local.full:
            await self._push_window()
        if (report := self.progress.phase_report()) is not None:
            logger.info("member %s: ms per step %s", self.coordinator.member_id,
                        ", ".join(f"{k} {v:.1f}" for k, v in report.items()))
            events.emit(events.STEP_PHASES, member=self.coordinator.member_id, steps=PHASE_REPORT_STEPS,
                        ms_per_step=report)
        if self._eval_data is not None and self.progress.steps % self.settings.eval_every == 0:
            await self._evaluate()

    async def _push_step(self, batch: Batch, done: Computed, generation: int) -> None:
        """A plain step (or a tick): its gradient (a tick's none) and ``batch``'s offsets go to the push
        thread, once the push before it has landed."""
        t1 = time.monotonic()
        await self._settle_push()
        for phase, seconds in (*done.seconds.items(), ("push_wait", time.monotonic() - t1)):
            self.progress.phase(phase, seconds)
        grads = done.result.grads if done.result is not None else None
        rows = done.result.row_grads if done.result is not None else []
        self._send(grads, batch, generation, rows)

    def _window_step(self, batch: Batch, done: Computed) -> None:
        """A local step: ``batch`` joins the window in hand, whose push waits for its last step."""
        window = self.local
        assert window is not None
        window.stepped(batch)
        for phase, seconds in done.seconds.items():
            self.progress.phase(phase, seconds)

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
