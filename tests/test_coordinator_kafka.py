"""The coordinator against the real Kafka broker: readiness and per-partition lag."""

from __future__ import annotations

import redis as redis_lib
from kafka import KafkaProducer

from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from coordinator.testing import running_coordinator


async def test_readyz_and_partition_lag(kafka, redis_url: str, redis: redis_lib.Redis) -> None:
    topic = kafka.create_topic(partitions=3)
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
    try:
        for i in range(5):
            producer.send(topic, b"x%d" % i, partition=0)
        for i in range(2):
            producer.send(topic, b"y%d" % i, partition=1)
        producer.flush(timeout=30)
    finally:
        producer.close()
    keys = JobKeys("lagjob")
    redis.hset(keys.offsets, mapping={"0": 3})
    redis.set(keys.group(0).version, 7)  # two shard groups, each at its own version
    redis.set(keys.group(1).version, 9)
    settings = CoordinatorSettings(job="lagjob", redis_url=redis_url, kafka_bootstrap=kafka.bootstrap,
                                   topic=topic, partitions=3, admin_token="a", job_token="j",
                                   kafka_timeout_ms=5000, ps_groups=2)
    async with running_coordinator(settings) as client:
        ready = await client.get("/readyz")
        assert ready.status == 200, await ready.text()
        assert (await ready.json())["checks"] == {"redis": "ok", "kafka": "ok"}
        resp = await client.post("/v1/members", headers={"Authorization": "Bearer j"},
                                 json={"capabilities": {"device": "cpu"}})
        member = (await resp.json())["member_id"]
        parts = (await (await client.get("/v1/partitions")).json())["partitions"]
        assert [(p["owner"], p["committed"], p["end"], p["lag"]) for p in parts] == [
            (member, 3, 5, 2), (member, None, 2, 2), (member, None, 0, 0)]
        status = await (await client.get("/v1/status")).json()
        assert status["lag"] == 4
        # the model version is the sum of the groups' versions
        assert status["versions"] == {"model": 16, "groups": {"0": 7, "1": 9}, "min": 7, "max": 9}
