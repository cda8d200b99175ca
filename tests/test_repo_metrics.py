"""Prometheus metrics of every service, scraped over HTTP like Prometheus does.

The metric modules are first checked on their own (a real registry served by
prometheus_client's HTTP server, read back with urllib); then a parameter
server started from its CLI, and a trainer with an in-process coordinator and
parameter server on the real Kafka and Redis, must export every series with
samples. Each endpoint's text also passes ``promtool check metrics`` where
promtool is installed (``scripts/setup_tests.sh`` installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis as redis_lib
from kafka import KafkaProducer
from prometheus_client.parser import text_string_to_metric_families
from test_services_server import grads_for
from test_services_server import setup as setup_job

from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from coordinator.testing import running_coordinator
from datastream import produce
from datastream.consumer import ConsumerStats
from datastream.records import DecodeError, decode_record
from services import OptimizerConfig, ParameterServer, Pusher, ServerSettings
from services.metrics import MetricsServer, ServerMetrics
from services.protocol import Update
from services.server.apply import Outcome
from streamtrain.launcher import wait_until
from trainers.evaluate import EvalResult
from trainers.metrics import TrainerMetrics, TrainerReport
from trainers.service import Trainer
from trainers.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[1]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> str:
    """The exposition text of the endpoint on loopback ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def samples(text: str) -> Samples:
    """(sample name, sorted labels) -> value, parsed the way Prometheus parses them."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def named(found: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Labels -> value of every sample called ``name``."""
    return {labels: v for (n, labels), v in found.items() if n == name}


def assert_promtool_accepts(text: str) -> None:
    """``promtool check metrics`` passes on ``text`` (skipped only when promtool is missing)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return
    done = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_promtool_is_checked_where_installed() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (scripts/setup_tests.sh installs it): exposition texts are parsed only")
    with pytest.raises(AssertionError):  # the check really runs: a bad exposition fails it
        assert_promtool_accepts("# TYPE x counter\nx_total{a=\"1\"} 1\nx_total{a=\"1\"} 2\n")


# -- the metric modules on their own ---------------------------------------------------------------


def test_server_metrics_are_served_over_http() -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: the backlog has no sample
    server = SimpleNamespace(settings=SimpleNamespace(group=1, job="m", redis_url=unreachable), version=7,
                             table_names=[])
    metrics = ServerMetrics(server)  # type: ignore[arg-type]  # a stand-in with what it reads
    update = Update(member_id="a", generation=1, clock=1, gradients={},
                    produced_ts_ms=int(time.time() * 1000) - 1500)
    metrics.observe_write([Outcome(update, "applied"), Outcome(update, "rejected", reason="bad")], 0.01,
                          published=True)
    metrics.observe_write([Outcome(Update(member_id="a", generation=1, clock=2, gradients={}), "applied")],
                          0.002, published=False)  # an offsets-only update: no version, no freshness
    try:
        with MetricsServer(metrics.registry, 0, addr="127.0.0.1") as http:
            text = scrape(http.port)
    finally:
        metrics.close()
    found = samples(text)
    g = (("group", "1"),)
    assert found[("streamtrain_group_version", g)] == 7
    assert found[("streamtrain_updates_applied_total", g)] == 2
    assert found[("streamtrain_updates_rejected_total", g)] == 1
    assert found[("streamtrain_versions_published_total", g)] == 1
    assert found[("streamtrain_apply_seconds_count", g)] == 2
    assert found[("streamtrain_freshness_seconds_count", g)] == 1
    assert 1.5 <= found[("streamtrain_freshness_seconds_sum", g)] < 60
    assert named(found, "streamtrain_unapplied_updates") == {}
    assert "# TYPE streamtrain_unapplied_updates gauge" in text
    assert_promtool_accepts(text)


def test_trainer_metrics_read_the_trainer_when_scraped() -> None:
    stats = ConsumerStats(messages=12, records=300, batches=10, rejected_records=2,
                          rejected_by_reason={"bad_json": 1, "truncated": 1}, lag={0: 5, 3: 0})
    report = TrainerReport(steps=0, clock=1, staleness=0, loss=None, version=None, last_eval=None, consumer=None)
    metrics = TrainerMetrics(lambda: report)
    with MetricsServer(metrics.registry, 0, addr="127.0.0.1") as http:
        before = samples(scrape(http.port))
        assert before[("streamtrain_trainer_steps_total", ())] == 0
        assert not named(before, "streamtrain_trainer_loss") and not named(before, "streamtrain_partition_lag")
        report = TrainerReport(steps=10, clock=11, staleness=2, loss=0.75, version=42,
                               last_eval=EvalResult(42, 0.5, 0.875, 100), consumer=stats)
        metrics.pushed("topk+fp16", 100, 4000)
        metrics.pushed("topk+fp16", 50, 4000)
        text = scrape(http.port)
    found = samples(text)
    assert found[("streamtrain_trainer_steps_total", ())] == 10
    assert found[("streamtrain_trainer_loss", ())] == 0.75
    assert found[("streamtrain_trainer_staleness_clocks", ())] == 2
    assert found[("streamtrain_trainer_model_version", ())] == 42
    assert found[("streamtrain_trainer_accuracy", ())] == 0.875
    assert found[("streamtrain_records_consumed_total", ())] == 300
    assert found[("streamtrain_rejected_records_total", ())] == 2
    assert named(found, "streamtrain_dead_letters_total") == {(("reason", "bad_json"),): 1,
                                                              (("reason", "truncated"),): 1}
    assert named(found, "streamtrain_partition_lag") == {(("partition", "0"),): 5, (("partition", "3"),): 0}
    assert found[("streamtrain_pushed_bytes_total", (("codec", "topk+fp16"),))] == 150
    assert found[("streamtrain_pushed_fp32_bytes_total", (("codec", "topk+fp16"),))] == 8000
    assert found[("streamtrain_pushes_total", (("codec", "topk+fp16"),))] == 2
    assert ("streamtrain_ssp_staleness_clocks_count", ()) in found
    assert_promtool_accepts(text)


def test_a_busy_metrics_port_is_refused_with_its_number() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = TrainerMetrics(lambda: TrainerReport(steps=0, clock=1, staleness=0, loss=None, version=None,
                                                       last_eval=None, consumer=None))
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            MetricsServer(metrics.registry, port, addr="127.0.0.1")


# -- a parameter server from its CLI ---------------------------------------------------------------

JOB = "psjob"  # the job of test_services_server's helpers


@pytest.fixture
def ps_process(redis_url: str) -> Iterator[Callable[..., tuple[subprocess.Popen, int]]]:
    started: list[subprocess.Popen] = []

    def start(*extra: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "streamtrain.cli", "ps", "--redis-url", redis_url,
                                 "--job", JOB, "--block-ms", "50", "--log-level", "WARNING",
                                 "--metrics-port", str(port), *extra],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started.append(proc)
        return proc, port

    yield start
    for proc in reversed(started):
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_ps_serves_its_metrics_while_applying(redis: redis_lib.Redis, ps_process) -> None:
    setup_job(redis, OptimizerConfig(name="sgd", lr=0.1))
    pusher = Pusher(redis, JOB, "a")
    produced_ms = int(time.time() * 1000) - 2000
    for c in range(1, 6):
        pusher.push(grads_for(c), generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                    samples=[("prod", 10 * (c - 1), 10)], batch_size=10, produced_ts_ms=produced_ms)
    proc, port = ps_process("--batch", "2")

    def applied_all() -> Samples | None:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "ps exited"
        with contextlib.suppress(OSError):
            found = samples(scrape(port))
            if found.get(("streamtrain_updates_applied_total", (("group", "0"),))) == 5:
                return found
        return None

    found = wait_until(applied_all, timeout_s=60, what="the ps to report 5 updates applied")
    g = (("group", "0"),)
    version = int(redis.get(JobKeys(JOB).group(0).version))  # the job's one group
    assert found[("streamtrain_group_version", g)] == version >= 3  # 5 updates, at most 2 per write
    assert found[("streamtrain_versions_published_total", g)] == version
    assert found[("streamtrain_apply_seconds_count", g)] == version
    assert found[("streamtrain_updates_rejected_total", g)] == 0
    assert found[("streamtrain_freshness_seconds_count", g)] == 5
    assert found[("streamtrain_freshness_seconds_sum", g)] >= 5 * 2.0
    assert found[("streamtrain_unapplied_updates", ())] == 0
    assert_promtool_accepts(scrape(port))


# -- a trainer, with the coordinator and a parameter server, on the real Kafka and Redis ------------

POISON = b"definitely not a record"


async def test_trainer_and_coordinator_export_lag_dead_letters_and_bytes(kafka, redis_url: str) -> None:
    with pytest.raises(DecodeError) as rejected:
        decode_record(POISON)
    reason = rejected.value.reason
    topic = kafka.create_topic(partitions=2)
    report = await asyncio.to_thread(produce, kafka.bootstrap, topic, "digits", partitions=2, shard_size=16,
                                     limit=320, split="train")
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
    try:
        producer.send(topic, POISON, partition=0)
        producer.flush(timeout=30)
    finally:
        producer.close()
    records, messages = report.records, report.shards + 1
    job = "metricsjob"
    settings = CoordinatorSettings(job=job, redis_url=redis_url, kafka_bootstrap=kafka.bootstrap, topic=topic,
                                   partitions=2, admin_token="a", job_token="j", kafka_timeout_ms=5000,
                                   heartbeat_interval_ms=200, codec="topk+fp16", consistency="ssp")
    async with running_coordinator(settings) as client:
        trainer = Trainer(TrainerSettings(
            job=job, coordinator_url=str(client.make_url("")).rstrip("/"), job_token="j", redis_url=redis_url,
            kafka_bootstrap=kafka.bootstrap, model="digits-mlp", batch_size=32, eval_source="digits",
            eval_every=2, eval_limit=200, commit_to_kafka=False))
        ps = ParameterServer(ServerSettings(redis_url=redis_url, job=job, block_ms=50))
        ps_started = asyncio.create_task(asyncio.to_thread(ps.start, 60.0))  # waits for the trainer's model
        running = asyncio.create_task(trainer.run())
        try:
            with MetricsServer(trainer.metrics.registry, 0, addr="127.0.0.1") as t_http, \
                    MetricsServer(ps.metrics.registry, 0, addr="127.0.0.1") as ps_http:
                deadline = time.monotonic() + 120
                while True:
                    assert not running.done(), running.exception() if running.done() else ""
                    t_text, ps_text = await asyncio.to_thread(scrape, t_http.port), \
                        await asyncio.to_thread(scrape, ps_http.port)
                    c_text = await (await client.get("/metrics")).text()
                    t, p, c = samples(t_text), samples(ps_text), samples(c_text)
                    done = (t.get(("streamtrain_records_consumed_total", ())) == records
                            and t.get(("streamtrain_messages_consumed_total", ())) == messages
                            and named(t, "streamtrain_partition_lag")
                            and named(c, "streamtrain_member_lag")
                            and t.get(("streamtrain_trainer_accuracy", ())) is not None
                            and p.get(("streamtrain_freshness_seconds_count", (("group", "0"),)), 0) > 0)
                    if done or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.25)
        finally:
            trainer.stop()
            await asyncio.wait_for(running, 60)
            await ps_started
            await asyncio.to_thread(ps.close)
    member = trainer.pusher.member_id
    # the trainer: steps, records, the poison message by reason, lag of both partitions, bytes by codec
    assert t[("streamtrain_trainer_steps_total", ())] > 0
    assert t[("streamtrain_records_consumed_total", ())] == records
    assert t[("streamtrain_messages_consumed_total", ())] == messages
    assert named(t, "streamtrain_dead_letters_total") == {(("reason", reason),): 1}
    assert t[("streamtrain_rejected_records_total", ())] == 1
    assert set(named(t, "streamtrain_partition_lag")) == {(("partition", "0"),), (("partition", "1"),)}
    wire = t[("streamtrain_pushed_bytes_total", (("codec", "topk+fp16"),))]
    assert 0 < wire < t[("streamtrain_pushed_fp32_bytes_total", (("codec", "topk+fp16"),))]
    assert t[("streamtrain_ssp_staleness_clocks_count", ())] > 0
    assert ("streamtrain_trainer_loss", ()) in t and ("streamtrain_trainer_accuracy", ()) in t
    # the coordinator: the member's lag, as its heartbeats report it
    assert set(named(c, "streamtrain_member_lag")) == {(("member", member),)}
    # the parameter server: versions, updates, apply time and freshness
    g = (("group", "0"),)
    assert p[("streamtrain_updates_applied_total", g)] > 0 and p[("streamtrain_versions_published_total", g)] > 0
    assert p[("streamtrain_apply_seconds_count", g)] > 0 and p[("streamtrain_freshness_seconds_count", g)] > 0
    assert p[("streamtrain_group_version", g)] > 0
    for text in (t_text, ps_text, c_text):
        assert_promtool_accepts(text)
