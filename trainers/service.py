"""The trainer service: consume assigned partitions, compute gradients, push them.

The loop in :meth:`Trainer._train` reads top to bottom as what a trainer
does each step::

    batch  = next batch from my partitions        (prefetched, decoded off-thread)
    wait   until the consistency model allows this clock
    params = pull the shards that changed         (one consistent version; skipped when
                                                   the replica already meets the SSP bound)
    grads  = forward + backward on the batch
    push   grads + the batch's offsets, atomically (overlaps the next step)

Around it: registration and heartbeats with the coordinator (a background
task), following reassignments and generation changes, evaluation on held-out
data, and a drain on SIGTERM that finishes the batch in hand, commits it and
leaves the membership.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from coordinator import Assignment, CoordinatorClient, MemberGoneError, UnknownMemberError
from coordinator.errors import CoordinatorError
from datastream import Batch, ShardConsumer, load_source
from services import (
    FencedError, OffsetConflictError, OptimizerConfig, ParameterStore, Pusher, Snapshot, connect,
    starting_clock, wait_for_clock, was_committed,
)
from services.consistency import ClockWait, Consistency, StalenessTimeout
from streamtrain.keys import JobKeys
from streamtrain.outage import REDIS_DOWN, Outage, redis_name

from .device import plan_device
from .evaluate import EvalResult, evaluate
from .models import build_model
from .metrics import TrainerMetrics
from .settings import TrainerSettings
from .step import Replica, StepResult

logger = logging.getLogger(__name__)
T = TypeVar("T")

class PushRefused(Exception):
    """The parameter plane refused a push (fenced, or offsets out of line): resynchronise."""


@dataclass
class _Window:
    """Counters between two heartbeats."""

    records: int = 0
    steps: int = 0
    step_time_s: float = 0.0
    wire_bytes: int = 0
    started: float = 0.0


class Trainer:
    """One trainer: ``await Trainer(settings).run()``; ``stop()`` asks it to drain and leave."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.keys = JobKeys(settings.job)
        self.plan = plan_device(settings.device, settings.threads, settings.mixed_precision)
        self.replica = Replica(build_model(settings.model, seed=settings.seed), self.plan)
        self.redis = connect(settings.redis_url)
        self.store = ParameterStore(self.redis, settings.job)
        # A reply slower than a second is as good as none: the lease is a few seconds.
        self.coordinator = CoordinatorClient(settings.coordinator_url, settings.job_token, timeout_s=1.0)
        self.consumer: ShardConsumer | None = None
        self.pusher: Pusher | None = None
        self.assignment: Assignment | None = None
        self._wanted: Assignment | None = None  # newest assignment from a heartbeat, not yet applied
        self.heartbeat_interval_s = 0.5
        self.snapshot: Snapshot | None = None
        self._covers = -1  # the replica holds every live member's updates up to this clock
        self._last_wait: ClockWait | None = None  # what the last clock wait observed
        self._unsettled_clock: int | None = None  # a push whose reply a Redis outage may have lost
        self._redis_outage = Outage(redis_name(self.redis), settings.outage_limit_s, logger)
        self._phases: collections.Counter[str] = collections.Counter()  # seconds per step phase
        self.clock = 1
        self._last_pushed_clock = 0
        self.steps = 0
        self.loss_ema: float | None = None
        self.last_eval: EvalResult | None = None
        self.last_staleness = 0
        self._stop = asyncio.Event()
        self._push_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="push")
        self._inflight: asyncio.Future[None] | None = None
        self._pushed: collections.deque[tuple[int, int]] = collections.deque()  # (clock, produced_ts_ms)
        self._freshness: list[float] = []
        self._window = _Window(started=time.monotonic())
        self._eval_data: tuple[torch.Tensor, torch.Tensor] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._heartbeat_lock = asyncio.Lock()
        self._background: list[asyncio.Task[None]] = []
        self.metrics = TrainerMetrics(self)
        """This trainer's Prometheus metrics (served by ``streamtrain trainer --metrics-port``)."""

    # -- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the trainer to finish the batch in hand, commit it and leave."""
        self._stop.set()

    async def run(self) -> int:
        """Train until stopped (or ``max_steps``); returns an exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        try:
            if self.settings.eval_source:
                self._eval_data = await asyncio.to_thread(self._load_eval_data)
            await self._join()
            await self._train()
            try:
                await self._settle_push()
            except PushRefused as exc:
                logger.info("last push not committed (%s); its records go to the next owner", exc)
            await self._mirror_offsets_to_kafka()
            return 0
        finally:
            await self._cancel(self._heartbeat_task)
            await self._leave()  # before the presence channel closes: a closed channel reads as a death
            for task in self._background:
                await self._cancel(task)
            await self._close()

    @staticmethod
    async def _cancel(task: asyncio.Task[None] | None) -> None:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _close(self) -> None:
        if self.consumer is not None:
            await asyncio.to_thread(self.consumer.close)
        self._push_pool.shutdown(wait=True)
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
                if not getattr(exc, "retriable", True) or self._stop.is_set():
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
        meta = await self._with_redis(
            self.store.init_model, self.replica.initial_tensors(),
            optimizer=OptimizerConfig(name=config.optimizer, lr=config.lr))
        options = {"density": self.settings.topk_density} if "topk" in config.codec else {}
        self.pusher = Pusher(self.redis, self.settings.job, reg.member_id, codec=config.codec,
                             codec_options=options, momentum=meta.optimizer.trainer_momentum)
        if self.pusher.codec.parts[0].info.sparsifier and not meta.optimizer.sparse:
            logger.warning("optimizer %s is dense: with codec %s every coordinate still moves at every step "
                           "(a full write per update), and the bursts of accumulated top-k gradients make "
                           "its momentum overshoot; lazyadam or dgc step only where the gradient is",
                           meta.optimizer.name, config.codec)
        self.clock = await self._with_redis(starting_clock, self.redis, self.settings.job, reg.member_id)
        self._last_wait = None  # a new member id: observe afresh
        self._last_pushed_clock = self.clock - 1
        if self.consumer is None:
            self.consumer = ShardConsumer(
                self.settings.kafka_bootstrap, config.topic,
                max_records_per_batch=self.settings.batch_size, prefetch=self.settings.prefetch,
                group_id=f"streamtrain-{self.settings.job}" if self.settings.commit_to_kafka else None,
                outage_limit_s=self.settings.outage_limit_s)
        self.assignment = None
        self._wanted = reg.assignment
        logger.info("member %s joined job %s: generation %d, partitions %s, %s, clock %d",
                    reg.member_id, self.settings.job, reg.generation, list(reg.partitions),
                    config.codec, self.clock)

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
        """Renew the lease and report stats; note new assignments for the loop to apply."""
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
                self._wanted = await self.coordinator.heartbeat(self._stats())
            except (MemberGoneError, UnknownMemberError) as exc:
                logger.warning("member %s lost its lease (%s); registering anew",
                               self.coordinator.member_id, exc)
                self._wanted = None
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
                    if self.assignment is None or generation != self.assignment.generation:
                        await self._heartbeat()
            except CoordinatorError as exc:
                logger.debug("presence channel closed (%s); reopening", exc)
            await asyncio.sleep(0.2)  # the coordinator restarted, or we registered anew

    def _stats(self) -> dict[str, object]:
        now = time.monotonic()
        w, self._window = self._window, _Window(started=now)
        elapsed = max(now - w.started, 1e-6)
        stats: dict[str, object] = {"records_per_s": w.records / elapsed, "clock": max(self.clock - 1, 0),
                                    "staleness": self.last_staleness, "samples": w.records}
        if self.loss_ema is not None and math.isfinite(self.loss_ema):  # JSON has no NaN
            stats["loss"] = self.loss_ema
        if w.steps:
            stats["step_time_s"] = w.step_time_s / w.steps
            stats["bytes_per_step"] = w.wire_bytes / w.steps
        if self.last_eval is not None and self.last_eval.accuracy is not None:
            stats["accuracy"] = self.last_eval.accuracy
        lag = self.consumer.stats().lag if self.consumer is not None else {}
        if lag:  # the coordinator's streamtrain_member_lag
            stats["lag"] = sum(lag.values())
        if self._freshness:
            stats["freshness_s"], self._freshness = self._freshness[:1000], []
        return stats

    async def _apply_assignment(self) -> None:
        """Follow a new generation or partition set between steps."""
        wanted = self._wanted
        if wanted is None or self.consumer is None:
            return
        current = self.assignment
        if current is not None and current.partitions == wanted.partitions:
            self.assignment = wanted  # same partitions: only the fencing token moves on
            return
        await self._settle_push()
        await self._assign_from_committed(wanted)

    async def _assign_from_committed(self, wanted: Assignment) -> None:
        assert self.consumer is not None
        committed = await asyncio.to_thread(
            self.redis.hmget, self.keys.offsets, [str(p) for p in wanted.partitions])
        positions = {p: (int(c) if c is not None else None) for p, c in zip(wanted.partitions, committed)}
        await asyncio.to_thread(self.consumer.assign, positions)
        self.assignment = wanted
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

    async def _ride_out(self, exc: BaseException) -> None:
        """Redis went away: wait until it answers (giving up after ``outage_limit_s`` with an error
        naming it), settle the push that was in flight with ``was_committed``, and resume from the
        committed offsets with a fresh replica (a Redis restarted on its AOF may be a second behind
        what this trainer saw)."""
        await asyncio.sleep(self._redis_outage.failed(exc))
        await self._with_redis(self.redis.ping)  # retries until Redis answers, or gives up
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            with contextlib.suppress(PushRefused, *REDIS_DOWN):
                await inflight
        clock, self._unsettled_clock = self._unsettled_clock, None
        if clock is not None:
            committed = await asyncio.to_thread(was_committed, self.redis, self.settings.job,
                                                self.pusher.member_id, clock)
            self.pusher.settle(committed)
            if committed:
                self._last_pushed_clock = clock
            logger.info("push at clock %d was %s before the outage", clock,
                        "committed" if committed else "not committed")
        self.snapshot, self._covers, self._last_wait = None, -1, None
        try:
            await self._resync("redis outage")
        except REDIS_DOWN as again:  # it went away again: the training loop rides that out too
            logger.info("redis unreachable again during the resync: %s", again)

    async def _resync(self, reason: str) -> None:
        """After a refused push: learn the current assignment, restart from committed offsets."""
        logger.info("member %s resynchronising: %s", self.coordinator.member_id, reason)
        inflight, self._inflight = self._inflight, None
        if inflight is not None:  # let it land (or fail) before reading the committed offsets
            with contextlib.suppress(PushRefused):
                await inflight
        # Steps after the refused push were never pushed: our clock resumes after the last that was,
        # or the clock bound would wait for updates of ours that will never exist.
        self.clock = self._last_pushed_clock + 1
        self._last_wait = None
        await self._heartbeat()
        if self._wanted is not None:
            await self._assign_from_committed(self._wanted)

    # -- the training loop ------------------------------------------------------------------------

    async def _train(self) -> None:
        max_steps = self.settings.max_steps
        while not self._stop.is_set() and not (max_steps and self.steps >= max_steps):
            try:
                await self._apply_assignment()
            except PushRefused as exc:
                await self._resync(str(exc))
                continue
            except REDIS_DOWN as exc:
                await self._ride_out(exc)
                continue
            if self.assignment is None or self.assignment.state != "active" or not self.assignment.partitions:
                await asyncio.sleep(0.1)
                continue
            try:
                batch = self.consumer.poll(0) or await asyncio.to_thread(self.consumer.poll, 0.2)
                if batch is None:
                    await self._tick_if_others_wait()
                else:
                    await self._step(batch)
                self._redis_outage.recovered()
            except (PushRefused, StalenessTimeout) as exc:
                await self._resync(str(exc))
            except REDIS_DOWN as exc:
                await self._ride_out(exc)

    async def _step(self, batch: Batch, *, tick: bool = False) -> None:
        """Wait for the clock bound, pull, compute, and hand the push to the push thread.

        ``tick``: an empty batch that only advances our clock (not counted as a step).
        """
        if self.assignment is None:
            # re-registered while the batch was polled (a fenced member comes back under a new id):
            # drop it; the new assignment restarts the consumer from the committed offsets
            return
        t0 = time.monotonic()
        phases = self._phases
        clock, generation = self.clock, self.assignment.generation
        config = self.assignment.config
        consistency = Consistency(config.consistency, config.staleness)
        waited, result = await asyncio.to_thread(self._wait_pull_compute, batch, clock, consistency)
        self.last_staleness = waited.staleness
        t3 = time.monotonic()
        await self._settle_push()  # the previous push must have landed before this one
        phases["push_wait"] += time.monotonic() - t3
        self._inflight = asyncio.get_running_loop().run_in_executor(
            self._push_pool, self._push, batch, result, clock, generation)
        self.clock += 1
        if tick:
            return
        self.steps += 1
        self._window.steps += 1
        if self.steps % 50 == 0:
            logger.info("member %s: last 50 steps spent (ms/step) %s", self.pusher.member_id,
                        ", ".join(f"{k} {v * 20:.1f}" for k, v in sorted(phases.items())))
            phases.clear()
        self._window.records += len(batch)
        self._window.step_time_s += time.monotonic() - t0
        if result is not None:
            self.loss_ema = result.loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * result.loss
        self._observe_freshness(waited.own_applied)
        if self._eval_data is not None and self.steps % self.settings.eval_every == 0:
            await self._evaluate()

    def _wait_pull_compute(self, batch: Batch, clock: int, consistency: Consistency
                           ) -> tuple[ClockWait, StepResult | None]:
        """Runs on a worker thread (one hand-off per step): wait for the clock bound, pull what the
        bound needs into the model's parameters, then forward and backward on the batch."""
        phases = self._phases
        t0 = time.monotonic()
        waited = wait_for_clock(self.redis, self.settings.job, self.pusher.member_id, clock,
                                consistency=consistency, timeout_s=self.settings.staleness_timeout_s,
                                max_unapplied=self.settings.max_unapplied, known=self._last_wait)
        self._last_wait = waited
        t1 = time.monotonic()
        phases["wait"] += t1 - t0
        if not len(batch):
            return waited, None
        if self.snapshot is None or waited.required is None or self._covers < waited.required:
            # The bound needs updates our replica lacks (ASP: always take the newest).
            self.snapshot = self.store.pull(self.snapshot, out=self.replica.tensors)
            # Every live member's updates up to min_applied (read before the pull) are in it.
            self._covers = waited.min_applied if waited.min_applied is not None else -1
        t2 = time.monotonic()
        phases["pull"] += t2 - t1
        result = self.replica.step(batch.x, batch.y)
        phases["compute"] += time.monotonic() - t2
        return waited, result

    def _push(self, batch: Batch, result: StepResult | None, clock: int, generation: int) -> None:
        """Runs on the push thread: encode and push atomically with the batch's offsets."""
        try:
            pushed = self.pusher.push(result.grads if result is not None else None,
                                      generation=generation, clock=clock, offsets=batch.offsets,
                                      samples=batch.samples, batch_size=len(batch),
                                      produced_ts_ms=batch.produced_ts_ms)
        except (FencedError, OffsetConflictError) as exc:
            raise PushRefused(f"push at clock {clock} refused: {exc}") from exc
        except REDIS_DOWN:
            self._unsettled_clock = clock  # its reply may be lost: settled once Redis answers
            raise
        self._last_pushed_clock = clock
        self._window.wire_bytes += pushed.wire_bytes
        self.metrics.pushed(self.pusher.codec.name, pushed.wire_bytes, pushed.raw_bytes)
        if batch.produced_ts_ms:
            self._pushed.append((clock, batch.produced_ts_ms))

    async def _settle_push(self) -> None:
        """Wait for the push in flight; a refused one raises :class:`PushRefused`."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            await inflight

    async def _tick_if_others_wait(self) -> None:
        """With no data, advance our clock when others are ahead, so we never hold them back."""
        if self.pusher is None or self.assignment is None or self.assignment.config.consistency == "asp":
            return
        members, clocks = await asyncio.to_thread(self._members_and_clocks)
        own = clocks.get(self.pusher.member_id)
        if own is None:
            return  # we never pushed: the clock bound does not count us
        if any(c >= self.clock for m, c in clocks.items() if m in members and m != self.pusher.member_id):
            empty = Batch(torch.empty(0, 0), torch.empty(0), {}, [], 0, 0)
            try:
                await self._step(empty, tick=True)
            except PushRefused as exc:
                await self._resync(str(exc))

    def _members_and_clocks(self) -> tuple[set[str], dict[str, int]]:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hkeys(self.keys.members)
        pipe.hgetall(self.keys.clocks)
        members, clocks = pipe.execute()
        return {m.decode() for m in members}, {k.decode(): int(v) for k, v in clocks.items()}

    def _observe_freshness(self, applied_clock: int) -> None:
        """Seconds from produce to the first version holding the gradient, for pushes applied up to
        ``applied_clock`` (as the last clock wait read it)."""
        now_ms = time.time() * 1000
        while self._pushed and self._pushed[0][0] <= applied_clock:
            _, produced = self._pushed.popleft()
            self._freshness.append(max(0.0, (now_ms - produced) / 1000))

    # -- evaluation and offsets --------------------------------------------------------------------

    def _load_eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = load_source(self.settings.eval_source, split="test").read(limit=self.settings.eval_limit)
        return (torch.from_numpy(x).float().to(self.plan.device),
                torch.from_numpy(y).to(self.plan.device))

    async def _evaluate(self) -> None:
        assert self._eval_data is not None and self.snapshot is not None
        x, y = self._eval_data
        spec = self.replica.spec
        if spec.classification:
            y = y.long()
        self.last_eval = await asyncio.to_thread(
            evaluate, self.replica.model, spec.loss_fn, x, y, version=self.snapshot.version,
            classification=spec.classification)
        logger.info("version %d: held-out loss %.4f accuracy %s", self.last_eval.version,
                    self.last_eval.loss, self.last_eval.accuracy)

    async def _mirror_offsets_to_kafka(self) -> None:
        """Copy our partitions' committed offsets to Kafka's group so its tools show the lag."""
        if not self.settings.commit_to_kafka or self.consumer is None or not self.assignment:
            return
        parts = list(self.assignment.partitions)
        if not parts:
            return
        committed = await asyncio.to_thread(self.redis.hmget, self.keys.offsets, [str(p) for p in parts])
        offsets = {p: int(c) for p, c in zip(parts, committed) if c is not None}
        if offsets:
            await asyncio.to_thread(self.consumer.commit, offsets)
