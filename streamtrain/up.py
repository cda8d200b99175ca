"""``streamtrain up``: everything up locally, training a real model from a real stream.

Starts real Kafka and Redis servers on loopback and the job's services (:class:`streamtrain.cluster.LocalCluster`),
shows a live view, scores the parameters in Redis itself on the held-out split until a target, the stream or the
time ends (or, with ``--forever``, Ctrl-C), hands over its credentials meanwhile, and stops everything it started.
With ``--serve N`` (one by default) it runs serving replicas, the first scoring a sample of the records before
they are produced, and shows what they serve (version, lag, served AUC); every process serves Prometheus
metrics on a port of its own, listed in a file-based discovery file beside the credentials.
See README.md, *The main job*, and docs/online.md, *Scoring and when `up` stops* (the exit status).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from common import settings as cfg
from common.outage import REDIS_DOWN, Outage
from coordinator.progressive import mean_auc
from datastream.clickevents import click_stream
from datastream.settings import EventsSettings, JoinSettings
from datastream.sources import one_pass
from services.local_steps import check_dense_model, check_local_steps

from .cluster import ClusterSpec, LocalCluster
from .credentials import (
    CREDENTIALS_NAME,
    TARGETS_NAME,
    prometheus_targets,
    shell_exports,
    write_credentials,
    write_targets,
)
from .examples import with_example
from .overload import LagWindow, Trend, Verdict, sample_from_status
from .settings import FOREVER_RATE, UpSettings

logger = logging.getLogger(__name__)

LAG_WINDOW_S = 30.0
"""Seconds of lag samples the keeping-up verdict fits (``docs/online.md``)."""
REPLICA_TIMEOUT_S = 0.5
"""Longest wait for a serving replica's ``GET /v1/replica`` at each refresh of the live view."""


@dataclass(frozen=True)
class Task:
    """What the job's model is, which decides its scores and targets."""

    classification: bool
    """A classifier: it has an accuracy."""
    binary: bool = False
    """A binary classifier (one logit per record): it has an AUC and a log loss too."""


class Outcome(str, Enum):
    """Why the live view stopped."""

    TARGET = "target"
    """A held-out target (accuracy, loss) was reached."""
    CONSUMED = "consumed"
    """The stream (up to ``--max-records``) was produced and trained on."""
    TIMEOUT = "timeout"
    """``--timeout-s`` passed first."""
    INTERRUPTED = "interrupted"
    """Ctrl-C."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``streamtrain up``."""
    cfg.add_arguments(parser, UpSettings)


def cluster_spec(s: UpSettings, environ: Mapping[str, str] | None = None) -> ClusterSpec:
    """The local topology for these settings.

    The services' other settings are the local defaults with any ``STREAMTRAIN_*`` variable of
    ``environ`` (default: ours) over them, as each service would read it (e.g. ``STREAMTRAIN_DEVICE``
    for the trainers); ``s`` decides the rest.
    """
    base = ClusterSpec().with_environment(os.environ if environ is None else environ)
    source = s.source
    if s.forever and source.split("?")[0] in ("digits", "movielens"):
        source = one_pass(source)  # online continuous training: the data set, pass after pass
        source += ("&" if "?" in source else "?") + "repeat=0"
    rate = s.rate if s.rate is not None else (FOREVER_RATE if s.forever else None)
    assert base.producer is not None
    job = base.job if s.example == "digits" else s.example  # the example names its job and topic
    spec = replace(
        base, job=job, topic=job if job != base.job else base.topic, trainers=s.trainers,
        kafka_heap_mb=s.kafka_heap_mb, kafka_brokers=s.kafka_brokers,
        redis_cluster=s.redis_cluster, replicas=s.serve, score_served=True, metrics_ports=True,
        coordinator=replace(base.coordinator, partitions=s.partitions, consistency=s.consistency,
                            staleness=s.staleness, codec=s.codec, optimizer=s.optimizer, lr=s.lr,
                            ps_groups=s.ps_groups, table_consistency=s.table_consistency,
                            table_staleness=s.table_staleness, local_steps=s.local_steps,
                            outer_lr=s.outer_lr, outer_momentum=s.outer_momentum),
        trainer=replace(base.trainer, model=s.model, eval_source=held_out(s), topk_density=s.topk_density,
                        dense_below=s.dense_below, density_warmup_steps=s.density_warmup_steps),
        producer=replace(base.producer, source=source, limit=s.max_records or None, rate=rate or None))
    if not s.join:
        return spec
    return replace(spec, producer=None, events=join_events(s, rate), join=JoinSettings(
        impressions=f"{job}.impressions", feedback=f"{job}.feedback", window_s=JOIN_WINDOW_S,
        allowed_lateness_s=JOIN_LATENESS_S, negative_rate=s.negative_rate, app_id=f"{job}-join",
        instance_id="join"))


JOIN_WINDOW_S = 10.0
"""``up --join``'s window: a click within 10 s of event time of its impression makes it positive."""
JOIN_LATENESS_S = 1.0
"""``up --join``'s allowed lateness."""
JOIN_DELAY_MEAN_S = 2.0
"""Mean of the exponential delay of ``up --join``'s clicks (0.7 % of them come after the window)."""
CLICKS_PER_IMPRESSION = 0.4
"""Clicks an impression brings at most, about (the default clicks stream clicks 38 % of them): ``up --join
--rate R`` writes R impressions a second of event time and at most ``R * 1.4`` events a second of wall time,
so event time keeps up with the wall clock."""


def join_events(s: UpSettings, rate: float | None) -> EventsSettings:
    """What ``up --join``'s events producer writes: the impressions of ``--source`` (a clicks stream, its train
    split: the test split is the held-out data) and their delayed clicks, at ``rate`` impressions/s (None:
    as fast as it can, event time at 1,000 impressions/s), ``--max-records`` of the stream's records."""
    return EventsSettings(stream=s.source, limit=s.max_records or None, rate_per_s=rate or 1000.0,
                          rate=rate * (1 + CLICKS_PER_IMPRESSION) if rate else None, delay_mean_s=JOIN_DELAY_MEAN_S,
                          window_s=JOIN_WINDOW_S, final_watermark_s=JOIN_WINDOW_S + 60.0, train_split=True)


HELD_OUT_LIMIT = 10_000
"""Most held-out records ``up`` scores the job on: all of digits' 359 and of MovieLens's 10,000 (the
last tenth by time). A source without an end (``synthetic`` without ``limit=``) has a test split
without one too: scored whole, its first score would never end."""


def held_out(s: UpSettings) -> str:
    """The held-out data the job is scored on: ``--eval-source``, or one pass of ``--source``
    (both through their test split)."""
    return s.eval_source or one_pass(s.source)


def auc_target(s: UpSettings, task: Task) -> bool:
    """True when ``--target-auc`` is in force, in place of the accuracy target (a binary model).

    Raises:
        SettingsError: ``--target-auc`` for a model that is not a binary classifier.
    """
    if s.target_auc is None:
        return False
    if not task.binary:
        raise cfg.SettingsError("--target-auc / STREAMTRAIN_TARGET_AUC: the AUC needs a binary model (one logit "
                                "per record, such as dlrm); use --target-accuracy or --target-loss")
    return True


def has_target(s: UpSettings, task: Task) -> bool:
    """True when a held-out target is a stop condition: the AUC target of a binary model, else the
    accuracy target of a classifier, or ``--target-loss``."""
    return task.classification or s.target_loss is not None


def reached_target(score: dict[str, Any], s: UpSettings, task: Task) -> bool:
    """True when ``score`` meets a target in force: AUC >= ``--target-auc`` (a binary model, when
    given; the accuracy target then does not apply), else accuracy >= ``--target-accuracy``
    (classification), or loss <= ``--target-loss`` (when given)."""
    acc, auc, loss = score.get("accuracy"), score.get("auc"), score.get("loss")
    if auc_target(s, task):
        if auc is not None and s.target_auc is not None and auc >= s.target_auc:
            return True
    elif task.classification and acc is not None and acc >= s.target_accuracy:
        return True
    return s.target_loss is not None and loss is not None and loss <= s.target_loss


def exit_code(outcome: Outcome, s: UpSettings, task: Task) -> int:
    """0 when the run ended as asked, 1 when it failed, 130 for Ctrl-C of a bounded run.

    The table of cases: docs/online.md, *Scoring and when `up` stops*."""
    if outcome is Outcome.TARGET:
        return 0
    if outcome is Outcome.INTERRUPTED:
        return 0 if s.forever else 130
    targeted = has_target(s, task)
    if outcome is Outcome.CONSUMED:
        return 0 if s.max_records or not targeted else 1
    return 1 if targeted or s.max_records else 0  # the time ran out first


def task_of(model: str, local_steps: int = 1) -> Task:
    """What ``model`` is; a bad spec, or a model with embedding tables under ``--local-steps`` > 1, is a
    settings error, before anything starts."""
    from trainers import build_model

    try:
        spec = build_model(model)
    except ValueError as exc:
        raise cfg.SettingsError(f"--model / STREAMTRAIN_MODEL: {exc}") from None
    try:
        check_dense_model(local_steps, model, [t.name for t in spec.tables])
    except ValueError as exc:
        raise cfg.SettingsError(f"--local-steps / STREAMTRAIN_LOCAL_STEPS: {exc}") from None
    return Task(spec.classification, spec.binary)


def settings_of(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> UpSettings:
    """``up``'s settings: the flags, then the environment, then ``--example``'s settings, then the defaults.

    Raises:
        SettingsError: a bad value, or ``--target-auc`` for a model that is not binary.
    """
    env = os.environ if environ is None else environ
    settings = cfg.from_args(UpSettings, args, env)
    given = {f.name for f in fields(UpSettings)
             if getattr(args, f.name, None) is not None or f.metadata.get("env") in env}
    settings = with_example(settings, given)
    try:  # once the example's settings are in: it may name the dense codec local steps need
        check_local_steps(settings.local_steps, outer_lr=settings.outer_lr, outer_momentum=settings.outer_momentum,
                          optimizer=settings.optimizer, codec=settings.codec)
    except ValueError as exc:
        raise cfg.SettingsError(f"--local-steps / STREAMTRAIN_LOCAL_STEPS: {exc}") from None
    task = task_of(settings.model, settings.local_steps)
    auc_target(settings, task)
    if settings.join:
        try:
            click_stream(settings.source)
        except ValueError as exc:
            raise cfg.SettingsError(f"--join / STREAMTRAIN_UP_JOIN: its impressions come from a clicks --source: "
                                    f"{exc}") from None
        if not task.binary:
            raise cfg.SettingsError("--join / STREAMTRAIN_UP_JOIN: joined records are clicked or not; the model "
                                    "must be binary (one logit per record, such as dlrm)")
    elif settings.negative_rate != 1.0:
        raise cfg.SettingsError("--negative-rate / STREAMTRAIN_JOIN_NEGATIVE_RATE: downsampling is the joiner's: "
                                "add --join")
    return settings


def run(args: argparse.Namespace) -> int:
    """Run the local main job; its exit status follows :func:`exit_code`."""
    settings = settings_of(args)
    task = task_of(settings.model)
    console = Console()
    cluster = LocalCluster(cluster_spec(settings))
    final: dict[str, Any] = {}
    try:
        servers = "a parameter server" if settings.ps_groups == 1 else f"{settings.ps_groups} parameter servers"
        redis = "a Redis Cluster" if settings.redis_cluster else "Redis"
        kafka = "Kafka (KRaft)" if settings.kafka_brokers == 1 else f"{settings.kafka_brokers} Kafka brokers (KRaft)"
        serving = {0: "", 1: " and a serving replica"}.get(settings.serve, f" and {settings.serve} serving replicas")
        producing = "the events producer, the joiner" if settings.join else "the producer"
        with console.status(f"starting {kafka}, {redis}, coordinator, {servers}, "
                            f"{settings.trainers} trainers, {producing}{serving}"):
            cluster.start()
        assert cluster.kafka is not None and cluster.redis is not None  # started
        console.print(f"Kafka {cluster.bootstrap} (ready in {cluster.kafka.ready_after_s:.1f}s) · "
                      f"Redis {cluster.redis.display_url} · coordinator {cluster.coordinator_url} · "
                      f"logs in {cluster.workdir}")
        assert cluster.workdir is not None
        urls = _replica_urls(cluster)
        for i, url in enumerate(urls):
            console.print(f"serving replica {url} (its model routes take the job token; "
                          f"{'STREAMTRAIN_SERVE_URL' if i == 0 else 'STREAMTRAIN_SERVE_URLS'} in the credentials)",
                          soft_wrap=True, highlight=False)
        targets = write_targets(cluster.workdir / TARGETS_NAME,
                                prometheus_targets(cluster.spec.host, cluster.metrics_targets()))
        console.print(f"prometheus targets: {targets} (file_sd: every process's /metrics)", soft_wrap=True,
                      highlight=False)
        final["targets"] = (targets, len(cluster.metrics_targets()))
        path = write_credentials(cluster.workdir / CREDENTIALS_NAME,
                                 shell_exports(cluster.endpoints, cluster.spec.job, serve_urls=urls))
        console.print(f"credentials: {path}", soft_wrap=True, highlight=False)  # one line, even when long
        console.file.flush()  # a script reading our output through a pipe sees it now
        outcome = _watch(console, cluster, settings, final, task)  # final: the score that ended it
        if outcome is not Outcome.TARGET:  # the stream ended, time ran out or Ctrl-C: score what training left
            with console.status("draining trainers and applying their last updates"):
                cluster.quiesce()
            final.update(_score(cluster, settings) or {})
            if outcome is not Outcome.INTERRUPTED and reached_target(final, settings, task):
                outcome = Outcome.TARGET  # the last updates made it
        final["status"] = cluster.status()
        final["progressive"] = cluster.progressive()
        final["replicas"] = _replicas(cluster)  # what they served last (they stop below)
        if settings.model_out:
            final["model_out"] = _write_model(cluster, settings.model_out)
    finally:
        with console.status("stopping everything"):
            cluster.stop()
    _print_final(console, cluster, settings, final, outcome, task)
    cluster.cleanup()
    return exit_code(outcome, settings, task)


def _replica_urls(cluster: LocalCluster) -> list[str]:
    """Base URLs of the cluster's serving replicas."""
    return [cluster.replica_url(i) for i in range(len(cluster.replicas))]


def replica_status(url: str, token: str, timeout_s: float = REPLICA_TIMEOUT_S) -> dict[str, Any] | None:
    """A serving replica's ``GET /v1/replica`` (what it serves: ``model_version``, ``staleness_s``,
    ``served_auc``, ``labelled``, ...), or None when it does not answer within ``timeout_s``."""
    request = urllib.request.Request(url + "/v1/replica", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # answered, not 200 (loading): its response closed now
        exc.close()
        return None
    except (OSError, ValueError):  # refused, timed out, an HTTP error (URLError, HTTPError), not JSON
        return None
    return body if isinstance(body, dict) else None


def _replicas(cluster: LocalCluster) -> list[tuple[str, dict[str, Any] | None]]:
    """``(url, status or None when unreachable)`` of every serving replica."""
    return [(url, replica_status(url, cluster.job_token)) for url in _replica_urls(cluster)]


def _write_model(cluster: LocalCluster, path: str) -> str:
    """Export the job's current model to ``path`` (safetensors, :func:`services.export_model`);
    returns its version's name."""
    from common.redis_client import connect
    from services.slot_types import VersionVector
    from services.snapshot.export import export_model

    client = connect(cluster.redis_url)
    try:
        return VersionVector(export_model(client, cluster.spec.job, path)).name()
    finally:
        client.close()


def _watch(console: Console, cluster: LocalCluster, s: UpSettings, latest: dict[str, Any],
           task: Task) -> Outcome:
    """Show the live view until a target, the end of the stream, Ctrl-C or the timeout.

    ``latest`` receives the newest independent score of the stored parameters, and,
    when the producer is paced (``--forever``, ``--rate``), under ``"keeping_up"`` the
    newest verdict on the lag (:mod:`streamtrain.overload`).
    """
    t0 = time.monotonic()
    status: dict[str, Any] | None = None
    outage = Outage("Redis of the local job", s.outage_limit_s, logger)
    window = LagWindow(LAG_WINDOW_S)
    verdict: Verdict | None = None
    producer, events = cluster.spec.producer, cluster.spec.events
    # an unpaced producer outruns any trainer: no advice
    paced = (producer is not None and producer.rate is not None) or (events is not None and events.rate is not None)
    per_message = producer.shard_size if producer is not None else 1  # the joiner writes one record a message
    try:
        with Live(console=console, refresh_per_second=4) as live:
            while time.monotonic() - t0 < s.timeout_s or s.forever:
                cluster.raise_if_crashed()
                fresh = cluster.status()
                if fresh is not None:
                    status = fresh
                    sample = sample_from_status(fresh, time.monotonic())
                    if paced and sample is not None:
                        window.add(sample)
                        verdict = window.verdict(len(fresh.get("members", [])), partitions=s.partitions,
                                                 records_per_message=per_message)
                        latest["keeping_up"] = verdict
                score = _score(cluster, s, outage)
                if score is not None:
                    latest.update(score)
                replicas = _replicas(cluster)
                if status is not None:
                    live.update(_view(status, latest, time.monotonic() - t0, task, verdict, replicas))
                    if not s.forever and reached_target(latest, s, task):
                        return Outcome.TARGET
                    if not s.forever and cluster.consumed(status):
                        return Outcome.CONSUMED
                time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("interrupted: stopping")
        return Outcome.INTERRUPTED
    return Outcome.TIMEOUT


def _view(st: dict[str, Any], score: dict[str, Any], elapsed: float, task: Task,
          verdict: Verdict | None, replicas: list[tuple[str, dict[str, Any] | None]] | None = None) -> Group:
    """The live tables: the job (with the independent held-out score: AUC, log loss and accuracy for
    a binary model, accuracy for another classifier, loss, MAE and R² for regression; a binary model's
    progressive AUC, the mean of the trainers' newest windows, and beside it the first serving replica's
    served AUC), one row per trainer, one per serving replica (its served version and lag), then whether
    training keeps up."""
    classification = task.classification
    replicas = replicas or []
    # a binary model's trainers report the AUC of the records they consume, scored before training on them
    progressive = [m.get("stats", {}).get("progressive_auc") for m in st.get("members", [])]
    reported = [v for v in progressive if v is not None]
    scored = bool(reported)
    served = task.binary and bool(replicas)  # the first replica's AUC of the records it scored before training
    job = Table(title=f"job {st.get('job')} · {elapsed:.0f}s", expand=False)
    held_out = (("held-out AUC", "log loss", "acc") if task.binary else ("held-out acc",) if classification
                else ("held-out loss", "MAE", "R²"))
    for col in ("records/s", "loss", *held_out, *(("progressive AUC",) if scored else ()),
                *(("served AUC",) if served else ()), "version", "generation", "lag (msgs)", "staleness"):
        job.add_column(col, justify="right")
    versions = st.get("versions", {})
    metrics = ((_fmt(score.get("auc"), ".4f"), _fmt(score.get("loss"), ".4f"), _fmt(score.get("accuracy"), ".1%"))
               if task.binary else (_fmt(score.get("accuracy"), ".1%"),) if classification else
               (_fmt(score.get("loss")), _fmt(score.get("mae")), _fmt(score.get("r2"))))
    if scored:  # the mean of the trainers' newest windows
        metrics = (*metrics, _fmt(sum(reported) / len(reported)))
    if served:
        first = replicas[0][1]
        metrics = (*metrics, "unreachable" if first is None else _fmt(first.get("served_auc")))
    job.add_row(f"{st.get('throughput_records_per_s', 0):,.0f}", _fmt(st.get("loss")), *metrics,
                str(versions.get("max", "-")), str(st.get("generation")),
                str(st.get("lag")), str(st.get("staleness", {}).get("clock_spread", "-")))
    members = Table(title="trainers", expand=False)
    for col in ("member", "state", "device", "partitions", "records/s", "loss", *(("acc",) if classification else ()),
                *(("progressive AUC",) if scored else ()), "clock"):
        members.add_column(col)
    for m, auc in zip(st.get("members", []), progressive, strict=True):
        stats = m.get("stats", {})
        acc = (_fmt(stats.get("accuracy"), ".1%"),) if classification else ()
        members.add_row(m["member_id"], m["state"], str(m.get("capabilities", {}).get("device", "")),
                        ",".join(map(str, m.get("partitions", []))),
                        f"{stats.get('records_per_s', 0):,.0f}", _fmt(stats.get("loss")), *acc,
                        *((_fmt(auc),) if scored else ()), str(stats.get("clock", "")))
    parts: list[Table | Text] = [job, members]
    if (line := join_line(st.get("join"))) is not None:
        parts.append(Text(line))
    if replicas:
        parts.append(_serving_table(replicas, task))
    if verdict is not None:
        style = {Trend.FALLING_BEHIND: "bold red", Trend.CATCHING_UP: "yellow"}.get(verdict.trend, "green")
        parts.append(Text(verdict.line(), style=style))
    return Group(*parts)


def join_line(join: Mapping[str, Any] | None) -> str | None:
    """The joiners' figures in words (``/v1/status``'s ``join``), None while no joiner reports."""
    if not join or not join.get("joiners"):
        return None
    rate = join.get("joined_per_s")
    late = ", ".join(f"{k} {v:,}" for k, v in join.get("late", {}).items()) or "none"
    dead = ", ".join(f"{k} {v:,}" for k, v in join.get("dead_letters", {}).items()) or "none"
    lag = join.get("watermark_lag_s")
    return (f"joiner: {join['joined']:,} impressions labelled ({'-' if rate is None else f'{rate:,.0f}'}/s: "
            f"{join['positives']:,} positive, {join['negatives']:,} negative, {join['negatives_dropped']:,} "
            f"negatives dropped) · {join['pending']:,} pending · late: {late} · dead letters: {dead} · "
            f"watermark lag {'-' if lag is None else f'{lag:.1f} s'}")


def _replica_state(body: dict[str, Any] | None) -> str:
    if body is None:
        return "unreachable"
    if body.get("ready"):
        return "ready"
    return "loading" if body.get("model_version") is None else "stale"


def _serving_table(replicas: list[tuple[str, dict[str, Any] | None]], task: Task) -> Table:
    """One row per serving replica: its state, the version it serves, its lag behind the parameter
    plane (seconds since it read the feed up to its head), and, for a binary model, the labelled
    records it scored before any trainer trained on them and their AUC."""
    table = Table(title="serving", expand=False)
    for col in ("replica", "state", "served version", "serving lag", *(("scored", "served AUC") if task.binary
                                                                      else ()), "requests"):
        table.add_column(col)
    for url, body in replicas:
        b = body or {}
        lag = b.get("staleness_s")
        binary = (f"{b['labelled']:,}" if "labelled" in b else "-", _fmt(b.get("served_auc"))) if task.binary else ()
        table.add_row(url, _replica_state(body), str(b.get("model_version") or "-"),
                      "-" if lag is None else f"{lag:.2f} s", *binary, f"{b.get('requests', 0):,}" if b else "-")
    return table


def progressive_summary(progressive: Mapping[str, Any] | None) -> str | None:
    """The job's progressive-validation AUC over the run's first and last tenth of the records scored
    (``/v1/history``'s ``progressive``), in words; None when no window had an AUC (not a binary model)."""
    series = (progressive or {}).get("job") or {}
    first, last = mean_auc(series, 0.0, 0.1), mean_auc(series, 0.9, 1.0)
    if first is None and last is None:
        return None
    return (f"{_fmt(first)} over the first tenth → {_fmt(last)} over the last tenth of "
            f"{series['records'][-1]:,} records scored before training on them")


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _score(cluster: LocalCluster, s: UpSettings, outage: Outage | None = None) -> dict[str, Any] | None:
    """Score the parameters stored in Redis now on the held-out split (not a trainer's word).

    None when there is no model yet, or while Redis is unreachable (``outage`` then logs its
    start and end, and raises once it outlasts its limit).
    """
    from services import LayoutError

    from .scoring import score_job

    try:
        result = score_job(cluster.redis_url, cluster.spec.job, s.model, held_out(s), limit=HELD_OUT_LIMIT)
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
            "mae": result.mae, "r2": result.r2, "auc": result.auc, "samples": result.samples,
            "mean_predicted": result.mean_predicted, "observed_rate": result.observed_rate}


def _ending(s: UpSettings, outcome: Outcome, task: Task) -> str:
    """How the run ended, in words, with the targets in force."""
    if s.forever:
        return "continuous training (--forever) until stopped"
    first = ([f"AUC {s.target_auc:g}"] if auc_target(s, task) else
             [f"accuracy {s.target_accuracy:.0%}"] if task.classification else [])
    targets = first + (
        [f"loss {s.target_loss:g}"] if s.target_loss is not None else [])
    wanted = f"target {' or '.join(targets)}: " if targets else ""
    if outcome is Outcome.TARGET:
        return wanted + "reached"
    if outcome is Outcome.CONSUMED and s.max_records:
        return f"--max-records {s.max_records:,} consumed" + (f"; {wanted}not reached" if targets else "")
    if outcome is Outcome.CONSUMED:
        return "the stream ended" + (f"; {wanted}NOT reached" if targets else "")
    if outcome is Outcome.TIMEOUT:
        return f"time limit {s.timeout_s:g} s" + (f"; {wanted}NOT reached" if targets else "")
    return "interrupted" + (f"; {wanted}not reached" if targets else "")


def _served_auc_line(body: dict[str, Any] | None, paced: bool = True) -> str:
    """The first replica's served AUC, in words (``paced``: the producer stays under a rate)."""
    if body is None:
        return "- (the replica did not answer)"
    labelled = body.get("labelled") or 0
    line = (f"{_fmt(body.get('served_auc'))} on {labelled:,} records the replica scored before any trainer "
            "trained on them (sampled by the producer)")
    if labelled == 0 and not paced:
        line += "; an unpaced producer writes the stream before the replica serves a model: --rate paces it"
    return line


def _calibration_line(predicted: float | None, observed: float | None) -> str:
    """A binary model's calibration in words: its mean predicted probability against the observed rate."""
    return f"mean predicted {_fmt(predicted, '.4f')} against observed {_fmt(observed, '.4f')}"


def _served_line(url: str, body: dict[str, Any] | None) -> str:
    """A replica's served version and lag at the end, in words."""
    if body is None:
        return f"- ({url} did not answer)"
    lag = body.get("staleness_s")
    return (f"{body.get('model_version') or '-'} · serving lag {'-' if lag is None else f'{lag:.2f} s'} · "
            f"{_replica_state(body)} · {url}")


def _print_final(console: Console, cluster: LocalCluster, s: UpSettings, final: dict[str, Any],
                 outcome: Outcome, task: Task) -> None:
    st = final.get("status") or {}
    replicas: list[tuple[str, dict[str, Any] | None]] = final.get("replicas") or []
    parts = st.get("partitions", [])
    committed = sum(p["committed"] or 0 for p in parts)
    table = Table(title="final", show_header=False)
    ending = f" on {final.get('samples', 0)} records ({_ending(s, outcome, task)})"
    if task.binary:  # a binary model (one logit per record): AUC first, its log loss, then accuracy
        table.add_row("held-out AUC", _fmt(final.get("auc"), ".4f") + ending)
        table.add_row("held-out log loss", _fmt(final.get("loss"), ".4f"))
        table.add_row("held-out accuracy", _fmt(final.get("accuracy"), ".2%"))
        table.add_row("calibration", _calibration_line(final.get("mean_predicted"), final.get("observed_rate")))
        if (line := progressive_summary(final.get("progressive"))) is not None:
            table.add_row("progressive AUC", line)
        if replicas:
            paced = cluster.spec.producer is not None and cluster.spec.producer.rate is not None
            table.add_row("served AUC", _served_auc_line(replicas[0][1], paced))
            if (body := replicas[0][1]) is not None and body.get("labelled"):
                table.add_row("served calibration", _calibration_line(body.get("served_mean_predicted"),
                                                                      body.get("served_observed_rate")))
    elif task.classification:
        table.add_row("held-out accuracy", _fmt(final.get("accuracy"), ".2%") + ending)
        table.add_row("held-out loss", _fmt(final.get("loss")))
    else:
        table.add_row("held-out loss", _fmt(final.get("loss")) + ending)
        table.add_row("held-out MAE", _fmt(final.get("mae")))
        table.add_row("held-out R²", _fmt(final.get("r2")))
    if (line := join_line((final.get("status") or {}).get("join"))) is not None:
        table.add_row("joined", line.removeprefix("joiner: "))
    table.add_row("model version", str(final.get("version", "-")))
    for i, (url, body) in enumerate(replicas):
        table.add_row("served version" if len(replicas) == 1 else f"served version ({i})", _served_line(url, body))
    verdict = final.get("keeping_up")
    if isinstance(verdict, Verdict):
        table.add_row("lag trend", verdict.line())
    if "model_out" in final:
        table.add_row("model written", f"version {final['model_out']} to {s.model_out}")
    table.add_row("messages committed", f"{committed:,} Kafka offsets over {len(parts)} partitions")
    table.add_row("status endpoints", f"{cluster.coordinator_url}/v1/status · /healthz · /readyz · "
                  "/metrics · / (page) — served while the job ran")
    if "targets" in final:
        path, count = final["targets"]
        table.add_row("metrics", f"{count} processes' /metrics listed in {path} (Prometheus file_sd) — served "
                                 "while the job ran")
    console.print(table)
