"""Bounded state: nothing the system keeps grows with time alone.

On the real Redis (and Kafka for the audit): ``applied_samples`` is trimmed past
the servers' audit horizon with the audit floor raised in the same step (the
audit stays exact above it); a departed member's ``clocks``/``applied_clocks``/
``staleness`` fields go once its updates are applied, and are kept while any is
pending. Pure and on Redis: the coordinator forgets departed members after its
retention.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import pytest
import redis as redis_lib
import redis.asyncio as aioredis
from kafka import KafkaProducer
from plane_util import set_membership, small_model

from common.keys import JobKeys
from coordinator.errors import MemberGoneError, UnknownMemberError
from coordinator.membership import (
    CheckLeases,
    Departure,
    Heartbeat,
    Leave,
    MemberExpired,
    MemberLeft,
    Register,
    departures,
    empty,
    forgotten,
    handle,
)
from coordinator.state import JobConfig, Store
from datastream import encode_json_record
from services import OptimizerConfig, ParameterServer, ParameterStore, Pusher, ServerSettings
from services.server.apply import Housekeeping, write_batch
from streamtrain.accounting import audit

JOB = "retention"
KEYS = JobKeys(JOB)


def grads() -> dict:
    return {k: v * 0.01 for k, v in small_model().items()}


def setup_model(redis: redis_lib.Redis, owners: dict[str, list[int]]) -> None:
    ParameterStore(redis, JOB).init_model(small_model(), shard_elems=64, optimizer=OptimizerConfig(name="sgd", lr=0.1))
    set_membership(redis, JOB, owners, generation=1)


@pytest.fixture
def server(redis_url: str) -> Iterator[Callable[..., ParameterServer]]:
    """Makes servers driven by the test (``apply_entries``, no apply thread); closes them."""
    made: list[ParameterServer] = []

    def make(**settings: object) -> ParameterServer:
        ps = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, batch=16, **settings))
        made.append(ps)
        ps.load()
        return ps

    yield make
    for ps in made:
        ps.close()


def log(redis: redis_lib.Redis, after: str = "-") -> list:
    return redis.xrange(KEYS.update_log, after if after == "-" else f"({after}")


def per_member(redis: redis_lib.Redis, member: str) -> tuple:
    return (redis.hget(KEYS.clocks, member), redis.hget(KEYS.applied_clocks, member),
            redis.hget(KEYS.staleness, member))


# -- applied_samples and the audit floor --------------------------------------------------------

def test_applied_samples_are_trimmed_past_the_horizon_and_the_audit_is_exact_above_the_floor(
        redis: redis_lib.Redis, redis_url: str, kafka, server: Callable[..., ParameterServer]) -> None:
    topic = kafka.create_topic(partitions=2, prefix="retention")
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
    for p in (0, 1):
        for i in range(10):
            producer.send(topic, encode_json_record([float(i), 1.0], i % 2), partition=p)
    producer.flush()
    producer.close()
    setup_model(redis, {"a": [0, 1]})
    pusher = Pusher(redis, JOB, "a")

    def push(clock: int, partition: int, first: int) -> None:
        pusher.push(grads(), generation=1, clock=clock, offsets={partition: (first, first + 5)},
                    samples=[(f"{topic}/{partition}", first, 5)], batch_size=5)

    ps = server(audit_horizon_s=0.5, housekeeping_s=0.0)
    push(1, 0, 0)
    push(2, 1, 0)
    assert ps.apply_entries(log(redis)) == 2  # housekept too: nothing is past the horizon yet
    assert redis.xlen(KEYS.applied_samples) == 2 and redis.hgetall(KEYS.audit_floor) == {}
    time.sleep(0.7)
    push(3, 0, 5)
    push(4, 1, 5)
    assert ps.apply_entries(log(redis, ps._state.cursor)) == 2
    # the first two entries are past the horizon: trimmed, and the floors moved past their ranges
    kept = redis.xrange(KEYS.applied_samples)
    assert [int(f[b"clock"]) for _, f in kept] == [3, 4]
    assert redis.hgetall(KEYS.audit_floor) == {b"0": b"5", b"1": b"5"}

    report = audit(kafka.bootstrap, topic, redis_url, JOB)
    assert report.exact, report
    assert (report.expected, report.applied, report.below_floor) == (10, 10, 10)
    assert report.floors == {0: 5, 1: 5}
    # the floor is what keeps it exact: without it the trimmed records read as missing
    redis.delete(KEYS.audit_floor)
    assert len(audit(kafka.bootstrap, topic, redis_url, JOB).missing) == 10


def test_the_floor_takes_the_highest_next_per_partition_and_trims_in_chunks(redis: redis_lib.Redis) -> None:
    """Unit level: entries far past the horizon (explicit old ids), trimmed `most` at a time."""
    ranges = [[[0, 0, 4]], [[0, 4, 9], [1, 0, 3]], [[1, 3, 7]], [[2, 0, 1]], "not json"]
    for n, r in enumerate(ranges, start=1):
        redis.xadd(KEYS.applied_samples, {"offsets": r if isinstance(r, str) else json.dumps(r)}, id=f"{n}-0")
    redis.xadd(KEYS.applied_samples, {"offsets": json.dumps([[0, 9, 12]])}, id="*")  # fresh: kept
    redis.hset(KEYS.audit_floor, "2", 5)  # a floor never moves down

    def housekeep() -> object:
        return write_batch(redis, JOB, group=0, groups=1, cursor="", outcomes=[], shards=[],
                           housekeeping=Housekeeping(horizon_ms=60_000, most=2))

    first = housekeep()
    assert (first.ok, first.trimmed, first.more) == (True, 2, True)
    assert redis.hgetall(KEYS.audit_floor) == {b"0": b"9", b"1": b"3", b"2": b"5"}
    second = housekeep()
    assert (second.trimmed, second.more) == (2, True)
    assert redis.hgetall(KEYS.audit_floor) == {b"0": b"9", b"1": b"7", b"2": b"5"}
    third = housekeep()
    assert (third.trimmed, third.more) == (1, False)  # the malformed entry goes, raising nothing
    assert redis.xlen(KEYS.applied_samples) == 1
    assert redis.keys(KEYS.group(0).key("*")) == []  # housekeeping alone writes nothing of the group: no new version
    # horizon 0 keeps everything
    assert write_batch(redis, JOB, group=0, groups=1, cursor="", outcomes=[], shards=[],
                       housekeeping=Housekeeping(horizon_ms=0)).trimmed == 0
    assert redis.xlen(KEYS.applied_samples) == 1


# -- per-member fields of departed members -------------------------------------------------------

def test_departed_members_fields_go_once_applied_and_stay_while_pending(
        redis: redis_lib.Redis, server: Callable[..., ParameterServer]) -> None:
    setup_model(redis, {"a": [0], "b": [1]})
    b = Pusher(redis, JOB, "b")
    for c in (1, 2):
        b.push(grads(), generation=1, clock=c, offsets={1: (5 * (c - 1), 5 * c)}, batch_size=5)
    Pusher(redis, JOB, "a").push(grads(), generation=1, clock=1, offsets={0: (0, 5)}, batch_size=5)
    redis.hset(KEYS.staleness, mapping={"a": 0, "b": 1, "c": 2})  # c waited, never pushed
    # b and c leave (b with two updates pending); a takes every partition
    set_membership(redis, JOB, {"a": [0, 1]}, generation=2, departed=("b", "c"))
    entries = log(redis)

    ps = server(housekeeping_s=3600.0)  # the first write housekeeps, then not for an hour
    assert ps.apply_entries(entries[:1]) == 1
    # b's first update is applied, its second is pending: kept; c had nothing pending: swept
    assert per_member(redis, "b") == (b"2", b"1", b"1")
    assert per_member(redis, "c") == (None, None, None)
    # b's last update completes: its fields go with it (no housekeeping in this write)
    assert ps.apply_entries(entries[1:2]) == 1
    assert per_member(redis, "b") == (None, None, None)
    assert ps.apply_entries(entries[2:]) == 1
    assert per_member(redis, "a") == (b"1", b"1", b"0")  # live: kept
    # its applied_samples entries are still there for the audit
    assert [f[b"member"] for _, f in redis.xrange(KEYS.applied_samples)] == [b"b", b"b", b"a"]

    # a member that leaves with nothing pending, while no update arrives: an idle housekeeping
    redis.hset(KEYS.staleness, "d", 0)
    group = KEYS.group(0)
    version, cursor = redis.get(group.version), redis.get(group.cursor)
    assert version is not None and cursor is not None
    idle = server(housekeeping_s=0.0)
    assert idle.apply_entries([]) == 0
    assert redis.hget(KEYS.staleness, "d") is None and per_member(redis, "a") == (b"1", b"1", b"0")
    assert (redis.get(group.version), redis.get(group.cursor)) == (version, cursor)


# -- departed records in the coordinator ---------------------------------------------------------

def test_departed_records_are_forgotten_after_the_retention_pure() -> None:
    state, _ = handle(empty([0, 1]), Register("m1", {}, 1.0, now_ms=1_000, lease_ms=3_000))
    state, _ = handle(state, Register("m2", {}, 1.0, now_ms=1_000, lease_ms=3_000))
    state, left = handle(state, Leave("m1", now_ms=2_000))
    state, expired = handle(state, CheckLeases(now_ms=10_000))
    assert [type(a) for a in left[:1] + expired[:1]] == [MemberLeft, MemberExpired]
    gone = {**departures(left), **departures(expired)}
    assert gone == {"m1": Departure("left", 3, 2_000), "m2": Departure("expired", 4, 10_000)}
    assert Departure.from_json(gone["m1"].to_json()) == gone["m1"]
    assert Departure.from_json('{"reason": "left", "generation": 2, "at_ms": null}').at_ms == 0  # older records
    retention = 60_000
    assert forgotten(gone, 2_000 + retention - 1, retention) == []
    assert forgotten(gone, 2_000 + retention, retention) == ["m1"]
    assert forgotten(gone, 10_000 + retention, retention) == ["m1", "m2"]
    with pytest.raises(ValueError):
        forgotten(gone, 0, -1)


def test_the_store_forgets_departed_members_and_a_late_heartbeat_is_then_unknown(redis_url: str) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            store = Store(client, JOB, departed_retention_s=60.0)
            await store.ensure_config(JobConfig(consistency="ssp", staleness=2, codec="none", optimizer="sgd",
                                                lr=0.1, topic="t", partitions=2))
            t0 = 1_000_000
            await store.apply(Register("m1", {}, 1.0, now_ms=t0, lease_ms=3_000))
            await store.apply(Leave("m1", now_ms=t0 + 1))
            assert json.loads(await client.hget(KEYS.departed, "m1"))["at_ms"] == t0 + 1
            with pytest.raises(MemberGoneError):
                await store.apply(Heartbeat("m1", {}, now_ms=t0 + 2, lease_ms=3_000))
            # the lease checker's CheckLeases sweeps, at most once a minute: within the retention
            # m1 is kept, past it forgotten
            await store.apply(CheckLeases(now_ms=t0 + 60_000))
            assert await client.hexists(KEYS.departed, "m1")
            await store.apply(CheckLeases(now_ms=t0 + 90_000))  # not due yet
            assert await client.hexists(KEYS.departed, "m1")
            await store.apply(CheckLeases(now_ms=t0 + 120_000))
            assert await client.hlen(KEYS.departed) == 0
            with pytest.raises(UnknownMemberError) as raised:
                await store.apply(Heartbeat("m1", {}, now_ms=t0 + 120_001, lease_ms=3_000))
            assert not isinstance(raised.value, MemberGoneError)
        finally:
            await client.aclose()

    asyncio.run(scenario())
