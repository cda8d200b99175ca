"""The coordinator over real HTTP and a real Redis: membership, leases, fencing, auth, bad input."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from dataclasses import replace
from importlib import resources
from typing import Any

import aiohttp
import pytest
import redis as redis_lib
import redis.asyncio as aioredis
import torch
import yaml
from aiohttp.test_utils import TestClient, make_mocked_request
from plane_util import push_offsets_only
from prometheus_client.parser import text_string_to_metric_families

from common.keys import JobKeys
from coordinator import join_status as join_status_module
from coordinator import routes
from coordinator import status as status_module
from coordinator.app import create_app
from coordinator.client import CoordinatorClient
from coordinator.errors import AuthError, BadRequestError, MemberGoneError
from coordinator.join_route import REPORT as JOIN_REPORT
from coordinator.join_status import JOIN
from coordinator.serving_route import REPORT
from coordinator.settings import CONSISTENCY_MODELS, OPTIMIZERS, CoordinatorSettings
from coordinator.state import JobConfig, Store, parse_assignment
from coordinator.status import FORGET_AFTER_S, SERVING
from coordinator.testing import running_coordinator
from coordinator.validation import CONFIG_CHANGE, HEARTBEAT, REGISTER, Field
from services import FencedError, ParameterStore
from services.tables import TableSpec
from streamtrain.launcher import await_until

JOB = "job1"
KEYS = JobKeys(JOB)
JOB_AUTH = {"Authorization": "Bearer job-secret"}
ADMIN_AUTH = {"Authorization": "Bearer admin-secret"}
CPU = {"capabilities": {"device": "cpu", "threads": 1, "hostname": "host-a"}}



@pytest.fixture
def settings(redis_url: str, silent_broker: str) -> CoordinatorSettings:
    """Coordinator settings on this test's Redis database; Kafka is down (see test_coordinator_kafka).

    The lease is long (30 s) so that no member of a test that does not heartbeat expires on a
    loaded machine; the tests of expiry set their own."""
    return CoordinatorSettings(job=JOB, redis_url=redis_url, kafka_bootstrap=silent_broker,
                               topic="train", partitions=6, lease_ms=30_000,
                               heartbeat_interval_ms=1000, admin_token="admin-secret",
                               job_token="job-secret", kafka_timeout_ms=200,
                               max_request_bytes=4096)




def assignment(redis: redis_lib.Redis) -> dict[int, tuple[str, int]]:
    return parse_assignment(redis.hgetall(KEYS.assignment))


def dump(redis: redis_lib.Redis) -> dict[str, Any]:
    """Every key of the database with its value (to show a refused request changed nothing)."""
    out: dict[str, Any] = {}
    for key in sorted(redis.keys("*")):
        kind = redis.type(key)
        out[key.decode()] = redis.hgetall(key) if kind == b"hash" else redis.get(key)
    return out


async def register(client: TestClient, body: dict[str, Any] = CPU) -> dict[str, Any]:
    resp = await client.post("/v1/members", json=body, headers=JOB_AUTH)
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def test_register_heartbeat_and_redis_contract(settings: CoordinatorSettings,
                                                     redis: redis_lib.Redis) -> None:
    async with running_coordinator(settings) as client:
        a = await register(client)
        assert a["member_id"].startswith("host-a-") and a["generation"] == 1
        assert a["partitions"] == [0, 1, 2, 3, 4, 5] and a["state"] == "active"
        assert a["lease_ms"] == 30_000 and a["heartbeat_interval_ms"] == 1000
        assert a["config"] == {"consistency": "ssp", "staleness": 2, "codec": "topk+fp16",
                               "optimizer": "lazyadam", "lr": 0.005, "topic": "train",
                               "partitions": 6, "ps_groups": 1, "local_steps": 1, "outer_lr": 0.7,
                               "outer_momentum": 0.9, "paused": False}
        gpu = await register(client, {"capabilities": {"device": "cuda", "threads": 4}})
        assert gpu["member_id"] != a["member_id"] and gpu["generation"] == 2
        # weights cuda 8*sqrt(4)=16 vs cpu 1*sqrt(1)=1: shares 5.65 and 0.35 of 6 partitions
        assert gpu["partitions"] == [0, 1, 2, 3, 4, 5]
        # the contract: generation and every assignment entry "<member>|<generation>"
        assert int(redis.get(KEYS.generation)) == 2
        owners = assignment(redis)
        assert sorted(owners) == list(range(6)) and {g for _, g in owners.values()} == {2}
        assert json.loads(redis.hget(KEYS.members, a["member_id"]))["capabilities"]["device"] == "cpu"
        assert redis.hget(KEYS.config, "consistency") == b"ssp"

        resp = await client.post(f"/v1/members/{a['member_id']}/heartbeat", headers=JOB_AUTH,
                                 json={"stats": {"records_per_s": 100.5, "loss": 0.25,
                                                 "clock": 3, "lag": 7, "freshness_s": [0.2, 1.5]}})
        assert resp.status == 200
        hb = await resp.json()
        assert hb["generation"] == 2 and hb["partitions"] == [p for p, (m, _) in owners.items()
                                                             if m == a["member_id"]]
        stored = json.loads(redis.hget(KEYS.members, a["member_id"]))
        assert stored["stats"]["loss"] == 0.25 and stored["lease_expires_ms"] > a["lease_ms"]

        members = await (await client.get("/v1/members")).json()
        assert [m["member_id"] for m in members["members"]] == sorted([a["member_id"],
                                                                        gpu["member_id"]])
        status = await (await client.get("/v1/status")).json()
        assert status["generation"] == 2 and status["throughput_records_per_s"] == 100.5
        assert status["loss"] == 0.25
        assert all(p["end"] is None for p in status["partitions"])  # Kafka unreachable here


async def test_lease_expiry_reassigns_within_timeout(settings: CoordinatorSettings,
                                                     redis: redis_lib.Redis) -> None:
    # the alive member heartbeats about fifteen times a lease, so a loaded machine never lets it lapse
    settings = replace(settings, lease_ms=3000, heartbeat_interval_ms=500)
    async with running_coordinator(settings) as client:
        alive = await register(client)
        doomed = await register(client)
        gen = int(redis.get(KEYS.generation))
        assert {m for m, _ in assignment(redis).values()} == {alive["member_id"],
                                                              doomed["member_id"]}
        stop = asyncio.Event()

        async def keep_alive() -> None:
            while not stop.is_set():
                resp = await client.post(f"/v1/members/{alive['member_id']}/heartbeat",
                                         headers=JOB_AUTH, json={})
                assert resp.status == 200
                await asyncio.sleep(0.2)

        beat = asyncio.create_task(keep_alive())
        try:
            # the doomed member never heartbeats: its lease (3 s) runs out
            owners = await await_until(lambda: (o := assignment(redis)) and all(
                m == alive["member_id"] for m, _ in o.values()) and o, 60,
                what="the doomed member's partitions to move to the alive one")
        finally:
            stop.set()
            await beat
        assert {g for _, g in owners.values()} == {gen + 1} == {int(redis.get(KEYS.generation))}
        assert sorted(owners) == list(range(6))
        assert redis.hexists(KEYS.members, doomed["member_id"]) == 0
        assert json.loads(redis.hget(KEYS.departed, doomed["member_id"]))["reason"] == "expired"
        resp = await client.post(f"/v1/members/{doomed['member_id']}/heartbeat",
                                 headers=JOB_AUTH, json={})
        assert resp.status == 410
        assert "register anew" in (await resp.json())["error"]["message"]
        # the alive member's partitions stayed put (sticky)
        assert all(owners[p][0] == alive["member_id"] for p in alive["partitions"])
        text = await (await client.get("/metrics")).text()
        delay = {s.name: s.value for f in text_string_to_metric_families(text)
                 for s in f.samples if f.name == "streamtrain_reassignment_delay_seconds"}
        assert delay["streamtrain_reassignment_delay_seconds_count"] == 1


async def test_sticky_rebalance_on_join_and_graceful_leave(settings: CoordinatorSettings,
                                                           redis: redis_lib.Redis) -> None:
    async with running_coordinator(settings) as client:
        a = await register(client)
        b = await register(client)
        before = assignment(redis)
        c = await register(client)
        after = assignment(redis)
        moved = [p for p in before if before[p][0] != after[p][0]]
        assert moved and all(after[p][0] == c["member_id"] for p in moved)
        assert len(c["partitions"]) == 2
        gen = int(redis.get(KEYS.generation))
        resp = await client.post(f"/v1/members/{b['member_id']}/leave", headers=JOB_AUTH)
        assert resp.status == 200 and (await resp.json())["generation"] == gen + 1
        final = assignment(redis)
        assert {m for m, _ in final.values()} == {a["member_id"], c["member_id"]}
        for p, (m, _) in after.items():
            if m != b["member_id"]:
                assert final[p][0] == m
        resp = await client.post(f"/v1/members/{b['member_id']}/heartbeat", headers=JOB_AUTH)
        assert resp.status == 410 and (await resp.json())["error"]["code"] == "member_gone"
        resp = await client.post("/v1/members/never-seen/heartbeat", headers=JOB_AUTH)
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_member"


async def test_the_coordinator_forgets_departed_members_after_its_retention(settings: CoordinatorSettings,
                                                                            redis: redis_lib.Redis) -> None:
    async with running_coordinator(replace(settings, departed_retention_s=0.0)) as client:
        a = await register(client)
        resp = await client.post(f"/v1/members/{a['member_id']}/leave", headers=JOB_AUTH)
        assert resp.status == 200
        # the lease checker sweeps the departed records (at most once a second at this retention)
        await await_until(lambda: not redis.hexists(KEYS.departed, a["member_id"]), 60,
                          what="the departed record to be forgotten")
        resp = await client.post(f"/v1/members/{a['member_id']}/heartbeat", headers=JOB_AUTH)
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_member"


async def test_two_coordinators_compare_and_set(settings: CoordinatorSettings,
                                                redis: redis_lib.Redis) -> None:
    """Concurrent registrations through two coordinators on one Redis: none is lost."""
    async with running_coordinator(settings) as one, running_coordinator(settings) as two:
        regs = await asyncio.gather(*(register(c) for c in [one, two] * 5))
    ids = {r["member_id"] for r in regs}
    assert len(ids) == 10 and sorted(r["generation"] for r in regs) == list(range(1, 11))
    assert {k.decode() for k in redis.hkeys(KEYS.members)} == ids
    owners = assignment(redis)
    assert sorted(owners) == list(range(6)) and {g for _, g in owners.values()} == {10}
    assert int(redis.get(KEYS.generation)) == 10


async def test_restart_keeps_state_and_config(settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    # leases long enough to outlive the first coordinator's start and stop on a loaded machine
    settings = replace(settings, lease_ms=5000, heartbeat_interval_ms=1000)
    async with running_coordinator(settings) as client:
        a = await register(client)
        b = await register(client)
        resp = await client.patch("/v1/admin/config", headers=ADMIN_AUTH,
                                  json={"consistency": "bsp", "lr": 0.5})
        assert resp.status == 200
    owners = assignment(redis)
    # down for longer than a lease; the new coordinator has other job flags
    deadline = json.loads(redis.hget(KEYS.members, a["member_id"]))["lease_expires_ms"]
    await await_until(lambda: time.time() * 1000 > deadline + 200, 60, what="a's stored lease to run out")
    async with running_coordinator(replace(settings, consistency="asp", lr=0.1)) as client:
        # stored membership wins and leases were renewed: nobody was expired by the restart
        resp = await client.post(f"/v1/members/{a['member_id']}/heartbeat", headers=JOB_AUTH)
        assert resp.status == 200, await resp.text()
        hb = await resp.json()
        assert hb["generation"] == 2 and hb["partitions"] == sorted(
            p for p, (m, _) in owners.items() if m == a["member_id"])
        # stored config wins over the new flags
        assert hb["config"]["consistency"] == "bsp" and hb["config"]["lr"] == 0.5
        members = await (await client.get("/v1/members")).json()
        assert {m["member_id"] for m in members["members"]} == {a["member_id"], b["member_id"]}
        assert assignment(redis) == owners
        # and the restarted coordinator runs the lease checker: b never heartbeats again
        await await_until(lambda: not redis.hexists(KEYS.members, b["member_id"]), 60,
                          what="the restarted coordinator to expire b")
    assert redis.hget(KEYS.config, "consistency") == b"bsp"



async def test_ps_groups_is_written_when_the_job_begins_and_shapes_the_model(
        settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    """``--ps-groups 2`` reaches the model: the coordinator writes it into the job config, and the
    parameter store creates the model with two shard groups (``streamtrain ps --groups 2``)."""
    async with running_coordinator(replace(settings, ps_groups=2)) as client:
        assert redis.hget(KEYS.config, "ps_groups") == b"2"
        status = await (await client.get("/v1/status")).json()
        assert status["config"]["ps_groups"] == 2
        reg = await CoordinatorClient(str(client.make_url("")), "job-secret",
                                      session=client.session).register({"device": "cpu"})
        assert reg.assignment.config.ps_groups == 2
        meta = ParameterStore(redis, JOB).init_model({"w": torch.zeros(300), "b": torch.zeros(3)},
                                                     shard_elems=64)
        assert meta.groups == 2
    # a restart with another flag keeps the stored count (the model's layout)
    async with running_coordinator(replace(settings, ps_groups=5)) as client:
        status = await (await client.get("/v1/status")).json()
        assert status["config"]["ps_groups"] == 2


async def test_status_shows_the_embedding_tables_summed_over_the_groups(
        settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    """``tables``: per table of the model, in its order, the rows (HLEN), bytes (MEMORY USAGE) and
    the servers' counters summed over both groups; the hit rate is the mean of the trainers that
    report one. A dense job (or one without a model yet) has none."""
    async with running_coordinator(replace(settings, ps_groups=2)) as client:
        status = await (await client.get("/v1/status")).json()
        assert status["tables"] == {"row_cache_hit_rate": None, "per_table": []}  # no model yet
        ParameterStore(redis, JOB).init_model({"w": torch.zeros(8)}, shard_elems=64,
                                              tables=(TableSpec("user", 4), TableSpec("item", 2)))
        for g, n in ((0, 3), (1, 2)):
            gk = KEYS.group(g)
            redis.hset(gk.table_rows("user"), mapping={i.to_bytes(8, "little"): b"r" * 40 for i in range(n)})
            redis.hset(gk.table_stats, mapping={"user:admitted": 10 + g, "user:dropped": 2, "user:steps": 9,
                                                "user:expired": g, "item:evicted": 3 * g})
        a, b, c = (await register(client))["member_id"], (await register(client))["member_id"], \
            (await register(client))["member_id"]
        for member, stats in ((a, {"row_cache_hit_rate": 0.5}), (b, {"row_cache_hit_rate": 1.0}), (c, {})):
            resp = await client.post(f"/v1/members/{member}/heartbeat", headers=JOB_AUTH, json={"stats": stats})
            assert resp.status == 200, await resp.text()
        resp = await client.post(f"/v1/members/{c}/heartbeat", headers=JOB_AUTH,
                                 json={"stats": {"row_cache_hit_rate": 1.5}})
        assert resp.status == 400 and "stats.row_cache_hit_rate" in (await resp.json())["error"]["message"]

        tables = (await (await client.get("/v1/status")).json())["tables"]
        assert tables["row_cache_hit_rate"] == 0.75  # a and b; c reports none
        user_bytes = sum(redis.memory_usage(KEYS.group(g).table_rows("user"), samples=5) for g in (0, 1))
        assert tables["per_table"] == [
            {"name": "user", "rows": 5, "bytes": user_bytes, "admitted": 21, "dropped": 4, "expired": 1,
             "evicted": 0},
            {"name": "item", "rows": 0, "bytes": 0, "admitted": 0, "dropped": 0, "expired": 0, "evicted": 3}]
        assert user_bytes > 5 * 40


async def test_a_change_of_ps_groups_is_refused(settings: CoordinatorSettings,
                                               redis: redis_lib.Redis) -> None:
    async with running_coordinator(replace(settings, ps_groups=2)) as client:
        before = dump(redis)
        resp = await client.patch("/v1/admin/config", headers=ADMIN_AUTH, json={"ps_groups": 4})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_body" and error["message"].startswith("ps_groups cannot change")
        assert "fixed when the job's model is created" in error["message"]
        assert dump(redis) == before
    store = Store(aioredis.Redis.from_url(settings.redis_url), JOB)
    try:  # the store refuses it too, not only the API
        with pytest.raises(ValueError, match="ps_groups cannot change"):
            await store.update_config(ps_groups=4)
        assert (await store.config()).ps_groups == 2
    finally:
        await store.redis.aclose()


@pytest.mark.parametrize(("field", "value"), [("local_steps", 4), ("outer_lr", 0.5), ("outer_momentum", 0.5)])
async def test_a_change_of_local_steps_or_the_outer_optimizer_is_refused(settings: CoordinatorSettings,
                                                                       redis: redis_lib.Redis, field: str,
                                                                       value: float) -> None:
    async with running_coordinator(replace(settings, codec="fp16", local_steps=8)) as client:
        before = dump(redis)
        assert redis.hget(KEYS.config, "local_steps") == b"8"
        resp = await client.patch("/v1/admin/config", headers=ADMIN_AUTH, json={field: value})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_body" and error["message"].startswith(f"{field} cannot change")
        assert "outer optimizer are fixed" in error["message"]
        assert dump(redis) == before


async def test_a_job_older_than_ps_groups_takes_its_models_group_count(redis_url: str,
                                                                       redis: redis_lib.Redis) -> None:
    """A job begun before ``ps_groups`` was written: its config reads as 1 until a coordinator
    starts, which then writes the group count of the model that exists."""
    config = JobConfig(consistency="ssp", staleness=2, codec="none", optimizer="sgd", lr=0.1,
                       topic="train", partitions=2)
    old = {k: v for k, v in config.to_hash().items() if k != "ps_groups"}
    redis.hset(KEYS.config, mapping=old)
    ParameterStore(redis, JOB).init_model({"w": torch.zeros(200)}, shard_elems=64, groups=3)
    store = Store(aioredis.Redis.from_url(redis_url), JOB)
    try:
        assert (await store.config()).ps_groups == 1
        stored = await store.ensure_config(replace(config, ps_groups=1))
        assert stored.ps_groups == 3 and redis.hget(KEYS.config, "ps_groups") == b"3"
    finally:
        await store.redis.aclose()

async def test_the_tables_own_consistency_is_written_when_the_job_begins_and_kept_on_restart(
        settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    """``--table-consistency asp --table-staleness 8`` reach the job config, a trainer's assignment
    and the status; a restart keeps them, whatever its own flags say."""
    async with running_coordinator(replace(settings, table_consistency="asp", table_staleness=8)) as client:
        assert (redis.hget(KEYS.config, "table_consistency"), redis.hget(KEYS.config, "table_staleness")) == (
            b"asp", b"8")
        reg = await CoordinatorClient(str(client.make_url("")), "job-secret",
                                      session=client.session).register({"device": "cpu"})
        config = reg.assignment.config
        assert (config.consistency, config.staleness, config.table_consistency, config.table_staleness) == (
            "ssp", 2, "asp", 8)
        assert config.table_bound() == ("asp", 8)
        status = await (await client.get("/v1/status")).json()
        assert (status["config"]["table_consistency"], status["config"]["table_staleness"]) == ("asp", 8)
        assert status["staleness"]["tables"] == {"consistency": "asp", "bound": 8}
        assert (status["staleness"]["consistency"], status["staleness"]["bound"]) == ("ssp", 2)
    async with running_coordinator(replace(settings, table_consistency="bsp")) as client:
        status = await (await client.get("/v1/status")).json()
        assert status["staleness"]["tables"] == {"consistency": "asp", "bound": 8}


async def test_a_job_whose_tables_follow_the_dense_part_keeps_following_it_on_restart(
        settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    """Unset table fields are absent from the hash and from the assignment (so a trainer older than
    them parses it), and a restart with table flags does not fill them in: absence is the job's
    setting (follow the dense part), as a stored value is."""
    async with running_coordinator(settings) as client:
        a = await register(client)
        assert "table_consistency" not in a["config"] and "table_staleness" not in a["config"]
        assert not redis.hexists(KEYS.config, "table_consistency")
        assert not redis.hexists(KEYS.config, "table_staleness")
        status = await (await client.get("/v1/status")).json()
        assert status["staleness"]["tables"] == {"consistency": "ssp", "bound": 2}
    async with running_coordinator(replace(settings, table_consistency="asp", table_staleness=8)) as client:
        hb = await (await client.post(f"/v1/members/{a['member_id']}/heartbeat", headers=JOB_AUTH)).json()
        assert "table_consistency" not in hb["config"] and "table_staleness" not in hb["config"]
        assert not redis.hexists(KEYS.config, "table_consistency")


async def test_patch_changes_the_tables_own_consistency_and_null_follows_the_dense_part_again(
        settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    async with running_coordinator(settings) as client:
        a = await register(client)
        resp = await client.patch("/v1/admin/config", headers=ADMIN_AUTH,
                                  json={"table_consistency": "asp", "table_staleness": 8})
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert (body["consistency"], body["table_consistency"], body["table_staleness"]) == ("ssp", "asp", 8)
        assert redis.hget(KEYS.config, "table_consistency") == b"asp"
        hb = await (await client.post(f"/v1/members/{a['member_id']}/heartbeat", headers=JOB_AUTH)).json()
        assert JobConfig.from_json(hb["config"]).table_bound() == ("asp", 8)
        # the dense part changes on its own; the tables keep theirs
        resp = await client.patch("/v1/admin/config", headers=ADMIN_AUTH, json={"consistency": "bsp"})
        assert (await resp.json())["table_consistency"] == "asp"
        status = await (await client.get("/v1/status")).json()
        assert (status["staleness"]["consistency"], status["staleness"]["tables"]) == (
            "bsp", {"consistency": "asp", "bound": 8})
        # null: the tables follow the dense part again (the field leaves the hash)
        resp = await client.patch("/v1/admin/config", headers=ADMIN_AUTH, json={"table_consistency": None})
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert "table_consistency" not in body and body["table_staleness"] == 8
        assert not redis.hexists(KEYS.config, "table_consistency")
        hb = await (await client.post(f"/v1/members/{a['member_id']}/heartbeat", headers=JOB_AUTH)).json()
        assert JobConfig.from_json(hb["config"]).table_bound() == ("bsp", 0)
        resp = await client.patch("/v1/admin/config", headers=ADMIN_AUTH,
                                  json={"consistency": "ssp", "table_staleness": None})
        assert resp.status == 200
        assert JobConfig.from_hash(redis.hgetall(KEYS.config)).table_bound() == ("ssp", 2)
        assert not any(k.startswith(b"table_") for k in redis.hkeys(KEYS.config))


async def test_fencing_of_stale_generation(settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    """What the coordinator writes fences a trainer's push (the parameter plane's push script)."""
    async with running_coordinator(settings) as client:
        client_a = CoordinatorClient(str(client.make_url("")), "job-secret",
                                     session=client.session)
        reg = await client_a.register({"device": "cpu", "threads": 2})
        a = reg.member_id
        push_offsets_only(redis, JOB, a, reg.generation, list(reg.partitions), clock=1)
        b = await register(client)
        with pytest.raises(FencedError, match=f"generation {reg.generation} of member {a} is stale"):
            push_offsets_only(redis, JOB, a, reg.generation, list(reg.partitions[:1]), clock=2)
        now = await client_a.heartbeat({"clock": 1})
        assert now.generation == reg.generation + 1
        push_offsets_only(redis, JOB, a, now.generation, list(now.partitions), clock=2)
        with pytest.raises(FencedError, match=re.escape(f"assigned to {b['member_id']}|{now.generation}, not {a}|")):
            push_offsets_only(redis, JOB, a, now.generation, b["partitions"][:1], clock=3)
        await client_a.leave()
        with pytest.raises(FencedError):
            push_offsets_only(redis, JOB, a, now.generation, list(now.partitions), clock=3)
        gone = CoordinatorClient(str(client.make_url("")), "job-secret", session=client.session)
        gone.member_id = reg.member_id
        with pytest.raises(MemberGoneError):
            await gone.heartbeat()
        with pytest.raises(AuthError):
            await CoordinatorClient(str(client.make_url("")), "wrong",
                                    session=client.session).register({"device": "cpu"})
        with pytest.raises(BadRequestError, match=r"capabilities\.device"):
            await client_a.register({"device": "abacus"})


async def test_drain_pause_resume(settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    async with running_coordinator(settings) as client:
        a = await register(client)
        b = await register(client)
        resp = await client.post(f"/v1/admin/members/{a['member_id']}/drain", headers=ADMIN_AUTH)
        assert resp.status == 200 and (await resp.json())["state"] == "draining"
        hb = await (await client.post(f"/v1/members/{a['member_id']}/heartbeat",
                                      headers=JOB_AUTH)).json()
        assert hb["state"] == "draining" and hb["partitions"] == []
        assert {m for m, _ in assignment(redis).values()} == {b["member_id"]}
        resp = await client.post("/v1/admin/pause", headers=ADMIN_AUTH)
        assert resp.status == 200 and redis.hget(KEYS.config, "paused") == b"1"
        hb = await (await client.post(f"/v1/members/{b['member_id']}/heartbeat",
                                      headers=JOB_AUTH)).json()
        assert hb["state"] == "paused" and hb["config"]["paused"] is True
        await client.post("/v1/admin/resume", headers=ADMIN_AUTH)
        hb = await (await client.post(f"/v1/members/{b['member_id']}/heartbeat",
                                      headers=JOB_AUTH)).json()
        assert hb["state"] == "active" and redis.hget(KEYS.config, "paused") == b"0"


@pytest.mark.parametrize(("method", "path", "headers", "body", "status", "needle"), [
    ("POST", "/v1/members", {}, CPU, 401, "missing bearer job token"),
    ("POST", "/v1/members", {"Authorization": "Bearer nope"}, CPU, 401, "wrong job token"),
    ("POST", "/v1/members", ADMIN_AUTH, CPU, 401, "wrong job token"),
    ("POST", "/v1/admin/pause", JOB_AUTH, None, 401, "wrong admin token"),
    ("PATCH", "/v1/admin/config", {}, {"lr": 1.0}, 401, "missing bearer admin token"),
    ("POST", "/v1/members", JOB_AUTH, b"{oops", 400, "malformed JSON"),
    ("POST", "/v1/members", JOB_AUTH, {"capabilities": {"device": "cpu"}, "extra": 1}, 400,
     "unknown field(s) 'extra'"),
    ("POST", "/v1/members", JOB_AUTH, {"capabilities": {"device": "cpu", "threads": 1.5}}, 400,
     "capabilities.threads: expected an integer"),
    ("POST", "/v1/members", JOB_AUTH, b'{"capabilities": {"device": "cpu", "hostname": "'
     + b"x" * 5000 + b'"}}', 413, "request body too large: the limit is 4096 bytes"),
    ("PATCH", "/v1/admin/config", ADMIN_AUTH, {"consistency": "eventual"}, 400,
     "consistency: must be one of bsp, ssp, asp"),
    ("PATCH", "/v1/admin/config", ADMIN_AUTH, {"table_consistency": "eventual"}, 400,
     "table_consistency: must be one of bsp, ssp, asp, got 'eventual'"),
    ("PATCH", "/v1/admin/config", ADMIN_AUTH, {"lr": 0.1, "table_staleness": -1}, 400,
     "table_staleness: must be >= 0, got -1"),
    ("PATCH", "/v1/admin/config", ADMIN_AUTH, {"table_staleness": "8"}, 400,
     "table_staleness: expected an integer, got str"),
    ("PATCH", "/v1/admin/config", ADMIN_AUTH, {"momentum": 0.9}, 400, "unknown field(s) 'momentum'"),
    ("PATCH", "/v1/admin/config", ADMIN_AUTH, {"lr": 0.1, "ps_groups": 4}, 400,
     "ps_groups cannot change: the parameter-server shard groups are fixed"),
    ("PATCH", "/v1/admin/config", ADMIN_AUTH, {}, 400, "name at least one of"),
    ("POST", "/v1/admin/pause", ADMIN_AUTH, {"now": True}, 400, "unknown field(s) 'now'"),
    ("GET", "/v1/nothing", {}, None, 404, "Not Found"),
    ("DELETE", "/v1/members", {}, None, 405, "Method Not Allowed"),
])
async def test_refused_requests_change_nothing(settings: CoordinatorSettings, redis: redis_lib.Redis,
                                               method: str, path: str, headers: dict[str, str],
                                               body: Any, status: int, needle: str) -> None:
    async with running_coordinator(settings) as client:
        member = await register(client)
        before = dump(redis)
        kwargs: dict[str, Any] = {"headers": headers}
        if isinstance(body, bytes):
            kwargs["data"] = body
        elif body is not None:
            kwargs["json"] = body
        resp = await client.request(method, path, **kwargs)
        assert resp.status == status
        assert resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert needle in error["message"], error
        assert dump(redis) == before
        # a heartbeat with bad stats is refused too, and the lease is not renewed
        resp = await client.post(f"/v1/members/{member['member_id']}/heartbeat",
                                 headers=JOB_AUTH, json={"stats": {"loss": "low"}})
        assert resp.status == 400 and "stats.loss" in (await resp.json())["error"]["message"]
        assert dump(redis) == before


async def test_error_statuses_follow_rfc_9110(settings: CoordinatorSettings) -> None:
    """413 (not 400) for an over-size body, naming the limit; 405 lists the methods in ``Allow``."""
    async with running_coordinator(settings) as client:
        big = {"capabilities": {"device": "cpu", "gpu_name": "x" * 200}, "pad": "y" * 5000}
        for method, path in [("POST", "/v1/members"), ("PATCH", "/v1/admin/config"),
                             ("POST", "/v1/members/m-1/heartbeat")]:
            resp = await client.request(method, path, json=big,
                                        headers=ADMIN_AUTH if "admin" in path else JOB_AUTH)
            assert resp.status == 413, (path, await resp.text())
            assert (await resp.json())["error"] == {
                "code": "body_too_large",
                "message": "request body too large: the limit is 4096 bytes"}
        resp = await client.delete("/v1/members")
        assert resp.status == 405 and resp.content_type == "application/json"
        assert set(resp.headers["Allow"].split(",")) == {"GET", "HEAD", "POST"}
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
        resp = await client.get("/v1/admin/config")
        assert resp.status == 405 and resp.headers["Allow"] == "PATCH"
        resp = await client.post("/v1/members", json=CPU)  # 401 keeps its challenge
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        assert "Allow" not in resp.headers


def test_tokens_are_compared_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest
    monkeypatch.setattr(routes.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    request = make_mocked_request("POST", "/v1/members", headers={"Authorization": "Bearer s3cret"})
    routes.authenticate(request, "s3cret", "job")
    with pytest.raises(routes.ApiError, match="wrong admin token"):
        routes.authenticate(request, "other", "admin")
    assert calls == [(b"s3cret", b"s3cret"), (b"s3cret", b"other")]


_OPENAPI_TYPES = {"str": "string", "int": "integer", "number": "number", "bool": "boolean",
                  "object": "object", "numbers": "array", "ints": "array", "objects": "array", "counts": "object"}


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _limit_problems(doc: dict[str, Any], where: str, fields: dict[str, Field],
                    schema: dict[str, Any]) -> list[str]:
    """Every way the OpenAPI object ``schema`` differs from the validation ``fields``: the
    same properties, required set, types, enum, minimum, maximum and maxLength/maxItems."""
    schema = _resolve(doc, schema)
    problems = []
    if schema.get("type") != "object" or schema.get("additionalProperties") is not False:
        problems.append(f"{where}: must be a closed object (additionalProperties: false)")
    props = schema.get("properties", {})
    if set(props) != set(fields):
        problems.append(f"{where}: properties {sorted(props)} != validated {sorted(fields)}")
    required = sorted(n for n, f in fields.items() if f.required)
    if sorted(schema.get("required", [])) != required:
        problems.append(f"{where}: required {schema.get('required', [])} != {required}")
    for name, field in fields.items():
        if name not in props:
            continue
        path, prop = f"{where}.{name}", _resolve(doc, props[name])
        kind = [_OPENAPI_TYPES[field.kind], "null"] if field.nullable else _OPENAPI_TYPES[field.kind]
        if prop.get("type") != kind:
            problems.append(f"{path}: type {prop.get('type')!r}, validated as {kind!r}")
        if field.kind == "object":
            problems += _limit_problems(doc, path, dict(field.schema or {}), prop)
            continue
        if field.kind == "objects":
            if prop.get("maxItems") != field.max_len:
                problems.append(f"{path}: maxItems {prop.get('maxItems')} != {field.max_len}")
            problems += _limit_problems(doc, f"{path}[]", dict(field.schema or {}), prop.get("items", {}))
            continue
        bounded = prop
        if field.kind in ("numbers", "ints"):
            if prop.get("maxItems") != field.max_len:
                problems.append(f"{path}: maxItems {prop.get('maxItems')} != {field.max_len}")
            bounded = prop.get("items", {})
            if bounded.get("type") != ("number" if field.kind == "numbers" else "integer"):
                problems.append(f"{path}: items must be {field.kind}")
        elif field.kind == "counts":
            if prop.get("maxProperties") != field.max_len:
                problems.append(f"{path}: maxProperties {prop.get('maxProperties')} != {field.max_len}")
            if prop.get("propertyNames") != {"pattern": f"^{field.names}$"}:
                problems.append(f"{path}: propertyNames {prop.get('propertyNames')} != the pattern ^{field.names}$")
            bounded = prop.get("additionalProperties") or {}
            if bounded.get("type") != "integer":
                problems.append(f"{path}: the counts must be integers")
        elif field.kind == "str" and field.choices is None and prop.get("maxLength") != field.max_len:
            problems.append(f"{path}: maxLength {prop.get('maxLength')} != {field.max_len}")
        choices = None if field.choices is None else [*field.choices, *([None] if field.nullable else [])]
        for key, want in (("enum", choices), ("minimum", field.min), ("maximum", field.max)):
            if bounded.get(key) != want:
                problems.append(f"{path}: {key} {bounded.get(key)!r} != enforced {want!r}")
    return problems


def test_openapi_declares_the_enforced_limits() -> None:
    doc = yaml.safe_load(resources.files("coordinator").joinpath("openapi.yaml").read_text("utf-8"))
    bodies = {("post", "/v1/members"): REGISTER,
              ("post", "/v1/members/{member_id}/heartbeat"): HEARTBEAT,
              ("patch", "/v1/admin/config"): CONFIG_CHANGE,
              ("post", "/v1/members/{member_id}/leave"): {},
              ("post", "/v1/admin/members/{member_id}/drain"): {},
              ("post", "/v1/admin/pause"): {},
              ("post", "/v1/admin/resume"): {},
              ("post", "/v1/serving/replicas/{name}"): REPORT,
              ("post", "/v1/join/joiners/{name}"): JOIN_REPORT}
    problems = []
    for (method, path), fields in bodies.items():
        op = doc["paths"][path][method]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        problems += _limit_problems(doc, f"{method.upper()} {path}", fields, schema)
        problems += [f"{method.upper()} {path}: no {code} answer" for code in ("400", "413")
                     if code not in op["responses"]]
    job_config = _resolve(doc, {"$ref": "#/components/schemas/JobConfig"})["properties"]
    problems += _limit_problems(doc, "JobConfig", CONFIG_CHANGE, {
        "type": "object", "additionalProperties": False,
        "properties": {k: job_config[k] for k in CONFIG_CHANGE}})
    assert job_config["consistency"]["enum"] == list(CONSISTENCY_MODELS)
    assert job_config["table_consistency"]["enum"] == [*CONSISTENCY_MODELS, None]
    assert job_config["optimizer"]["enum"] == list(OPTIMIZERS)
    limit = CoordinatorSettings.__dataclass_fields__["max_request_bytes"]
    assert doc["info"]["x-max-request-bytes"] == {"default": limit.default, "minimum": limit.metadata["min"],
                                                  "maximum": limit.metadata["max"]}
    assert not problems, "\n".join(problems)


async def test_metrics_parse_and_freshness(settings: CoordinatorSettings) -> None:
    async with running_coordinator(settings) as client:
        a = await register(client)
        await client.post(f"/v1/members/{a['member_id']}/heartbeat", headers=JOB_AUTH,
                          json={"stats": {"records_per_s": 50.0, "freshness_s": [0.1, 0.2, 3.0]}})
        resp = await client.get("/metrics")
        assert resp.status == 200 and resp.content_type == "text/plain"
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in families.values() for s in f.samples}
        assert samples[("streamtrain_generation", ())] == 1
        assert samples[("streamtrain_members", (("state", "active"),))] == 1
        assert samples[("streamtrain_freshness_seconds_count", ())] == 3
        assert samples[("streamtrain_member_records_per_second",
                        (("member", a["member_id"]),))] == 50.0


async def test_progressive_windows_go_to_the_history_and_the_newest_auc_to_status_and_metrics(
        settings: CoordinatorSettings) -> None:
    async with running_coordinator(settings) as client:
        a, b = (await register(client))["member_id"], (await register(client))["member_id"]
        for member, windows in ((a, [{"records": 500, "n": 500, "auc": 0.6, "log_loss": 0.68},
                                     {"records": 1000, "n": 500, "auc": None, "log_loss": 0.5}]),
                                (b, [{"records": 1500, "n": 1500, "auc": 0.8, "log_loss": 0.6}])):
            auc = next(w["auc"] for w in reversed(windows) if w["auc"] is not None)
            resp = await client.post(f"/v1/members/{member}/heartbeat", headers=JOB_AUTH,
                                     json={"stats": {"progressive": windows, "progressive_auc": auc}})
            assert resp.status == 200, await resp.text()

        async def pooled() -> dict[str, Any] | None:
            h = await (await client.get("/v1/history")).json()
            return h["progressive"] if h["progressive"]["job"]["records"][-1:] == [2500] else None

        progressive = await await_until(pooled, 30, interval_s=0.1, what="both heartbeats' windows pooled")
        job = progressive["job"]
        if len(job["records"]) == 1:  # both heartbeats pooled at one sample
            assert job["n"] == [2500]
            assert job["auc"] == [pytest.approx((500 * 0.6 + 1500 * 0.8) / 2000)]  # the one-class window weighs 0
        else:  # a sample fell between the two heartbeats
            assert (job["records"], job["n"], job["auc"]) == ([1000, 2500], [1000, 1500], [0.6, 0.8])
        assert progressive["members"][a]["records"] == [1000] and progressive["members"][b]["auc"] == [0.8]
        status = await (await client.get("/v1/status")).json()
        stats = {m["member_id"]: m["stats"] for m in status["members"]}
        assert stats[a] == {"progressive_auc": 0.6}  # the windows are the history's, not the membership's
        text = await (await client.get("/metrics")).text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("streamtrain_member_progressive_auc", (("member", b),))] == 0.8
        refused = await client.post(f"/v1/members/{a}/heartbeat", headers=JOB_AUTH,
                                    json={"stats": {"progressive": [{"records": 1, "n": 1, "log_loss": -1}]}})
        assert refused.status == 400 and "stats.progressive[0]" in (await refused.json())["error"]["message"]


async def test_openapi_documents_every_route(settings: CoordinatorSettings) -> None:
    app = create_app(settings)
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD"}
    async with running_coordinator(settings) as client:
        resp = await client.get("/v1/openapi.yaml")
        assert resp.status == 200
        doc = yaml.safe_load(await resp.text())
        page = await client.get("/")
        assert page.status == 200 and "/v1/status" in await page.text()
        assert (await (await client.get("/healthz")).json()) == {"status": "ok"}
        ready = await client.get("/readyz")
        body = await ready.json()
        assert ready.status == 503 and body["checks"]["redis"] == "ok"
        assert body["checks"]["kafka"].startswith("unreachable: KafkaTimeoutError")
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops
                  if method in {"get", "post", "patch", "put", "delete"}}
    assert documented == served


def test_settings_refuse_heartbeat_not_below_lease() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval_ms"):
        CoordinatorSettings(lease_ms=500, heartbeat_interval_ms=500)
    with pytest.raises(ValueError, match="admin-token"):
        create_app(CoordinatorSettings())


async def test_a_closed_presence_channel_removes_the_member_at_once_and_others_hear_of_it(
        settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    """A trainer's process dying closes its channel: it is removed long before its lease runs
    out, and the other member's channel announces the new generation."""
    # a lease far longer than the wait below: a removal within it can only be the channel's doing
    async with running_coordinator(replace(settings, lease_ms=120_000)) as client:
        a = await register(client)
        b = await register(client)
        url = "/v1/members/{}/channel"
        ws_a = await client.ws_connect(url.format(a["member_id"]), headers=JOB_AUTH)
        ws_b = await client.ws_connect(url.format(b["member_id"]), headers=JOB_AUTH)
        generation = int(redis.get(KEYS.generation))
        await ws_a.close()  # what the kernel does when the trainer dies
        announced = await asyncio.wait_for(ws_b.receive_json(), timeout=60.0)
        assert announced == {"generation": generation + 1}
        assert redis.hkeys(KEYS.members) == [b["member_id"].encode()]
        assert {owner for owner, _ in assignment(redis).values()} == {b["member_id"]}
        # a member that left gracefully first closes its channel as a no-op
        resp = await client.post(f"/v1/members/{b['member_id']}/leave", headers=JOB_AUTH)
        assert resp.status == 200
        await ws_b.close()
        assert int(redis.get(KEYS.generation)) == generation + 2
        # a channel for nobody, or without the token, or a plain GET (no handshake) is refused
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(url.format("nobody"), headers=JOB_AUTH)
        assert refused.value.status == 404
        resp = await client.get(url.format(a["member_id"]))
        assert resp.status == 401
        resp = await client.get(url.format("nobody"), headers=JOB_AUTH)
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "not_a_websocket"


def serving_report(**changes: Any) -> dict[str, Any]:
    """A serving replica's report (``serving.replica.Replica.report``)."""
    return {"url": "http://10.0.0.7:8800", "version": "12.7", "staleness_s": 0.25, "ready": True, "rows": 1000,
            "misses": 3, "reloads": 0, "requests": 100, "records": 6400, "latency_p99_ms": 4.5,
            "served_auc": 0.71, "labelled": 5000, **changes}


async def test_serving_replicas_reports_show_in_status_with_their_rate_and_are_forgotten(
        settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    """Each replica's last report, its age and its request rate from successive reports; the replicas'
    summed rate and how many are ready; a replica silent for 10 s is forgotten; nothing goes to Redis."""
    async with running_coordinator(settings) as client:
        now = [1000.0]
        client.server.app[SERVING].clock = lambda: now[0]
        empty = (await (await client.get("/v1/status")).json())["serving"]
        assert empty == {"replicas": [], "requests_per_s": None, "ready": 0}
        before = dump(redis)

        async def post(name: str, **changes: Any) -> None:
            resp = await client.post(f"/v1/serving/replicas/{name}", headers=JOB_AUTH, json=serving_report(**changes))
            assert resp.status == 204, await resp.text()
            assert await resp.read() == b""

        await post("serve-1:8800")
        await post("b.2_x-Y", ready=False, version=None, staleness_s=None, latency_p99_ms=None, served_auc=None,
                   requests=0, url="http://b:8800")
        now[0] += 0.5
        serving = (await (await client.get("/v1/status")).json())["serving"]
        assert serving["requests_per_s"] is None and serving["ready"] == 1  # nobody reported twice yet
        assert [r["name"] for r in serving["replicas"]] == ["b.2_x-Y", "serve-1:8800"]
        assert serving["replicas"][1] == {"name": "serve-1:8800", **serving_report(), "requests_per_s": None,
                                          "age_s": 0.5}
        assert serving["replicas"][0]["version"] is None and serving["replicas"][0]["ready"] is False

        now[0] += 0.5
        await post("serve-1:8800", requests=150)  # 50 requests in 1 s
        now[0] += 1.0
        await post("b.2_x-Y", requests=40, ready=True)  # 40 in 2 s
        serving = (await (await client.get("/v1/status")).json())["serving"]
        rates = {r["name"]: r["requests_per_s"] for r in serving["replicas"]}
        assert rates == {"serve-1:8800": pytest.approx(50.0), "b.2_x-Y": pytest.approx(20.0)}
        assert serving["requests_per_s"] == pytest.approx(70.0) and serving["ready"] == 2
        assert {r["name"]: r["age_s"] for r in serving["replicas"]} == {"serve-1:8800": 1.0, "b.2_x-Y": 0.0}

        now[0] += 1.0
        await post("b.2_x-Y", requests=5)  # restarted under the same name: no rate from a count that fell
        serving = (await (await client.get("/v1/status")).json())["serving"]
        assert {r["name"]: r["requests_per_s"] for r in serving["replicas"]}["b.2_x-Y"] is None
        assert serving["requests_per_s"] == pytest.approx(50.0)

        now[0] += FORGET_AFTER_S - 0.5  # serve-1 is 10.5 s silent, b 9.5 s
        serving = (await (await client.get("/v1/status")).json())["serving"]
        assert [r["name"] for r in serving["replicas"]] == ["b.2_x-Y"]
        now[0] += 1.0
        serving = (await (await client.get("/v1/status")).json())["serving"]
        assert serving == {"replicas": [], "requests_per_s": None, "ready": 0}
        assert dump(redis) == before  # in memory only


@pytest.mark.parametrize(("name", "headers", "body", "status", "code", "needle"), [
    ("r1", {}, serving_report(), 401, "unauthorized", "missing bearer job token"),
    ("r1", ADMIN_AUTH, serving_report(), 401, "unauthorized", "wrong job token"),
    ("a" * 129, JOB_AUTH, serving_report(), 400, "invalid_name", "1-128 characters"),
    ("r%201", JOB_AUTH, serving_report(), 400, "invalid_name", "'r 1'"),
    ("r1", JOB_AUTH, {k: v for k, v in serving_report().items() if k != "labelled"}, 400, "invalid_body",
     "labelled: required field is missing"),
    ("r1", JOB_AUTH, serving_report(ready="yes"), 400, "invalid_body", "ready: expected true or false"),
    ("r1", JOB_AUTH, serving_report(requests=-1), 400, "invalid_body", "requests: must be >= 0"),
    ("r1", JOB_AUTH, serving_report(served_auc=1.5), 400, "invalid_body", "served_auc: must be <= 1"),
    ("r1", JOB_AUTH, serving_report(rows=1.5), 400, "invalid_body", "rows: expected an integer"),
    ("r1", JOB_AUTH, serving_report(qps=3), 400, "invalid_body", "unknown field(s) 'qps'"),
    ("r1", JOB_AUTH, serving_report(url=None), 400, "invalid_body", "url: expected a string"),
])
async def test_a_refused_serving_report_is_not_kept(settings: CoordinatorSettings, name: str,
                                                    headers: dict[str, str], body: dict[str, Any], status: int,
                                                    code: str, needle: str) -> None:
    async with running_coordinator(settings) as client:
        resp = await client.post(f"/v1/serving/replicas/{name}", headers=headers, json=body)
        assert resp.status == status
        error = (await resp.json())["error"]
        assert error["code"] == code and needle in error["message"], error
        assert (await (await client.get("/v1/status")).json())["serving"]["replicas"] == []


async def test_the_replicas_kept_are_bounded(settings: CoordinatorSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_module, "MOST_REPLICAS", 2)
    async with running_coordinator(settings) as client:
        for name in ("r1", "r2", "r1"):
            resp = await client.post(f"/v1/serving/replicas/{name}", headers=JOB_AUTH, json=serving_report())
            assert resp.status == 204
        resp = await client.post("/v1/serving/replicas/r3", headers=JOB_AUTH, json=serving_report())
        assert resp.status == 429 and (await resp.json())["error"]["code"] == "too_many_replicas"
        assert [r["name"] for r in (await (await client.get("/v1/status")).json())["serving"]["replicas"]] == \
            ["r1", "r2"]


def join_report(**changes: Any) -> dict[str, Any]:
    """A joiner's report (``streamtrain join``: /tmp's spec, docs/join.md)."""
    return {"url": "http://join-1:9105/metrics", "partitions": [0, 2], "joined": 1000, "positives": 120,
            "negatives": 880, "negatives_dropped": 0, "late": {"outside_window": 3, "after_decision": 1},
            "dead_letters": {"bad_event": 2}, "decided_early": 0, "pending": 40, "early_feedback": 2,
            "watermark_ms": 1_700_000_000_000, "watermark_lag_s": 1.5, "transactions": 50, **changes}


async def test_joiners_reports_show_in_status_summed_with_their_rate_and_are_forgotten(
        settings: CoordinatorSettings, redis: redis_lib.Redis) -> None:
    """Each joiner's last report, its age and its join rate from successive reports; the counts summed over the
    joiners (late and dead letters by reason), the partitions they own, the largest watermark lag; a joiner
    silent for 10 s is forgotten; nothing goes to Redis."""
    async with running_coordinator(settings) as client:
        now = [1000.0]
        client.server.app[JOIN].clock = lambda: now[0]
        nobody = {"joiners": [], "partitions": [], "joined": 0, "positives": 0, "negatives": 0,
                  "negatives_dropped": 0, "decided_early": 0, "pending": 0, "early_feedback": 0, "transactions": 0,
                  "late": {}, "dead_letters": {}, "watermark_lag_s": None, "joined_per_s": None}
        assert (await (await client.get("/v1/status")).json())["join"] == nobody
        before = dump(redis)

        async def post(name: str, **changes: Any) -> None:
            resp = await client.post(f"/v1/join/joiners/{name}", headers=JOB_AUTH, json=join_report(**changes))
            assert resp.status == 204, await resp.text()
            assert await resp.read() == b""

        await post("join-1")
        await post("b.2_x-Y:0", partitions=[3, 1], joined=10, positives=1, negatives=5, negatives_dropped=4,
                   late={"outside_window": 2, "decided_early": 5}, dead_letters={}, watermark_ms=None,
                   watermark_lag_s=None, url="")
        now[0] += 0.5
        join = (await (await client.get("/v1/status")).json())["join"]
        assert [j["name"] for j in join["joiners"]] == ["b.2_x-Y:0", "join-1"]
        assert join["joiners"][1] == {"name": "join-1", **join_report(), "joined_per_s": None, "age_s": 0.5}
        assert join["joiners"][0]["watermark_ms"] is None and join["joiners"][0]["partitions"] == [3, 1]
        assert {k: v for k, v in join.items() if k != "joiners"} == {
            "partitions": [0, 1, 2, 3], "joined": 1010, "positives": 121, "negatives": 885, "negatives_dropped": 4,
            "decided_early": 0, "pending": 80, "early_feedback": 4, "transactions": 100,
            "late": {"after_decision": 1, "decided_early": 5, "outside_window": 5}, "dead_letters": {"bad_event": 2},
            "watermark_lag_s": 1.5, "joined_per_s": None}  # nobody reported twice yet

        now[0] += 0.5
        await post("join-1", joined=1400, watermark_lag_s=0.25)  # 400 records in 1 s
        now[0] += 1.0
        await post("b.2_x-Y:0", joined=110, watermark_lag_s=4.0)  # 100 in 2 s
        join = (await (await client.get("/v1/status")).json())["join"]
        assert {j["name"]: j["joined_per_s"] for j in join["joiners"]} == {
            "join-1": pytest.approx(400.0), "b.2_x-Y:0": pytest.approx(50.0)}
        assert join["joined_per_s"] == pytest.approx(450.0) and join["joined"] == 1510
        assert join["watermark_lag_s"] == 4.0  # the joiner furthest behind
        assert {j["name"]: j["age_s"] for j in join["joiners"]} == {"join-1": 1.0, "b.2_x-Y:0": 0.0}

        now[0] += 1.0
        await post("b.2_x-Y:0", joined=5)  # gave partitions away, or started afresh: no rate from a count that fell
        join = (await (await client.get("/v1/status")).json())["join"]
        assert {j["name"]: j["joined_per_s"] for j in join["joiners"]}["b.2_x-Y:0"] is None
        assert join["joined_per_s"] == pytest.approx(400.0)

        now[0] += FORGET_AFTER_S - 0.5  # join-1 is 10.5 s silent, b 9.5 s
        join = (await (await client.get("/v1/status")).json())["join"]
        assert [j["name"] for j in join["joiners"]] == ["b.2_x-Y:0"] and join["partitions"] == [0, 2]
        now[0] += 1.0
        assert (await (await client.get("/v1/status")).json())["join"] == nobody
        assert dump(redis) == before  # in memory only


@pytest.mark.parametrize(("name", "headers", "body", "status", "code", "needle"), [
    ("j1", {}, join_report(), 401, "unauthorized", "missing bearer job token"),
    ("j1", ADMIN_AUTH, join_report(), 401, "unauthorized", "wrong job token"),
    ("a" * 129, JOB_AUTH, join_report(), 400, "invalid_name", "1-128 characters"),
    ("j%201", JOB_AUTH, join_report(), 400, "invalid_name", "'j 1'"),
    ("j1", JOB_AUTH, {k: v for k, v in join_report().items() if k != "pending"}, 400, "invalid_body",
     "pending: required field is missing"),
    ("j1", JOB_AUTH, join_report(joined=-1), 400, "invalid_body", "joined: must be >= 0"),
    ("j1", JOB_AUTH, join_report(positives=1.5), 400, "invalid_body", "positives: expected an integer"),
    ("j1", JOB_AUTH, join_report(negatives="3"), 400, "invalid_body", "negatives: expected an integer"),
    ("j1", JOB_AUTH, join_report(transactions=None), 400, "invalid_body", "transactions: expected an integer"),
    ("j1", JOB_AUTH, join_report(partitions=3), 400, "invalid_body", "partitions: expected a list of integers"),
    ("j1", JOB_AUTH, join_report(partitions=[0, -1]), 400, "invalid_body", "partitions[1]: must be >= 0"),
    ("j1", JOB_AUTH, join_report(late=[]), 400, "invalid_body", "late: expected an object of counts"),
    ("j1", JOB_AUTH, join_report(late={"Outside": 1}), 400, "invalid_body", "late: name 'Outside' does not match"),
    ("j1", JOB_AUTH, join_report(late={"x" * 65: 1}), 400, "invalid_body", "does not match [a-z_]{1,64}"),
    ("j1", JOB_AUTH, join_report(late={"": 1}), 400, "invalid_body", "late: name '' does not match"),
    ("j1", JOB_AUTH, join_report(dead_letters={"bad_event": -2}), 400, "invalid_body",
     "dead_letters.bad_event: must be >= 0"),
    ("j1", JOB_AUTH, join_report(dead_letters={"bad_event": True}), 400, "invalid_body",
     "dead_letters.bad_event: expected an integer"),
    ("j1", JOB_AUTH, join_report(dead_letters={f"r_{chr(97 + i // 26)}{chr(97 + i % 26)}": 1 for i in range(33)}),
     400, "invalid_body", "dead_letters: more than 32 names"),
    ("j1", JOB_AUTH, join_report(watermark_ms=-5), 400, "invalid_body", "watermark_ms: must be >= 0"),
    ("j1", JOB_AUTH, join_report(watermark_lag_s=-0.5), 400, "invalid_body", "watermark_lag_s: must be >= 0"),
    ("j1", JOB_AUTH, join_report(watermark_lag_s="1"), 400, "invalid_body", "watermark_lag_s: expected a number"),
    ("j1", JOB_AUTH, join_report(url=None), 400, "invalid_body", "url: expected a string"),
    ("j1", JOB_AUTH, join_report(lag=3), 400, "invalid_body", "unknown field(s) 'lag'"),
    ("j1", JOB_AUTH, [join_report()], 400, "invalid_body", "body: expected a JSON object"),
])
async def test_a_refused_join_report_is_not_kept(settings: CoordinatorSettings, name: str,
                                                 headers: dict[str, str], body: Any, status: int,
                                                 code: str, needle: str) -> None:
    async with running_coordinator(settings) as client:
        resp = await client.post(f"/v1/join/joiners/{name}", headers=headers, json=body)
        assert resp.status == status
        error = (await resp.json())["error"]
        assert error["code"] == code and needle in error["message"], error
        assert (await (await client.get("/v1/status")).json())["join"]["joiners"] == []


async def test_the_joiners_kept_are_bounded(settings: CoordinatorSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(join_status_module, "MOST_JOINERS", 2)
    async with running_coordinator(settings) as client:
        for name in ("j1", "j2", "j1"):
            resp = await client.post(f"/v1/join/joiners/{name}", headers=JOB_AUTH, json=join_report())
            assert resp.status == 204
        resp = await client.post("/v1/join/joiners/j3", headers=JOB_AUTH, json=join_report())
        assert resp.status == 429 and (await resp.json())["error"]["code"] == "too_many_joiners"
        assert [j["name"] for j in (await (await client.get("/v1/status")).json())["join"]["joiners"]] == ["j1", "j2"]
