"""A trainer drained by the coordinator settles its push, leaves and exits; another trainer
finishes its partitions from the committed offsets, and the record-by-record audit is exact.
Real Kafka, Redis, coordinator (on a test server) and parameter server; trainers in-process."""

from __future__ import annotations

import asyncio
import dataclasses

import redis as redis_lib

from coordinator.settings import CoordinatorSettings
from coordinator.testing import running_coordinator
from datastream import produce
from services import ParameterServer, ServerSettings, committed_offsets, unapplied_updates
from streamtrain.accounting import audit
from streamtrain.launcher import await_until
from trainers.service import Trainer
from trainers.settings import TrainerSettings

JOB = "drainjob"
ADMIN = {"Authorization": "Bearer a"}


async def test_a_drained_trainer_leaves_and_another_finishes_its_records(kafka, redis_url: str) -> None:
    topic = kafka.create_topic(partitions=2)
    produced = await asyncio.to_thread(produce, kafka.bootstrap, topic, "digits?repeat=4", partitions=2,
                                       shard_size=16, split="train")
    settings = CoordinatorSettings(job=JOB, redis_url=redis_url, kafka_bootstrap=kafka.bootstrap, topic=topic,
                                   partitions=2, admin_token="a", job_token="j", kafka_timeout_ms=5000,
                                   lease_ms=5000, heartbeat_interval_ms=250)
    client = redis_lib.Redis.from_url(redis_url)
    async with running_coordinator(settings) as coordinator:
        trainer_settings = TrainerSettings(
            job=JOB, coordinator_url=str(coordinator.make_url("")).rstrip("/"), job_token="j",
            redis_url=redis_url, kafka_bootstrap=kafka.bootstrap, model="digits-mlp", batch_size=16,
            commit_to_kafka=False)
        ps = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, block_ms=50))
        ps_started = asyncio.create_task(asyncio.to_thread(ps.start, 60.0))  # waits for the model
        first = Trainer(trainer_settings)
        first_run = asyncio.create_task(first.run())
        second_run: asyncio.Task[int] | None = None
        try:
            await await_until(lambda: first.progress.steps >= 5 or first_run.done(), 120,
                              what="the first trainer to take a few steps")
            assert not first_run.done(), "the first trainer ended before it was drained"
            member = first.state.member_id
            reply = await coordinator.post(f"/v1/admin/members/{member}/drain", headers=ADMIN)
            assert reply.status == 200, await reply.text()
            assert await asyncio.wait_for(first_run, 60) == 0  # it settled, left and returned by itself
            members = await (await coordinator.get("/v1/members", headers=ADMIN)).json()
            assert member not in {m["member_id"] for m in members["members"]}
            done_by_first = first.progress.steps
            assert 0 < done_by_first * 16 < produced.records  # it left records for the next owner

            second = Trainer(dataclasses.replace(trainer_settings, seed=1))
            second_run = asyncio.create_task(second.run())

            def consumed() -> bool:
                assert second_run is not None and not second_run.done(), "the second trainer ended early"
                # a fresh topic: every message is committed when the offsets add up to the shards sent
                return sum(n or 0 for n in committed_offsets(client, JOB, [0, 1]).values()) == produced.shards

            await await_until(lambda: asyncio.to_thread(consumed), 180,
                              what="the second trainer to commit every message")
            second.stop()
            assert await asyncio.wait_for(second_run, 60) == 0
            await await_until(lambda: asyncio.to_thread(lambda: unapplied_updates(client, JOB) == 0), 60,
                              what="the parameter server to apply every update")
        finally:
            first.stop()
            if second_run is not None and not second_run.done():
                second_run.cancel()
            await asyncio.gather(first_run, *([second_run] if second_run else []), return_exceptions=True)
            await ps_started
            await asyncio.to_thread(ps.close)
            client.close()
    report = await asyncio.to_thread(audit, kafka.bootstrap, topic, redis_url, JOB)
    assert report.exact, report
    assert report.expected == produced.records
