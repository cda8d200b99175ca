"""The replica as a service: its state, kept up to date by following the feed, and a request's path
through it.

:class:`Replica` loads a first state (an export folder, or its own export from Redis), then reads
``GET /v1/model/updates`` from the state's position until an answer reaches every group's head and
applies the run in one step. A moved-on feed (``feed_gone``, ``position_not_found``) makes it load a new
state while the old one keeps serving; an unreachable coordinator or Redis leaves it serving its last
state, counting the staleness. See docs/serving.md, *The serving replica*.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import aiohttp
import numpy as np
import redis
import safetensors.torch
import torch

from common.outage import REDIS_DOWN
from services.errors import LayoutError
from services.slot_types import VersionVector
from services.slots import ModelMeta, NoModelError, read_meta
from services.store import connect
from services.tables.feed import DecodedChanges, changes_from_safetensors
from services.tables.store import pull_rows
from trainers.models import ModelSpec, build_model

from .loader import ExportFolderError, feed_position, state_from_folder, state_from_redis
from .metrics import ServeMetrics
from .protocol import Batch, Signature, join_batches, model_outputs
from .report import LatencyWindow, ServedScores, served_auc, served_calibration
from .settings import ServeSettings
from .state import ModuleFactory, ServedState, score, signature_of

logger = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["Replica", "FeedRefused", "PlaneUnavailable", "Prediction"]

MOST_ANSWERS = 10000
"""Most feed answers one catch-up gathers before it applies them (a run longer than this is applied in
parts: still no request sees half of an answer)."""
_RELOAD_CODES = frozenset({"feed_gone", "position_not_found"})


class FeedRefused(Exception):
    """The coordinator refused a read (``code``: its error code; ``feed_gone`` and ``position_not_found``
    mean the state must be loaded anew)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code = status, code


class PlaneUnavailable(Exception):
    """A request needs rows from Redis (a bounded store's misses) and Redis cannot be reached."""


@dataclass(frozen=True)
class Prediction:
    """A request's answer."""

    outputs: dict[str, np.ndarray]
    """Output name -> values."""
    version: str
    """The version of the state that answered."""
    misses: int
    """Rows read from the parameter plane for it (bounded stores)."""


class Replica:
    """One serving replica of a job's model."""

    def __init__(self, settings: ServeSettings, *, spec: ModelSpec | None = None) -> None:
        self.settings = settings
        self.spec = spec if spec is not None else build_model(settings.model)
        self.spec.model.eval()
        self.signature: Signature = signature_of(self.spec, settings.job, max_records=settings.max_records)
        self.factory = ModuleFactory(self.spec)
        self.metrics = ServeMetrics()
        self.state: ServedState | None = None
        """The state requests read (None until the first is loaded and caught up)."""
        self.meta: ModelMeta | None = None
        self.reloads = 0
        """States loaded after the first (the feed moved past the state's position)."""
        self.caught_up_at: float | None = None
        """``time.monotonic()`` of the last read that reached every group's head."""
        self.last_error = ""
        """Why the last read of the feed failed (empty once one succeeds)."""
        self.failure: str | None = None
        """Why the replica cannot serve this job at all (another model, a bad export folder): it stops."""
        self._client: redis.Redis | None = None
        self._session: aiohttp.ClientSession | None = None
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="serve-io")
        self._task: asyncio.Task[None] | None = None
        self._reporter: asyncio.Task[None] | None = None
        self.scores = ServedScores()
        """Labelled records answered: the served AUC."""
        self.latency = LatencyWindow()
        self.requests = 0
        """Prediction requests answered (any status)."""
        self.records = 0
        """Records scored."""
        self.address = ""
        """``host:port`` the replica listens on (set once bound: its default name and URL)."""
        self._pending: deque[tuple[Batch, asyncio.Future[Prediction]]] = deque()
        self._batcher: asyncio.Task[None] | None = None
        self._auc: float | None = None
        self._calibration: tuple[float | None, float | None] = (None, None)
        self._auc_seen = 0
        self._auc_at = -1e9

    # -- life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start following (the first state loads in the background; :attr:`ready` says when)."""
        torch.set_num_threads(self.settings.threads)
        self._client = connect(self.settings.redis_url, socket_connect_timeout=5.0, socket_timeout=30.0)
        self._session = aiohttp.ClientSession(
            base_url=self.settings.coordinator_url.rstrip("/") + "/",
            headers={"Authorization": f"Bearer {self.settings.job_token}"},
            timeout=aiohttp.ClientTimeout(total=60.0, connect=5.0))
        self._task = asyncio.create_task(self._follow(), name="serve-follow")
        if self.settings.report_every_s > 0:
            self._reporter = asyncio.create_task(self._report(), name="serve-report")

    async def close(self) -> None:
        """Stop following and release the connections (idempotent)."""
        for task in (self._task, self._reporter):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._reporter = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.get_running_loop().run_in_executor(None, self._io.shutdown, True)
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- what it serves --------------------------------------------------------------------------

    @property
    def staleness_s(self) -> float | None:
        """Seconds since the feed was last read up to its head (None before the first state)."""
        return None if self.caught_up_at is None else time.monotonic() - self.caught_up_at

    @property
    def ready(self) -> bool:
        """A state is loaded and the feed was read up to its head within ``--max-staleness-s``."""
        stale = self.staleness_s
        return self.state is not None and stale is not None and stale <= self.settings.max_staleness_s

    async def predict(self, batch: Batch) -> Prediction:
        """Score ``batch`` from the current state (rows a bounded store lacks read from Redis, once).

        Requests that arrive while one is scored wait and are scored together, in one lookup and one
        forward pass over their records (dynamic batching: under load a request's fixed cost is shared;
        idle, a request waits for nothing), from one state.

        Raises:
            RuntimeError: no state is loaded yet.
            PlaneUnavailable: rows it must read from Redis cannot be read.
        """
        if self.state is None:
            raise RuntimeError("the replica has no state yet")
        done: asyncio.Future[Prediction] = asyncio.get_running_loop().create_future()
        self._pending.append((batch, done))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._score_pending(), name="serve-batch")
        return await done

    async def _score_pending(self) -> None:
        """Score what waits, a batch of at most ``--max-records`` records at a time, until nothing does."""
        while self._pending:
            await asyncio.sleep(0)  # handlers already woken enqueue theirs first
            taken: list[tuple[Batch, asyncio.Future[Prediction]]] = []
            records = 0
            while self._pending and (not taken or records + self._pending[0][0].n <= self.settings.max_records):
                item = self._pending.popleft()
                taken.append(item)
                records += item[0].n
            try:
                answers = await self._score([b for b, _ in taken])
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error, none is left hanging
                for _, done in taken:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for (_, done), answer in zip(taken, answers, strict=True):
                if not done.done():
                    done.set_result(answer)

    async def _score(self, batches: list[Batch]) -> list[Prediction]:
        """The answers of ``batches``, scored together from one state."""
        state = self.state
        if state is None:
            raise RuntimeError("the replica has no state yet")
        batch = batches[0] if len(batches) == 1 else join_batches(batches)
        lookup = state.lookup(batch)
        misses = 0
        if lookup.wanted:
            wanted = lookup.wanted_ids()
            try:
                pulled = await self._call(pull_rows, self._plane_client(), self.settings.job, state.specs,
                                          self._groups(), wanted)
            except REDIS_DOWN as exc:
                raise PlaneUnavailable(f"rows not held by this replica (--max-rows) are read from Redis, which "
                                       f"is unreachable: {exc}") from None
            for name, got in pulled.tables.items():
                lookup.fill(name, got.ids, got.values)
                state.insert_read(name, got.ids, got.values, got.versions, got.present)
                misses += int(got.ids.size)
            self.metrics.misses.inc(misses)
        outputs = model_outputs(self.signature, score(lookup))
        self.metrics.records.inc(batch.n)
        self.records += batch.n
        if len(batches) == 1:
            return [Prediction(outputs, lookup.version, misses)]
        answers, start = [], 0
        for b in batches:
            answers.append(Prediction({k: v[start:start + b.n] for k, v in outputs.items()}, lookup.version, misses))
            start += b.n
        return answers

    async def served_auc(self) -> float | None:
        """The AUC of the labelled records answered (recomputed, off the event loop, at most every 2 s)."""
        await self._rescore()
        return self._auc

    async def served_calibration(self) -> dict[str, float | None]:
        """The calibration of the labelled records answered, as the replica's status shows it:
        ``served_mean_predicted`` (mean sigmoid of their logits) and ``served_observed_rate`` (fraction
        of positives), over the records the served AUC covers (recomputed with it)."""
        await self._rescore()
        predicted, observed = self._calibration
        return {"served_mean_predicted": predicted, "served_observed_rate": observed}

    async def _rescore(self) -> None:
        """Recompute the served AUC and calibration, off the event loop, at most every 2 s."""
        now = time.monotonic()
        if self.scores.seen != self._auc_seen and now - self._auc_at >= 2.0:
            self._auc_seen, self._auc_at = self.scores.seen, now
            labels, logits = self.scores.arrays()

            def score() -> tuple[float | None, tuple[float | None, float | None]]:
                return served_auc(labels, logits), served_calibration(labels, logits)

            self._auc, self._calibration = await asyncio.get_running_loop().run_in_executor(None, score)

    def observe_labels(self, labels: np.ndarray, outputs: Mapping[str, np.ndarray]) -> None:
        """Count labelled records answered toward the served AUC (a binary model's; others ignore them)."""
        if self.signature.kind == "binary" and "logit" in outputs:
            self.scores.observe(np.asarray(labels, dtype=np.float64), outputs["logit"])

    def observe_request(self, seconds: float) -> None:
        """One prediction request answered in ``seconds``."""
        self.requests += 1
        self.latency.observe(seconds)

    def report(self) -> dict[str, object]:
        """What the replica reports to the coordinator (``POST /v1/serving/replicas/<name>``)."""
        state = self.state
        stale = self.staleness_s
        return {"url": self.settings.url or f"http://{self.address}", "version": state.version if state else None,
                "staleness_s": None if stale is None else round(stale, 3), "ready": self.ready,
                "rows": state.rows if state else 0, "misses": state.misses if state else 0, "reloads": self.reloads,
                "requests": self.requests, "records": self.records, "latency_p99_ms": self.latency.take_p99_ms(),
                "served_auc": None, "labelled": self.scores.seen}

    async def _report(self) -> None:
        """Send :meth:`report` to the coordinator every ``--report-every-s`` (a failure is logged once)."""
        failing = False
        while True:
            await asyncio.sleep(self.settings.report_every_s)
            name = self.settings.name or self.address
            if not name or self._session is None:
                continue
            try:
                body = self.report()
                body["served_auc"] = await self.served_auc()
                async with self._session.post(f"v1/serving/replicas/{name}", json=body) as resp:
                    if resp.status >= 300:
                        raise FeedRefused(resp.status, "report_refused", (await resp.text())[:200])
                failing = False
            except asyncio.CancelledError:
                raise
            except (FeedRefused, aiohttp.ClientError, OSError, TimeoutError) as exc:
                if not failing:
                    logger.warning("job %s: cannot report to the coordinator: %s", self.settings.job, exc)
                failing = True

    # -- following the feed ----------------------------------------------------------------------

    def _plane_client(self) -> redis.Redis:
        if self._client is None:
            raise RuntimeError("the replica is not started")
        return self._client

    def _groups(self) -> int:
        if self.meta is None:
            raise RuntimeError("the replica has no model meta yet")
        return self.meta.groups

    async def _call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the replica's I/O threads."""
        return await asyncio.get_running_loop().run_in_executor(self._io, functools.partial(fn, *args, **kwargs))

    async def _get(self, path: str, params: Mapping[str, str] | None = None) -> tuple[bytes, Mapping[str, str]]:
        if self._session is None:
            raise RuntimeError("the replica is not started")
        async with self._session.get(path, params=params) as resp:
            body = await resp.read()
            if resp.status != 200:
                try:
                    err = json.loads(body)["error"]
                    code, message = str(err["code"]), str(err["message"])
                except (ValueError, KeyError, TypeError):
                    code, message = "http_error", body[:200].decode(errors="replace")
                raise FeedRefused(resp.status, code, message)
            return body, resp.headers

    async def _dense(self) -> tuple[dict[str, torch.Tensor], str]:
        """The dense part now, from the coordinator's ``GET /v1/model``."""
        body, headers = await self._get("v1/model")
        return safetensors.torch.load(body), headers.get("X-Model-Version", "")

    async def _catch_up(self, position: str) -> list[DecodedChanges]:
        """Feed answers from ``position`` until one reaches every group's head (at most :data:`MOST_ANSWERS`)."""
        answers: list[DecodedChanges] = []
        while len(answers) < MOST_ANSWERS:
            body, _ = await self._get("v1/model/updates", {"since": position})
            answer = (changes_from_safetensors(body) if len(body) < (1 << 20)
                      else await self._call(changes_from_safetensors, body))
            answers.append(answer)
            position = answer.position
            if not answer.more:
                break
        return answers

    async def _load(self, reason: str) -> ServedState:
        """A new state, caught up to the feed's head (not yet installed)."""
        meta = await self._call(read_meta, self._plane_client(), self.settings.job)
        self._check_meta(meta)
        self.meta = meta
        folder = self.settings.export_dir if reason == "start" and self.settings.export_dir else ""
        # the dense part is read after the position is fixed (the folder's is older still): a dense change
        # it misses comes after the position, and the feed brings it
        if folder:
            dense, dense_version = await self._dense()
            state = await self._call(state_from_folder, folder, self.settings.job, meta, dense, dense_version,
                                     self.factory, max_rows=self.settings.max_rows)
        else:
            position = await self._call(feed_position, self._plane_client(), self.settings.job, meta.groups)
            dense, dense_version = await self._dense()
            state = await self._call(state_from_redis, self._plane_client(), self.settings.job, meta, dense,
                                     dense_version, self.factory, position=position,
                                     max_rows=self.settings.max_rows)
        self._apply(state, await self._catch_up(state.position))
        self.metrics.reloads.labels(reason).inc()
        return state

    def _check_meta(self, meta: ModelMeta) -> None:
        """The job's tables are the model spec's (else the replica would serve another model)."""
        ours = {t.name: t.dim for t in self.spec.tables}
        theirs = {t.name: t.dim for t in meta.tables}
        if ours != theirs:
            raise LayoutError(f"job {self.settings.job}'s tables {theirs} are not those of model spec "
                              f"{self.settings.model!r} ({ours}): start the replica with the job's --model")

    def _apply(self, state: ServedState, answers: list[DecodedChanges]) -> None:
        applied = state.apply(answers, self.factory)
        self.caught_up_at = time.monotonic()
        if applied.entries and applied.newest_applied_ms:
            self.metrics.freshness.observe(max(0.0, time.time() - applied.newest_applied_ms / 1000))

    def publish(self) -> None:
        """Set the gauges (version, rows, bytes, staleness, ready) from the current state."""
        state = self.state
        m = self.metrics
        if state is None:
            m.ready.set(0)
            return
        for g, v in enumerate(VersionVector.parse(state.version, len(state.version.split(".")))
                              if state.version else ()):
            m.version.labels(str(g)).set(v)
        for name, store in state.tables.items():
            m.rows.labels(name).set(store.rows)
        m.row_bytes.set(state.nbytes)
        stale = self.staleness_s
        m.staleness.set(stale if stale is not None else 0)
        m.ready.set(1 if self.ready else 0)

    async def _follow(self) -> None:
        """Load, then follow the feed until cancelled."""
        reason: str | None = "start"
        outage_since: float | None = None
        while True:
            try:
                if reason is not None:
                    state = await self._load(reason)
                    if reason != "start":
                        self.reloads += 1
                    logger.info("job %s: serving %d row(s) at version %s (feed position %s, %s)", self.settings.job,
                                state.rows, state.version, state.position, reason)
                    self.state, reason = state, None
                    # the model, the stores and the libraries are here for good: out of the collector's
                    # sight, so a collection walks a request's objects only (no pause of the loop for them)
                    gc.freeze()
                else:
                    current = self.state
                    assert current is not None
                    answers = await self._catch_up(current.position)
                    if self.state is current:  # not replaced meanwhile
                        self._apply(current, answers)
                if outage_since is not None:
                    logger.info("job %s: the feed answers again after %.1f s", self.settings.job,
                                time.monotonic() - outage_since)
                    outage_since = None
                self.last_error = ""
                self.publish()
                await asyncio.sleep(self.settings.poll_interval_s)
            except asyncio.CancelledError:
                raise
            except FeedRefused as exc:
                if exc.code in _RELOAD_CODES:
                    logger.warning("job %s: %s; loading the tables anew (the current state keeps serving)",
                                   self.settings.job, exc)
                    reason = "feed_gone"
                    self.metrics.feed_errors.labels(exc.code).inc()
                    continue
                outage_since = self._outage(outage_since, exc, exc.code)
            except NoModelError as exc:
                outage_since = self._outage(outage_since, exc, "no_model")
            except (LayoutError, ExportFolderError) as exc:  # not this job's model, or a folder not of it
                self.failure = str(exc)
                logger.error("job %s: cannot serve: %s", self.settings.job, exc)
                self.publish()
                return
            except (TimeoutError, aiohttp.ClientError, OSError, *REDIS_DOWN) as exc:
                outage_since = self._outage(outage_since, exc, "unreachable")
            except Exception as exc:  # anything else (a feed answer it cannot read, a Redis error): try again,
                # serving the last state meanwhile; an exception here must not end the task silently, or the
                # replica would serve one state for ever, its staleness growing with nothing in its log
                if outage_since is None:
                    logger.exception("job %s: following the feed failed", self.settings.job)
                outage_since = self._outage(outage_since, exc, "error")
            self.publish()
            await asyncio.sleep(min(1.0, max(self.settings.poll_interval_s, 0.2)))

    def _outage(self, since: float | None, exc: BaseException, kind: str) -> float:
        self.metrics.feed_errors.labels(kind).inc()
        self.last_error = f"{kind}: {exc}"
        if since is None:
            logger.warning("job %s: cannot read the feed (%s); serving the last state (version %s) meanwhile",
                           self.settings.job, self.last_error,
                           self.state.version if self.state is not None else "none yet")
            return time.monotonic()
        return since
