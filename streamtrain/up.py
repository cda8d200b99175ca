"""``streamtrain up``: everything up locally, training a real model from a real stream.

Starts a real Kafka broker and Redis server on loopback, the coordinator, a
parameter server, the trainers and a producer streaming the digits data set
(:class:`streamtrain.cluster.LocalCluster`); shows a live view; stops when the
held-out accuracy reaches the target (or the stream, up to ``--max-records``, is
consumed, or time runs out); scores the final parameters itself on the held-out split; and stops
everything it started, also on Ctrl-C and on error.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from . import settings as cfg
from .cluster import ClusterSpec, LocalCluster
from .outage import REDIS_DOWN, Outage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpSettings:
    """Settings of the local main job."""

    trainers: int = cfg.setting(2, env="STREAMTRAIN_TRAINERS", min=1, max=64, help="trainer processes")
    partitions: int = cfg.setting(4, env="STREAMTRAIN_PARTITIONS", min=1, max=256,
                                  help="partitions of the training topic")
    consistency: str = cfg.setting("ssp", env="STREAMTRAIN_CONSISTENCY", choices=("bsp", "ssp", "asp"),
                                   help="consistency model")
    staleness: int = cfg.setting(2, env="STREAMTRAIN_STALENESS", min=0, help="SSP staleness bound")
    codec: str = cfg.setting(ClusterSpec.codec, env="STREAMTRAIN_CODEC", help="gradient codec")
    optimizer: str = cfg.setting(ClusterSpec.optimizer, env="STREAMTRAIN_OPTIMIZER",
                                 choices=("sgd", "adam", "lazyadam", "dgc"),
                                 help="optimizer: lazyadam or dgc for a top-k codec (sparse), sgd or adam (dense)")
    lr: float = cfg.setting(ClusterSpec.lr, env="STREAMTRAIN_LR", min=0.0, max=10.0, help="learning rate")
    source: str = cfg.setting("digits?repeat=60", env="STREAMTRAIN_SOURCE",
                              help="what the producer streams (its train split)")
    model: str = cfg.setting("digits-mlp", env="STREAMTRAIN_MODEL", help="model spec of the trainers")
    eval_source: str = cfg.setting("digits", env="STREAMTRAIN_EVAL_SOURCE",
                                   help="held-out data (its test split)")
    target_accuracy: float = cfg.setting(0.95, env="STREAMTRAIN_TARGET_ACCURACY", min=0.0, max=1.0,
                                         help="stop once the held-out accuracy reaches this")
    max_records: int = cfg.setting(0, env="STREAMTRAIN_MAX_RECORDS", min=0,
                                   help="stop once this many records are produced and trained on (0: no limit)")
    timeout_s: float = cfg.setting(600.0, env="STREAMTRAIN_UP_TIMEOUT_S", min=1.0,
                                   help="give up after this long")
    forever: bool = cfg.setting(False, env="STREAMTRAIN_FOREVER",
                                help="online continuous training: stream forever until Ctrl-C")
    outage_limit_s: float = cfg.setting(60.0, env="STREAMTRAIN_OUTAGE_LIMIT_S", min=0.1,
                                        help="longest Redis outage the live view rides out before giving up")
    kafka_heap_mb: int = cfg.setting(512, env="STREAMTRAIN_KAFKA_HEAP_MB", min=128,
                                     help="heap of the local Kafka broker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``streamtrain up``."""
    cfg.add_arguments(parser, UpSettings)


def cluster_spec(s: UpSettings) -> ClusterSpec:
    """The local topology for these settings."""
    source = s.source
    if s.forever and source.split("?")[0] == "digits":
        source = "digits?repeat=0"  # online continuous training: the data set, pass after pass
    return ClusterSpec(trainers=s.trainers, partitions=s.partitions, consistency=s.consistency,
                       staleness=s.staleness, codec=s.codec, optimizer=s.optimizer, lr=s.lr, source=source,
                       model=s.model,
                       eval_source=s.eval_source, kafka_heap_mb=s.kafka_heap_mb,
                       limit=s.max_records or None)


def run(args: argparse.Namespace) -> int:
    """Run the local main job; 0 when the target accuracy was reached (or --forever ended)."""
    settings = cfg.from_args(UpSettings, args)
    console = Console()
    cluster = LocalCluster(cluster_spec(settings))
    reached = False
    try:
        with console.status("starting Kafka (KRaft), Redis, coordinator, parameter server, "
                            f"{settings.trainers} trainers and the producer"):
            cluster.start()
        console.print(f"Kafka {cluster.bootstrap} (ready in {cluster.kafka.ready_after_s:.1f}s) · "
                      f"Redis {cluster.redis.display_url} · coordinator {cluster.coordinator_url} · "
                      f"logs in {cluster.workdir}")
        final: dict[str, Any] = {}
        reached = _watch(console, cluster, settings, final)  # final: the score that ended it
        if not reached:  # the stream ended, time ran out or Ctrl-C: score what training left
            with console.status("draining trainers and applying their last updates"):
                cluster.quiesce()
            final.update(_score(cluster, settings) or {})
        final["status"] = cluster.status()
    finally:
        with console.status("stopping everything"):
            cluster.stop()
    _print_final(console, cluster, settings, final, reached)
    cluster.cleanup()
    return 0 if reached or settings.forever else 1


def _watch(console: Console, cluster: LocalCluster, s: UpSettings, latest: dict[str, Any]) -> bool:
    """Show the live view until the target, the end of the stream, Ctrl-C or the timeout.

    ``latest`` receives the newest independent score of the stored parameters.
    """
    t0 = time.monotonic()
    status: dict[str, Any] | None = None
    outage = Outage("Redis of the local job", s.outage_limit_s, logger)
    try:
        with Live(console=console, refresh_per_second=4) as live:
            while time.monotonic() - t0 < s.timeout_s or s.forever:
                cluster.raise_if_crashed()
                status = cluster.status() or status
                score = _score(cluster, s, outage)
                if score is not None:
                    latest.update(score)
                if status is not None:
                    live.update(_view(status, latest, time.monotonic() - t0))
                    acc = latest.get("accuracy")
                    if not s.forever and acc is not None and acc >= s.target_accuracy:
                        return True
                    if not s.forever and cluster.consumed(status):
                        return False
                time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("interrupted: stopping")
    return False


def _view(st: dict[str, Any], score: dict[str, Any], elapsed: float) -> Group:
    """The live tables: the job (with the independent held-out score), then one row per trainer."""
    job = Table(title=f"job {st.get('job')} · {elapsed:.0f}s", expand=False)
    for col in ("records/s", "loss", "held-out acc", "version", "generation", "lag", "staleness"):
        job.add_column(col, justify="right")
    versions = st.get("versions", {})
    job.add_row(f"{st.get('throughput_records_per_s', 0):,.0f}", _fmt(st.get("loss")),
                _fmt(score.get("accuracy"), ".1%"), str(versions.get("max", "-")), str(st.get("generation")),
                str(st.get("lag")), str(st.get("staleness", {}).get("clock_spread", "-")))
    members = Table(title="trainers", expand=False)
    for col in ("member", "state", "device", "partitions", "records/s", "loss", "acc", "clock"):
        members.add_column(col)
    for m in st.get("members", []):
        stats = m.get("stats", {})
        members.add_row(m["member_id"], m["state"], str(m.get("capabilities", {}).get("device", "")),
                        ",".join(map(str, m.get("partitions", []))),
                        f"{stats.get('records_per_s', 0):,.0f}", _fmt(stats.get("loss")),
                        _fmt(stats.get("accuracy"), ".1%"), str(stats.get("clock", "")))
    return Group(job, members)


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _score(cluster: LocalCluster, s: UpSettings, outage: Outage | None = None) -> dict[str, Any] | None:
    """Score the parameters stored in Redis now on the held-out split (not a trainer's word).

    None when there is no model yet, or while Redis is unreachable (``outage`` then logs its
    start and end, and raises once it outlasts its limit).
    """
    from services import LayoutError
    from trainers import score_job

    try:
        result = score_job(cluster.redis_url, cluster.spec.job, s.model, s.eval_source)
    except LayoutError:  # no model stored yet
        return None
    except REDIS_DOWN as exc:
        if outage is None:
            raise
        outage.failed(exc)
        return None
    if outage is not None:
        outage.recovered()
    return {"version": result.version, "accuracy": result.accuracy, "loss": result.loss,
            "samples": result.samples}


def _print_final(console: Console, cluster: LocalCluster, s: UpSettings, final: dict[str, Any],
                 reached: bool) -> None:
    st = final.get("status") or {}
    parts = st.get("partitions", [])
    committed = sum(p["committed"] or 0 for p in parts)
    table = Table(title="final", show_header=False)
    verdict = ("continuous training (--forever) until stopped" if s.forever else
               f"target {s.target_accuracy:.0%}: {'reached' if reached else 'NOT reached'}")
    table.add_row("held-out accuracy", _fmt(final.get("accuracy"), ".2%")
                  + f" on {final.get('samples', 0)} records ({verdict})")
    table.add_row("held-out loss", _fmt(final.get("loss")))
    table.add_row("model version", str(final.get("version", "-")))
    table.add_row("messages committed", f"{committed:,} Kafka offsets over {len(parts)} partitions")
    table.add_row("status endpoints", f"{cluster.coordinator_url}/v1/status · /healthz · /readyz · "
                  "/metrics · / (page) — served while the job ran")
    console.print(table)
