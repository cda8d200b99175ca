"""Three Kafka brokers: topics keep three copies, producers are idempotent with acks=all, and a broker
SIGKILLed while the job trains loses nothing: the other two carry the stream to the end and the
record-by-record audit is exact.

The cluster test runs the local topology of ``streamtrain up --kafka-brokers 3``
(:class:`LocalCluster`), kills the broker that leads the most partitions of the training topic once
training is under way, and restarts it on its folder while the stream goes on.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis as redis_lib
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

import datastream.producer
from common import settings as cfg
from datastream import DeadLetterWriter, DecodeError, dlq_topic, ensure_topic, produce, reliable_producer
from datastream.topics import topic_replication
from services import unapplied_updates
from streamtrain.accounting import audit
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.launcher import KafkaCluster, LaunchError, ServerState, replication_config, wait_until
from streamtrain.settings import UpSettings
from streamtrain.up import cluster_spec

DIGITS_TRAIN = 1438
"""Records in one pass of the digits train split."""

PASSES = 8
"""Passes of the digits train split the cluster test streams."""


def test_replication_follows_the_broker_count() -> None:
    one, three, five = replication_config(1), replication_config(3), replication_config(5)
    assert one["default.replication.factor"] == one["offsets.topic.replication.factor"] == "1"
    assert one["min.insync.replicas"] == one["transaction.state.log.min.isr"] == "1"
    for many in (three, five):
        assert many["default.replication.factor"] == many["offsets.topic.replication.factor"] == "3"
        assert many["transaction.state.log.replication.factor"] == "3"
        assert many["min.insync.replicas"] == many["transaction.state.log.min.isr"] == "2"
    assert topic_replication(1) == (1, {})
    assert topic_replication(2) == (2, {})
    assert topic_replication(4) == (3, {"min.insync.replicas": "2"})
    with pytest.raises(ValueError, match="brokers must be >= 1, got 0"):
        replication_config(0)


def test_a_cluster_whose_nodes_cannot_start_says_why_and_leaves_nothing() -> None:
    with pytest.raises(ValueError, match="brokers must be >= 1"):
        KafkaCluster(0)
    with pytest.raises(ValueError, match="port is chosen per node"):
        KafkaCluster(3, port=9092)
    cluster = KafkaCluster(3, heap_mb=128, extra_config={"num.io.threads": "not-a-number"}, start_timeout_s=120)
    assert [n.node_id for n in cluster.nodes] == [1, 2, 3]
    assert len({n.port for n in cluster.nodes} | {n.controller_port for n in cluster.nodes}) == 6
    with pytest.raises(LaunchError, match=r"num\.io\.threads"):
        cluster.start()
    assert all(n.state is ServerState.STOPPED and n.pid is None for n in cluster.nodes)
    workdir = cluster.workdir
    cluster.cleanup()
    assert not workdir.exists()


def test_up_kafka_brokers_reaches_the_cluster_spec() -> None:
    given = cfg.from_args(UpSettings, argparse.Namespace(kafka_brokers=3), environ={})
    assert cluster_spec(given, environ={}).kafka_brokers == 3
    assert cluster_spec(cfg.from_args(UpSettings, argparse.Namespace(), environ={}), environ={}).kafka_brokers == 1
    from_env = cfg.from_args(UpSettings, argparse.Namespace(), environ={"STREAMTRAIN_KAFKA_BROKERS": "3"})
    assert from_env.kafka_brokers == 3


def _idempotent_with_acks_all(producer: object) -> bool:
    config = producer.config  # type: ignore[attr-defined]  # kafka-python's producer
    return config["enable_idempotence"] is True and config["acks"] == -1  # -1 is "all"


def test_every_producer_we_make_is_idempotent_with_acks_all(kafka, monkeypatch: pytest.MonkeyPatch) -> None:
    topic = kafka.create_topic(partitions=1)
    made = []

    def recording(*args: object, **kwargs: object):  # the real producer, kept to read its config
        made.append(reliable_producer(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(datastream.producer, "reliable_producer", recording)
    report = produce(kafka.bootstrap, topic, "digits", split="train", limit=64, shard_size=32)
    assert report.records == 64
    assert len(made) == 1 and _idempotent_with_acks_all(made[0])

    writer = DeadLetterWriter(kafka.bootstrap, topic)
    try:
        writer.send(b"poison", [], partition=0, offset=0, error=DecodeError("bad_msgpack", "not a record"))
        writer.flush()
        assert _idempotent_with_acks_all(writer._producer)  # the writer's own producer
    finally:
        writer.close()


def _describe(bootstrap: str, topic: str) -> list[dict]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="tests")
    try:
        return admin.describe_topics([topic])[0]["partitions"]
    finally:
        admin.close()


def _min_isr(bootstrap: str, topic: str) -> str:
    """``min.insync.replicas`` set on ``topic`` itself."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="tests")
    try:
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        admin.close()
    return str(configs["topic"][topic]["min.insync.replicas"]["value"])


STREAM = replace(LOCAL_STREAM, source=f"digits?repeat={PASSES}", rate=1500.0)
"""What the cluster test streams, held to a rate that keeps it streaming past the kill."""

SHARDS_AFTER_KILL = 20
"""Shards every partition must have committed past its end at the kill: proof that the killed
broker's partitions took new records under new leaders."""


@pytest.fixture
def three_brokers(tmp_path) -> Iterator[LocalCluster]:
    """Three brokers (small heaps: three JVMs on two cores) and two trainers without held-out
    scoring, registered; no producer yet (the test starts :data:`STREAM` once the trainers are in)."""
    spec = ClusterSpec(kafka_brokers=3, kafka_heap_mb=256, trainers=2, producer=None,
                       trainer=replace(LOCAL_TRAINER, eval_source=""))
    cluster = LocalCluster(spec, workdir=tmp_path / "cluster")
    try:
        cluster.start()
        cluster.wait_for(lambda st: len(st["members"]) == 2, timeout_s=120, what="two trainers registered")
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.kafka_cluster
@pytest.mark.timeout(420)
def test_a_broker_killed_mid_training_loses_nothing(three_brokers: LocalCluster) -> None:
    cluster = three_brokers
    assert len(cluster.bootstrap.split(",")) == 3
    topic = cluster.spec.topic
    ensure_topic(cluster.bootstrap, dlq_topic(topic), 1)  # as a trainer's dead-letter writer makes it
    for name in (topic, dlq_topic(topic)):
        assert all(len(p["replica_nodes"]) == 3 for p in _describe(cluster.bootstrap, name)), name
        assert _min_isr(cluster.bootstrap, name) == "2", name

    cluster.spec = replace(cluster.spec, producer=STREAM)
    cluster.start_producer()
    cluster.wait_for(lambda st: all(p["committed"] for p in st["partitions"]), timeout_s=120,
                     what="training under way on every partition")
    leaders = [p["leader_id"] for p in _describe(cluster.bootstrap, topic)]
    victim = max(set(leaders), key=leaders.count)  # the broker leading the most partitions
    ends = {p["partition"]: p["end"] for p in cluster.wait_for(
        lambda st: all(p["end"] is not None for p in st["partitions"]), timeout_s=30, what="end offsets")["partitions"]}
    assert cluster.producer is not None and cluster.producer.returncode is None, "the stream ended before the kill"
    cluster.kill_broker(victim - 1)

    # The two left elect new leaders and carry on (acks=all needs two copies in sync: they are two):
    # every partition, the dead broker's too, takes new records, which are consumed and committed.
    # No Kafka client of this process meets the dead broker (kafka-python 3.0 leaks the socket of a
    # refused connection, which fails the run here); the services, each its own process, do.
    cluster.wait_for(lambda st: all((p["committed"] or 0) >= ends[p["partition"]] + SHARDS_AFTER_KILL
                                    for p in st["partitions"]),
                     timeout_s=120, what=f"every partition consumed well past where it was when broker {victim} died")
    cluster.restart_broker(victim - 1)  # back on its folder: it catches up and rejoins every ISR
    cluster.wait_consumed(timeout_s=300)
    with contextlib.closing(redis_lib.Redis.from_url(cluster.redis_url)) as client:
        wait_until(lambda: unapplied_updates(client, cluster.spec.job) == 0, 60,
                   what="every pushed update to be applied")
    cluster.raise_if_crashed()

    report = audit(cluster.bootstrap, topic, cluster.redis_url, cluster.spec.job)
    assert report.exact and report.uncommitted == 0, report
    assert report.expected == report.applied == PASSES * DIGITS_TRAIN, report  # nothing lost, nothing twice
    assert report.rejected_updates == 0 and report.dead_letters == 0, report
    wait_until(lambda: all(victim in p["isr_nodes"] for p in _describe(cluster.bootstrap, topic)), 60,
               what=f"broker {victim} back in every in-sync replica set")
