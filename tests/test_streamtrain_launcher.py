"""The launcher starts real servers, reports failures clearly and leaves nothing behind."""

from __future__ import annotations

import base64
import logging
import socket

import pytest
import redis as redis_lib
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from streamtrain.launcher import KafkaBroker, LaunchError, RedisServer, ServerState, pid_alive, redact_url
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


def test_redis_requires_its_password(redis_server) -> None:
    server = redis_server.server
    assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
    anonymous = redis_lib.Redis(host=server.host, port=server.port)
    wrong = redis_lib.Redis.from_url(f"redis://:not-it@{server.host}:{server.port}/0")
    try:
        with pytest.raises(redis_lib.AuthenticationError):
            anonymous.ping()
        with pytest.raises(redis_lib.AuthenticationError):
            wrong.ping()
    finally:
        anonymous.close()
        wrong.close()
    assert RedisServer().password != RedisServer().password  # a fresh random one each


def test_redis_password_stays_out_of_argv_logs_and_errors(
        caplog: pytest.LogCaptureFixture) -> None:
    password = "p@ss:w/rd%40#x"  # URL-special characters survive the URL round trip
    caplog.set_level(logging.DEBUG, logger="streamtrain.launcher")
    with RedisServer(password=password) as server:
        client = redis_lib.Redis.from_url(server.url_for(3))
        try:
            assert client.set("k", b"v") and client.get("k") == b"v"
        finally:
            client.close()
        with open(f"/proc/{server.pid}/cmdline", "rb") as fh:
            assert password.encode() not in fh.read()
        assert (server.workdir / "redis.conf").stat().st_mode & 0o077 == 0
        assert password not in server.display_url and "***" in server.display_url
        assert password not in server.log_path.read_text()
    assert password not in caplog.text
    with socket.socket() as blocker:  # a failed start's error carries the log's tail, not the password
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        failed = RedisServer(port=blocker.getsockname()[1], password=password, start_timeout_s=15)
        with pytest.raises(LaunchError) as err:
            failed.start()
    failed.cleanup()
    assert password not in str(err.value)
    with pytest.raises(ValueError, match="without spaces, quotes") as bad:
        RedisServer(password="has space")
    assert "has space" not in str(bad.value)
    with pytest.raises(ValueError, match="non-empty"):
        RedisServer(password="")


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://app:s%40cret@redis:6379/2", "redis://app:***@redis:6379/2"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("rediss://:x@host/0?ssl_cert_reqs=none", "rediss://:***@host/0?ssl_cert_reqs=none"),
])
def test_redact_url_masks_only_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


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
    broker = KafkaBroker(extra_config={"num.io.threads": "not-a-number"}, start_timeout_s=120)
    with pytest.raises(LaunchError) as err:
        broker.start()
    assert "kafka" in str(err.value)
    assert "num.io.threads" in str(err.value)
    broker.cleanup()


def test_kafka_home_without_jars_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KAFKA_HOME", str(tmp_path))
    with pytest.raises(LaunchError, match=r"KAFKA_HOME=.* has no libs/kafka_2\.13"):
        KafkaBroker()


def test_missing_redis_binary_is_refused() -> None:
    with pytest.raises(LaunchError, match="'redis-server-nope' not found"):
        RedisServer(binary="redis-server-nope")


def test_stop_leaves_no_process() -> None:
    redis_server = RedisServer().start()
    broker = KafkaBroker(heap_mb=256, log_level="WARN", start_timeout_s=120).start()
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
