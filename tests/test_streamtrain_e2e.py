"""End to end, everything real: Kafka, Redis, coordinator, parameter server, trainers, producer.

Each test runs the local topology of ``streamtrain up`` (:class:`LocalCluster`),
then scores the parameters stored in Redis on the held-out digits split and
audits the accounting record by record (:func:`streamtrain.accounting.audit`).
Faults are injected at conditions (a version reached), never after sleeps.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace

import pytest
from kafka import KafkaProducer

from coordinator.settings import CoordinatorSettings
from datastream import load_source
from services import LayoutError, ParameterStore, connect
from streamtrain.accounting import audit
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.scoring import score_job
from trainers import TrainerSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def held_out_accuracy(cluster: LocalCluster) -> float:
    """Accuracy of the parameters in Redis now, on the digits test split."""
    result = score_job(cluster.redis_url, cluster.spec.job, cluster.spec.trainer.model, "digits")
    assert result.accuracy is not None
    return result.accuracy


def reaches_accuracy(cluster: LocalCluster, target: float, timeout_s: float) -> float:
    """Score the stored parameters every 0.25 s until ``target``; the best score seen."""
    best = 0.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cluster.raise_if_crashed()
        with contextlib.suppress(LayoutError):  # no model stored yet
            best = max(best, held_out_accuracy(cluster))
        if best >= target or cluster.consumed(cluster.status() or {}):
            break
        time.sleep(0.25)  # a digits pass takes ~0.1 s now: score often enough to see the run
    return best


def assert_exact(cluster: LocalCluster, *, everything: bool = True) -> None:
    report = audit(cluster.bootstrap, cluster.spec.topic, cluster.redis_url, cluster.spec.job)
    if everything:
        assert report.uncommitted == 0, report
    assert report.exact, report
    assert report.applied == report.expected > 0
    assert report.rejected_updates == 0


@pytest.fixture
def run_cluster(tmp_path):
    clusters: list[LocalCluster] = []

    def start(*, source: str | None = "digits?repeat=20", trainers: int = 2, trainer: TrainerSettings = LOCAL_TRAINER,
              **job: object) -> LocalCluster:
        """A cluster streaming ``source`` (None: no producer) with the coordinator's settings ``job``."""
        spec = ClusterSpec(trainers=trainers, coordinator=CoordinatorSettings(**job), trainer=trainer,
                           producer=None if source is None else replace(LOCAL_STREAM, source=source))
        cluster = LocalCluster(spec, workdir=tmp_path / f"cluster{len(clusters)}")
        clusters.append(cluster)
        return cluster.start()

    yield start
    for cluster in reversed(clusters):
        cluster.stop()


@pytest.mark.parametrize("consistency", ["ssp", "bsp", "asp"])
def test_two_trainers_reach_target_accuracy(run_cluster, consistency: str) -> None:
    cluster = run_cluster(consistency=consistency, codec="topk+fp16", source="digits?repeat=80")
    assert reaches_accuracy(cluster, 0.95, timeout_s=300) >= 0.95
    cluster.quiesce()
    assert_exact(cluster, everything=False)


def test_killed_trainer_partitions_move_and_accounting_stays_exact(run_cluster) -> None:
    cluster = run_cluster(trainers=2)
    cluster.wait_for(lambda st: (st["versions"]["max"] or 0) >= 50 and len(st["members"]) == 2,
                     timeout_s=120, what="two trainers to have trained a while")
    victim = cluster.trainers[0]
    cluster.kill_trainer(0)
    cluster.wait_reassigned(1, what=f"{victim.name}'s partitions to be reassigned")
    cluster.wait_consumed(timeout_s=300)
    assert_exact(cluster)
    # training went on after the fault (chance is 0.10; runs end at 0.85-0.97)
    assert held_out_accuracy(cluster) >= 0.80


@pytest.mark.parametrize(("which", "ps_groups"), [("ps", 1), ("coordinator", 1), ("ps", 2)])
def test_restarts_keep_accounting_exact(run_cluster, which: str, ps_groups: int) -> None:
    # ps_groups 2: two parameter servers, each applying half the shards, both restarted
    cluster = run_cluster(ps_groups=ps_groups)
    assert len(cluster.ps) == ps_groups
    cluster.wait_for(lambda st: (st["versions"]["max"] or 0) >= 50, timeout_s=120,
                     what="training to be under way")
    cluster.restart(which)
    cluster.wait_consumed(timeout_s=300)
    assert_exact(cluster)
    with contextlib.closing(connect(cluster.redis_url)) as client:
        assert ParameterStore(client, cluster.spec.job).meta().groups == ps_groups  # the job is split as asked
    # training went on after the fault (chance is 0.10; runs end at 0.85-0.97)
    assert held_out_accuracy(cluster) >= 0.80


def test_poison_records_are_dead_lettered_and_accounted(run_cluster) -> None:
    cluster = run_cluster(source=None)  # we produce ourselves: good JSON records and poison
    producer = KafkaProducer(bootstrap_servers=cluster.bootstrap, acks="all")
    x, y = load_source("digits", split="train").read(limit=300)
    for i, (row, label) in enumerate(zip(x, y, strict=True)):
        producer.send(cluster.spec.topic, json.dumps({"x": row.tolist(), "y": int(label)}).encode(),
                      partition=i % cluster.spec.partitions)
        if i % 50 == 0:
            producer.send(cluster.spec.topic, b"\x93not a record", partition=i % cluster.spec.partitions)
            producer.send(cluster.spec.topic, json.dumps({"x": [float("nan")] * 64, "y": 1}).encode(),
                          partition=(i + 1) % cluster.spec.partitions)
    producer.flush()
    producer.close()

    cluster.wait_consumed(timeout_s=120)
    report = audit(cluster.bootstrap, cluster.spec.topic, cluster.redis_url, cluster.spec.job)
    assert report.exact, report
    assert report.expected == report.applied == 300
    assert report.dead_letters == 2 * 6


def test_one_trainer_trains_on_pulls_ahead_and_accounts_exactly(run_cluster) -> None:
    """The job's defaults (SSP, staleness 2) with --overlap-pulls: the trainer takes the pull made
    while its previous step computed, trains, and the accounting is exact."""
    cluster = run_cluster(trainers=1, source="digits?repeat=40", trainer=replace(LOCAL_TRAINER, overlap_pulls=True))
    cluster.wait_consumed(timeout_s=300)
    assert held_out_accuracy(cluster) >= 0.90
    trainer = cluster.trainers[0]
    trainer.stop()  # it drains, logs what it took, and leaves
    assert_exact(cluster)
    lines = [line for line in trainer.log_path.read_text().splitlines() if "pulls ahead were taken" in line]
    assert len(lines) == 1, lines
    taken, started = (int(w) for w in lines[0].split("pulls ahead")[0].split()[-3::2])
    assert 0 < taken <= started, lines[0]
