"""Prometheus metrics of one trainer, in its own registry (served on ``--metrics-port``).

Most series are read when Prometheus scrapes, from a :class:`TrainerReport` the trainer builds
on demand, so the training loop carries one hook only (the bytes of each push, by codec). What the trainer
exports is what only it sees: its steps and loss, the records its consumer took and
dead-lettered, its partitions' lag as its consumer sees it, and the staleness of the
parameters it computed on (``streamtrain_ssp_*``, the histograms of
:mod:`services.consistency`). Job-wide views stay in the coordinator; see ``docs/metrics.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from datastream.consumer import ConsumerStats
from services.consistency import STALENESS, WAIT_SECONDS

from .evaluate import EvalResult
from .progressive import WindowScore
from .rowcache import CacheStats

__all__ = ["TrainerMetrics", "TrainerReport"]


@dataclass(frozen=True)
class TrainerReport:
    """What a trainer's metrics show, as it stands when Prometheus scrapes."""

    steps: int
    """Training steps computed."""
    clock: int
    """Clock of the next step."""
    staleness: int
    """Staleness (clocks) of the parameters of the last step."""
    loss: float | None
    """Training loss, moving average (None before the first step)."""
    version: int | None
    """Model version of the replica (None before the first pull)."""
    last_eval: EvalResult | None
    """The last held-out evaluation."""
    consumer: ConsumerStats | None
    """The consumer's counters and lag (None before it exists)."""
    row_cache: CacheStats | None = None
    """The row cache's lookups (None for a model without embedding tables)."""
    row_pull_bytes: int = 0
    """Bytes of rows and masks its pulls of embedding rows read."""
    progressive: WindowScore | None = None
    """The newest progressive-validation window (binary models; None before the first)."""


class _Collector(Collector):
    """The trainer's own state, read at scrape time."""

    def __init__(self, read: Callable[[], TrainerReport]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        t = self._read()
        steps = CounterMetricFamily("streamtrain_trainer_steps", "training steps this trainer computed")
        steps.add_metric([], t.steps)
        yield steps
        gauges: list[tuple[str, str, float]] = [
            ("streamtrain_trainer_clock", "clock of this trainer's next step", t.clock),
            ("streamtrain_trainer_staleness_clocks", "staleness (clocks) of the parameters of the last step",
             t.staleness)]
        if t.loss is not None and math.isfinite(t.loss):
            gauges.append(("streamtrain_trainer_loss", "training loss (moving average over steps)", t.loss))
        if t.version is not None:
            gauges.append(("streamtrain_trainer_model_version", "model version of the replica's parameters",
                           t.version))
        if t.last_eval is not None:
            gauges.append(("streamtrain_trainer_eval_loss", "held-out loss at the last evaluation",
                           t.last_eval.loss))
            if t.last_eval.accuracy is not None:
                gauges.append(("streamtrain_trainer_accuracy", "held-out accuracy at the last evaluation",
                               t.last_eval.accuracy))
        if t.last_eval is not None and t.last_eval.auc is not None:
            gauges.append(("streamtrain_trainer_auc", "held-out AUC at the last evaluation (binary tasks)",
                           t.last_eval.auc))
        if t.progressive is not None:
            if t.progressive.auc is not None:
                gauges.append(("streamtrain_trainer_progressive_auc", ("AUC of the newest progressive-validation "
                               "window: records scored by the training forward pass, before training on them"),
                               t.progressive.auc))
            if math.isfinite(t.progressive.log_loss):
                gauges.append(("streamtrain_trainer_progressive_log_loss", "log loss of the same window",
                               t.progressive.log_loss))
            gauges.append(("streamtrain_trainer_progressive_records", ("records this trainer had scored when "
                           "the newest progressive-validation window closed"), t.progressive.records))
        if t.row_cache is not None:
            gauges.append(("streamtrain_row_cache_rows", "embedding rows this trainer's cache holds",
                           t.row_cache.rows))
            if t.row_cache.hit_rate is not None:
                gauges.append(("streamtrain_row_cache_hit_rate", ("fraction of the rows its batches needed that "
                               "this trainer's cache served (since it started)"), t.row_cache.hit_rate))
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        if t.row_cache is not None:
            for name, doc, value in (("streamtrain_row_cache_hits", "embedding rows served by the cache",
                                      t.row_cache.hits),
                                     ("streamtrain_row_cache_misses",
                                      "embedding rows pulled (not served by the cache)", t.row_cache.misses),
                                     ("streamtrain_row_pull_bytes", ("bytes the pulls of embedding rows read (rows "
                                      "and one mask byte per ID asked)"), t.row_pull_bytes)):
                counter = CounterMetricFamily(name, doc)
                counter.add_metric([], value)
                yield counter
        if t.consumer is None:
            return
        stats = t.consumer
        for name, doc, value in (
                ("streamtrain_messages_consumed", "Kafka messages consumed (rejected ones included)",
                 stats.messages),
                ("streamtrain_records_consumed", "records handed to training in batches", stats.records),
                ("streamtrain_rejected_records", "records rejected to the dead-letter topic",
                 stats.rejected_records)):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], value)
            yield counter
        dead = CounterMetricFamily("streamtrain_dead_letters",
                                   "messages written to the dead-letter topic, by reason", labels=["reason"])
        for reason, n in sorted(stats.rejected_by_reason.items()):
            dead.add_metric([reason], n)
        yield dead
        lag = GaugeMetricFamily("streamtrain_partition_lag",
                                "messages between this trainer's consumer position and the end of each "
                                "partition it consumes", labels=["partition"])
        for p, n in sorted(stats.lag.items()):
            lag.add_metric([str(p)], n)
        yield lag


class TrainerMetrics:
    """The metrics of one trainer: ``read`` builds its :class:`TrainerReport` at each scrape, and the
    trainer calls :meth:`pushed` for each committed push."""

    def __init__(self, read: Callable[[], TrainerReport]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._wire = Counter("streamtrain_pushed_bytes", "encoded gradient bytes pushed, by codec", ["codec"],
                             registry=r)
        self._raw = Counter("streamtrain_pushed_fp32_bytes",
                            "the same gradients as float32 (wire bytes over these: the compression), by codec",
                            ["codec"], registry=r)
        self._pushes = Counter("streamtrain_pushes", "updates pushed, by codec", ["codec"], registry=r)
        r.register(_Collector(read))
        # process-wide histograms observed by every clock wait of this process
        r.register(STALENESS)
        r.register(WAIT_SECONDS)

    def pushed(self, codec: str, wire_bytes: int, raw_bytes: int) -> None:
        """Count one push of ``wire_bytes`` encoded with ``codec`` (``raw_bytes`` as float32)."""
        self._wire.labels(codec).inc(wire_bytes)
        self._raw.labels(codec).inc(raw_bytes)
        self._pushes.labels(codec).inc()
