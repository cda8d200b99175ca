"""The coordinator's sampler: once a second, read the job and add a sample to its history.

The I/O shell around the pure :mod:`coordinator.history` and :mod:`coordinator.progressive`: a tick
reads Redis in one round trip (plus one over the groups for the tables), Kafka's end offsets with its
own consumer on its own thread (so a slow broker never delays ``/readyz`` or ``/v1/status``), and what
the heartbeats brought; a tick that fails is skipped. It waits with ``asyncio.timeout`` and is stopped
with :func:`common.tasks.cancel_and_wait` (why: :mod:`common.tasks`). See docs/dashboard.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from common.keys import JobKeys
from common.outage import REDIS_DOWN
from common.tasks import cancel_and_wait

from .history import SAMPLE_INTERVAL_S, History, Sample, take_sample
from .kafka_probe import KafkaProbe
from .metrics import Metrics
from .progressive import ProgressiveHistory
from .settings import CoordinatorSettings
from .state import JobConfig, Store
from .status import group_versions, model_version, partitions_view, read_plane
from .tables import TableReader

if TYPE_CHECKING:
    from .membership import Membership

logger = logging.getLogger(__name__)

KAFKA_RETRY_S = 10.0
"""After a failed end-offset probe, seconds before the sampler probes Kafka again."""

MAX_PENDING_FRESHNESS = 100_000
"""Freshness samples held between two ticks at most (more are dropped, and counted in the log)."""


def _ints(raw: dict[bytes, bytes]) -> dict[str, int]:
    out = {}
    for k, v in raw.items():
        try:
            out[k.decode()] = int(v)
        except ValueError:
            continue
    return out


class Sampler:
    """Samples the job into :attr:`history` every :data:`SAMPLE_INTERVAL_S` from :meth:`start`
    until :meth:`close`."""

    def __init__(self, settings: CoordinatorSettings, metrics: Metrics | None = None) -> None:
        self.history = History(settings.history_samples)
        """The samples taken so far (the newest ``settings.history_samples``)."""
        self.progressive = ProgressiveHistory(settings.history_samples)
        """Progressive validation of a binary model: heartbeats' windows, pooled at each sample."""
        self.tables = TableReader(JobKeys(settings.job))
        """Reads the job's embedding tables (``/v1/status`` shares it, and its cache of the names)."""
        self._settings = settings
        self._metrics = metrics
        self._freshness: list[float] = []
        self._dropped = 0
        self._probe = KafkaProbe(settings.kafka_bootstrap, settings.kafka_timeout_ms)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coordinator-history")
        self._kafka_retry_at = 0.0
        self._kafka_failing = False
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def observe_heartbeat(self, freshness_s: Iterable[float]) -> None:
        """Keep a heartbeat's freshness samples for the next tick's p50/p99."""
        room = MAX_PENDING_FRESHNESS - len(self._freshness)
        values = list(freshness_s)
        self._freshness.extend(values[:max(room, 0)])
        self._dropped += max(0, len(values) - max(room, 0))

    async def _lag(self, state: Membership, config: JobConfig, committed: dict[str, int]) -> int | None:
        now = time.monotonic()
        if now < self._kafka_retry_at:
            return None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._settings.kafka_timeout_ms / 1000 * 3):
                offsets = await loop.run_in_executor(self._executor, self._probe.offsets,
                                                     config.topic, config.partitions)
        except Exception as exc:  # noqa: BLE001 - the history degrades to no lag without Kafka
            if not self._kafka_failing:
                logger.warning("history: end offsets of %s unavailable (%r); lag left empty, "
                               "retrying every %.0fs", config.topic, exc, KAFKA_RETRY_S)
            self._kafka_failing = True
            self._kafka_retry_at = now + KAFKA_RETRY_S
            return None
        if self._kafka_failing:
            logger.info("history: end offsets of %s available again", config.topic)
            self._kafka_failing = False
        parts = partitions_view(state, {}, committed, offsets)
        return sum(p["lag"] for p in parts if p["lag"] is not None)

    async def sample_once(self, store: Store) -> Sample:
        """Read the job from ``store``, add one sample to :attr:`history` and return it."""
        keys = store.keys
        config = await store.config()
        state = await store.load()
        groups = await store.groups(config)
        plane = await read_plane(store.redis, keys, groups, "staleness", "offsets")
        staleness, committed = plane.hashes["staleness"], plane.hashes["offsets"]
        version = model_version(plane.versions)
        if self._metrics is not None and (groups_now := group_versions(plane.versions)) is not None:
            self._metrics.observe_versions(groups_now)
        tables = await self.tables.read(store.redis, groups, model_exists=version is not None)
        lag = await self._lag(state, config, _ints(committed))
        freshness, self._freshness = self._freshness, []
        if self._dropped:
            logger.warning("history: dropped %d freshness samples (more than %d in one tick)",
                           self._dropped, MAX_PENDING_FRESHNESS)
            self._dropped = 0
        last = self.history.last
        t_ms = time.time_ns() // 1_000_000
        if last is not None:
            t_ms = max(t_ms, last.t_ms + 1)  # the wall clock stepped back: keep the axis ordered
        sample = take_sample(t_ms, {m.member_id: m.stats for m in state.members.values()},
                             lag=lag, staleness=_ints(staleness),
                             version=version, freshness_s=freshness, previous=last, tables=tables)
        self.history.add(sample)
        self.progressive.pool(t_ms)
        return sample

    def start(self, store: Store) -> None:
        """Start sampling the job of ``store`` in a background task (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(store), name="history-sampler")

    async def _run(self, store: Store) -> None:
        """Take a sample every :data:`SAMPLE_INTERVAL_S` until closed; a failed tick is
        skipped (logged once per kind of failure in a row)."""
        failing: type[BaseException] | None = None
        while not self._closing:
            started = time.monotonic()
            try:
                await self.sample_once(store)
                failing = None
            except asyncio.CancelledError:
                raise
            except REDIS_DOWN as exc:  # the lease checker logs the outage and gives up after its limit
                if failing is not type(exc):
                    logger.info("history: no sample while Redis is unreachable (%s)", exc)
                failing = type(exc)
            except Exception as exc:  # the history must never end the coordinator
                if failing is not type(exc):
                    logger.exception("history: sample of job %s failed", self._settings.job)
                failing = type(exc)
            await asyncio.sleep(max(0.0, SAMPLE_INTERVAL_S - (time.monotonic() - started)))

    async def close(self) -> None:
        """Stop sampling, then close the sampler's Kafka consumer and thread."""
        self._closing = True
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._probe.close)
        self._executor.shutdown(wait=True)
