"""The launcher starts real servers, reports failures clearly and leaves nothing behind."""

from __future__ import annotations

import base64
import socket

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from streamtrain.launcher import KafkaBroker, LaunchError, RedisServer, ServerState, pid_alive
from streamtrain.launcher.kafka import random_cluster_id


def test_kafka_round_trip_across_partitions(kafka) -> None:
    topic = kafka.create_topic(partitions=3)
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all",
                             enable_idempotence=True)
    sent = {p: [f"{p}-{i}".encode() for i in range(20)] for p in range(3)}
    for p, values in sent.items():
        for v in values:
            producer.send(topic, v, partition=p)
    producer.flush()
    producer.close()

    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap, enable_auto_commit=False)
    consumer.assign([TopicPartition(topic, p) for p in range(3)])
    consumer.seek_to_beginning()
    got: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    for _ in range(60):
        for tp, records in consumer.poll(timeout_ms=500).items():
            got[tp.partition].extend(r.value for r in records)
        if sum(map(len, got.values())) >= 60:
            break
    consumer.close()
    assert got == sent  # every record, on its partition, in order


def test_redis_round_trip(redis) -> None:
    redis.set("k", b"\x00\x01binary")
    assert redis.get("k") == b"\x00\x01binary"
    assert redis.incr("n") == 1
    assert redis.dbsize() == 2


def test_redis_port_in_use_gives_clear_error() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        server = RedisServer(port=port, start_timeout_s=15)
        with pytest.raises(LaunchError) as err:
            server.start()
    message = str(err.value)
    assert "redis exited with code" in message
    assert "Address already in use" in message  # the log's tail is in the error
    assert server.state is ServerState.STOPPED
    server.cleanup()


def test_kafka_bad_config_gives_clear_error() -> None:
    broker = KafkaBroker(extra_config={"num.io.threads": "not-a-number"}, start_timeout_s=60)
    with pytest.raises(LaunchError) as err:
        broker.start()
    assert "kafka" in str(err.value)
    assert "num.io.threads" in str(err.value)
    broker.cleanup()


def test_kafka_home_without_jars_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KAFKA_HOME", str(tmp_path))
    with pytest.raises(LaunchError, match="KAFKA_HOME=.* has no libs/kafka_2.13"):
        KafkaBroker()


def test_missing_redis_binary_is_refused() -> None:
    with pytest.raises(LaunchError, match="'redis-server-nope' not found"):
        RedisServer(binary="redis-server-nope")


def test_stop_leaves_no_process() -> None:
    redis_server = RedisServer().start()
    broker = KafkaBroker(heap_mb=256, log_level="WARN").start()
    pids = [redis_server.pid, broker.pid]
    assert all(pid is not None and pid_alive(pid) for pid in pids)
    workdirs = [redis_server.workdir, broker.workdir]
    broker.stop()
    redis_server.stop()
    assert not any(pid_alive(pid) for pid in pids)
    assert not any(d.exists() for d in workdirs)
    broker.stop()  # idempotent
    assert broker.state is ServerState.STOPPED


def test_cluster_ids_never_start_with_a_dash() -> None:
    """kafka-storage would read ``-t -Xyz`` as an option: one id in 64 used to start with '-'."""
    ids = [random_cluster_id() for _ in range(5000)]
    assert not [i for i in ids if i.startswith("-")]
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids[:100])
