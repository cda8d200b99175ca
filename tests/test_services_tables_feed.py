"""The feed of row changes on the real Redis: applies and sweeps write its entries in the same script
as the rows, a reader gets upserts and tombstones with the rows as they are now, a copy that follows
it equals the rows hash, trimming and restores read as gone; and its HTTP face on the coordinator
(``GET /v1/model/updates``, ``GET /v1/embeddings/<table>``), error paths included."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import redis as redis_lib
import torch
from plane_util import small_model
from test_services_tables import ITEM, USER, applied, batch_rows, push_rows, setup

from common.keys import JobKeys
from coordinator.feed_copy import FeedCopy, lag_of
from coordinator.settings import CoordinatorSettings
from coordinator.testing import running_coordinator
from services import ParameterServer, Pusher, ServerSettings, ServerStatus
from services.slot_types import VersionVector
from services.snapshot.export import snapshot
from services.snapshot.table_export import export_tables
from services.tables import TableSpec, initial_rows
from services.tables.feed import (
    FeedAheadError,
    FeedGoneError,
    changes_from_safetensors,
    changes_to_safetensors,
    feed_heads,
    read_changes,
    read_group,
)
from services.tables.rows import id_bytes, row_dtype
from services.tables.store import sweep_rows
from streamtrain.launcher import wait_until

JOB = "feed"
AUTH = {"Authorization": "Bearer job-secret"}


def rows_now(redis: redis_lib.Redis, job: str, spec: TableSpec, groups: int) -> dict[int, np.ndarray]:
    """Every row of ``spec``, read straight from the groups' hashes: ID -> values."""
    out = {}
    for g in range(groups):
        for k, v in redis.hgetall(JobKeys(job).group(g).table_rows(spec.name)).items():
            out[int(np.frombuffer(k, "<i8")[0])] = np.frombuffer(v, dtype=row_dtype(spec))[0]["values"]
    return out


def assert_copy_is_the_rows(copy: FeedCopy, redis: redis_lib.Redis, job: str, groups: int,
                            tables: tuple[TableSpec, ...] = (USER, ITEM)) -> None:
    for spec in tables:
        want = rows_now(redis, job, spec, groups)
        got = copy.tables.get(spec.name, {})
        assert sorted(got) == sorted(want), spec.name
        for i, v in want.items():
            assert got[i].tobytes() == v.tobytes(), (spec.name, i)  # bit for bit


def catch_up(redis: redis_lib.Redis, job: str, copy: FeedCopy, tables: tuple[TableSpec, ...] = (USER, ITEM),
             **kw: int) -> int:
    """Apply the feed to ``copy`` through its wire form until it is at every group's head; entries read."""
    entries = 0
    while True:
        groups = copy.position.count(".") + 1
        changes = read_changes(redis, job, tables, VersionVector.parse(copy.position, groups, kind="position"), **kw)
        copy.apply(changes_from_safetensors(changes_to_safetensors(changes, job=job)))
        entries += changes.applied_ms.size
        if not changes.more:
            return entries


@pytest.fixture
def servers() -> Iterator[list[ParameterServer]]:
    started: list[ParameterServer] = []
    yield started
    for s in reversed(started):
        s.close()
    assert all(s.status is ServerStatus.CLOSED for s in started)


def start(servers: list, redis_url: str, groups: int, **kw: object) -> None:
    servers += [ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, group=g, groups=groups, **kw))
                for g in range(groups)]
    for s in servers:
        s.start()


@pytest.mark.parametrize("groups", [1, 2])
def test_a_copy_that_follows_the_feed_holds_the_rows_upserts_and_tombstones_alike(
        redis: redis_lib.Redis, redis_url: str, servers: list, groups: int) -> None:
    setup(redis, JOB, groups=groups)
    push_rows(redis, range(1, 7), job=JOB)
    start(servers, redis_url, groups, batch=2)
    wait_until(lambda: applied(redis, JOB) == 6, 60, what="6 updates applied")
    heads = feed_heads(redis, JOB, groups)
    versions = [int(redis.get(JobKeys(JOB).group(g).version)) for g in range(groups)]
    assert heads == tuple(versions) and all(h >= 1 for h in heads)  # one entry per apply that bumped the version
    entry = redis.xrange(JobKeys(JOB).group(0).feed, count=1)[0]
    assert entry[0] == b"1-0" and entry[1][b"v"] == b"1" and entry[1][b"d"] == b"0"  # rows only: no dense gradient
    assert {k for k in entry[1] if k.startswith(b"w:")} <= {b"w:user", b"w:item"}

    copy = FeedCopy(groups=groups)
    assert catch_up(redis, JOB, copy) == sum(heads)
    assert_copy_is_the_rows(copy, redis, JOB, groups)
    assert copy.position == ".".join(map(str, heads))
    # nothing new: the same position, no change
    again = read_changes(redis, JOB, (USER, ITEM), heads)
    assert again.empty and not again.more and again.applied_ms.size == 0

    # a sweep removes rows (a cap of 2 rows per group): one entry per step that removed some, tombstones
    capped = TableSpec(USER.name, USER.dim, optimizer=USER.optimizer, max_rows=2 * groups)
    removed = sum(sweep_rows(redis, JOB, g, capped, groups, now_ms=2**41).evicted for g in range(groups))
    assert removed > 0
    gone = read_changes(redis, JOB, (USER, ITEM), heads)
    assert gone.tables["user"].removed.size == removed and gone.tables["user"].ids.size == 0
    assert gone.version == tuple(versions)  # a sweep does not bump the version
    copy.apply(changes_from_safetensors(changes_to_safetensors(gone, job=JOB)))
    assert_copy_is_the_rows(copy, redis, JOB, groups)
    assert len(rows_now(redis, JOB, USER, groups)) <= 2 * groups


def test_a_row_removed_then_readmitted_in_one_range_reads_as_an_upsert(
        redis: redis_lib.Redis, redis_url: str, servers: list) -> None:
    setup(redis, JOB)
    push_rows(redis, range(1, 4), job=JOB)
    start(servers, redis_url, 1)
    wait_until(lambda: applied(redis, JOB) == 3, 60, what="3 updates applied")
    since = feed_heads(redis, JOB, 1)
    # every user row goes (a cap of one row, evicting until it holds), then the same IDs come back
    before = set(rows_now(redis, JOB, USER, 1))
    sweep_rows(redis, JOB, 0, TableSpec("user", USER.dim, optimizer=USER.optimizer, max_rows=1), 1, now_ms=2**41)
    left = set(rows_now(redis, JOB, USER, 1))
    evicted = before - left
    pusher = Pusher(redis, JOB, "a", row_dtype="float32")
    for c in range(4, 7):  # the same IDs again (clocks 1..3's rows, as a second pass)
        pusher.push(None, generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                    samples=[("prod", 10 * (c - 1), 10)], batch_size=10, rows=batch_rows(c - 3))
    wait_until(lambda: applied(redis, JOB) == 6, 60, what="the evicted rows admitted again")
    assert set(rows_now(redis, JOB, USER, 1)) >= evicted
    changes = read_changes(redis, JOB, (USER, ITEM), since)
    ids = set(changes.tables["user"].ids.tolist())
    assert evicted <= ids and not evicted & set(changes.tables["user"].removed.tolist())
    now = rows_now(redis, JOB, USER, 1)
    for i, v in zip(changes.tables["user"].ids.tolist(), changes.tables["user"].values, strict=True):
        assert v.tobytes() == now[i].tobytes()


def test_a_copy_loaded_from_an_export_follows_the_feed_from_the_position_it_names(
        redis: redis_lib.Redis, redis_url: str, servers: list, tmp_path) -> None:
    setup(redis, JOB, groups=2)
    push_rows(redis, range(1, 4), job=JOB)
    start(servers, redis_url, 2)
    wait_until(lambda: applied(redis, JOB) == 3, 60, what="3 updates applied")
    export_tables(redis, JOB, str(tmp_path / "tables"), rows_per_piece=3)
    pusher = Pusher(redis, JOB, "a", row_dtype="float32")
    for c in range(4, 8):  # more rows change and are born after the export
        pusher.push(None, generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                    samples=[("prod", 10 * (c - 1), 10)], batch_size=10, rows=batch_rows(c))
    wait_until(lambda: applied(redis, JOB) == 7, 60, what="7 updates applied")
    capped = TableSpec(ITEM.name, ITEM.dim, optimizer=ITEM.optimizer, admit_after=2, max_rows=2)
    assert sum(sweep_rows(redis, JOB, g, capped, 2, now_ms=2**41).evicted for g in range(2)) > 0
    copy = FeedCopy.load_export(str(tmp_path / "tables"))
    assert copy.position != "0.0" and copy.tables["user"]
    catch_up(redis, JOB, copy)
    assert_copy_is_the_rows(copy, redis, JOB, 2)


def _fill(redis: redis_lib.Redis, job: str, spec: TableSpec, n: int) -> None:
    records = np.zeros(n, dtype=row_dtype(spec))
    records["written_ms"] = np.arange(n)
    ids = np.arange(n, dtype=np.int64)
    redis.hset(JobKeys(job).group(0).table_rows(spec.name),
               mapping={id_bytes(ids[i:i + 1]): records[i].tobytes() for i in range(n)})


def test_a_trimmed_feed_reads_as_gone_naming_the_oldest_position(redis: redis_lib.Redis) -> None:
    spec = TableSpec("t", 2, max_rows=1)
    _fill(redis, "trim", spec, 400)
    for _ in range(300):  # one row evicted per step: one entry each, the feed keeping about 20
        assert sweep_rows(redis, "trim", 0, spec, 1, now_ms=2**41, most_evicted=1, feed_entries=20).evicted == 1
    gk = JobKeys("trim").group(0)
    assert int(redis.get(gk.feed_head)) == 300 and 20 <= redis.xlen(gk.feed) < 300  # MAXLEN ~: whole nodes go
    oldest = int(redis.xrange(gk.feed, count=1)[0][0].split(b"-")[0]) - 1
    with pytest.raises(FeedGoneError) as gone:
        read_group(redis, "trim", 0, (spec,), 0)
    assert gone.value.oldest == (oldest,) and gone.value.head == (300,)
    assert f"the oldest position it answers is {oldest}" in str(gone.value)
    # from the oldest answered, in reads of at most 7 entries: every tombstone, each row once
    removed, at = [], oldest
    while at < 300:
        r = read_group(redis, "trim", 0, (spec,), at, limit=7)
        assert r.applied_ms.size <= 7 and r.position > at and r.tables["t"].ids.size == 0
        removed += r.tables["t"].removed.tolist()
        at = r.position
    assert len(removed) == len(set(removed)) == 300 - oldest
    # most_rows stops a read after the entry that reaches it (one ID an entry here)
    assert read_group(redis, "trim", 0, (spec,), oldest, most_rows=3).position == oldest + 3
    with pytest.raises(FeedAheadError):
        read_group(redis, "trim", 0, (spec,), 301)
    # a restore moves the head past every earlier position without an entry: all of them are gone
    redis.xtrim(gk.feed, maxlen=0, approximate=False)
    redis.incr(gk.feed_head)
    with pytest.raises(FeedGoneError) as restored:
        read_group(redis, "trim", 0, (spec,), 300)
    assert restored.value.oldest == (301,)
    assert read_group(redis, "trim", 0, (spec,), 301).position == 301


def test_lag_is_measured_per_entry() -> None:
    lag = lag_of(np.array([1000.0, 1000.0, 1500.0]), np.array([900, 980, 1000]))
    assert (lag.entries, lag.p50_ms, lag.max_ms) == (3, 100.0, 500.0)


# -- over HTTP ----------------------------------------------------------------------------------------

@pytest.fixture
def settings(redis_url: str, silent_broker: str) -> CoordinatorSettings:
    return CoordinatorSettings(job=JOB, redis_url=redis_url, kafka_bootstrap=silent_broker, topic="train",
                               partitions=1, lease_ms=3000, heartbeat_interval_ms=500,
                               admin_token="admin-secret", job_token="job-secret", kafka_timeout_ms=200)


async def test_the_routes_serve_the_feed_and_the_rows_and_refuse_bad_requests(
        redis: redis_lib.Redis, redis_url: str, servers: list, settings: CoordinatorSettings) -> None:
    setup(redis, JOB)
    push_rows(redis, range(1, 5), job=JOB)
    start(servers, redis_url, 1)
    wait_until(lambda: applied(redis, JOB) == 4, 60, what="4 updates applied")
    # then one update with a dense gradient too: its entry says the dense shards changed
    Pusher(redis, JOB, "a", row_dtype="float32").push(
        {n: torch.ones_like(t) for n, t in small_model().items()}, generation=1, clock=5, offsets={0: (40, 50)},
        samples=[("prod", 40, 10)], batch_size=10, rows=batch_rows(5))
    wait_until(lambda: applied(redis, JOB) == 5, 60, what="5 updates applied")
    redis.delete(JobKeys(JOB).members)  # the pushes' stand-in membership, which no coordinator wrote
    head = feed_heads(redis, JOB, 1)[0]
    async with running_coordinator(settings) as client:
        async def error(path: str, status: int, headers: dict | None = None) -> dict:
            resp = await client.get(path, headers=AUTH if headers is None else headers)
            assert resp.status == status, (path, resp.status, await resp.text())
            return (await resp.json())["error"]

        copy = FeedCopy()
        resp = await client.get("/v1/model/updates?since=0&limit=1", headers=AUTH)
        assert resp.status == 200 and resp.headers["X-Feed-Position"] == "1"
        copy.apply(changes_from_safetensors(await resp.read()))
        assert copy.position == "1"
        assert resp.headers["X-Feed-Head"] == str(head)
        assert not copy.dense  # the first apply changed rows only
        while copy.position != str(head):
            resp = await client.get(f"/v1/model/updates?since={copy.position}", headers=AUTH)
            copy.apply(changes_from_safetensors(await resp.read()))
        assert_copy_is_the_rows(copy, redis, JOB, 1)
        version, dense = snapshot(redis, JOB)  # the last apply changed dense shards: the tensors came along
        assert sorted(copy.dense) == sorted(dense) and copy.version == str(version[0])
        assert all(copy.dense[n].tobytes() == t.numpy().tobytes() for n, t in dense.items())
        last = f"/v1/model/updates?since={head - 1}"
        with_dense = await client.get(last, headers=AUTH)
        without = await client.get(last + "&dense=0", headers=AUTH)
        assert with_dense.headers["X-Dense-Changed"] == without.headers["X-Dense-Changed"] == "1"
        assert changes_from_safetensors(await with_dense.read()).dense
        assert not changes_from_safetensors(await without.read()).dense
        resp = await client.get(f"/v1/model/updates?since={head}", headers={"Authorization": "Bearer admin-secret"})
        empty = changes_from_safetensors(await resp.read())
        assert resp.status == 200 and empty.position == str(head) and empty.applied_ms.size == 0
        assert all(t[0].size == 0 for t in empty.tables.values()) and not empty.dense

        # lookups: stored rows as they are, others at their initial value
        stored = rows_now(redis, JOB, USER, 1)
        some = sorted(stored)[:2]
        resp = await client.get(f"/v1/embeddings/user?ids={some[0]},{some[1]},-5", headers=AUTH)
        got = await resp.json()
        assert resp.status == 200 and got["ids"] == [*some, -5] and got["stored"] == [True, True, False]
        version_now = int(redis.get(JobKeys(JOB).group(0).version))
        assert got["dim"] == USER.dim and got["group_versions"] == {"0": version_now}
        assert np.array(got["values"][0], dtype=np.float32).tobytes() == stored[some[0]].tobytes()
        assert np.array(got["values"][2], dtype=np.float32).tobytes() == \
            initial_rows(USER, np.array([-5], dtype=np.int64))[0].tobytes()
        big = await (await client.get(f"/v1/embeddings/user?ids={2**63 + 5}", headers=AUTH)).json()
        assert big["ids"] == [-(2**63) + 5]  # a 64-bit word: unsigned above 2**63 - 1 is the negative int64

        # refusals
        for path in ("/v1/model/updates?since=0", "/v1/embeddings/user?ids=1"):
            assert (await error(path, 401, {}))["code"] == "unauthorized"
            assert (await error(path, 401, {"Authorization": "Bearer nope"}))["code"] == "unauthorized"
        for query, problem in (("", "since is required"), ("?since=abc", "since must be a feed position"),
                               ("?since=0&limit=0", "limit must be an integer from 1 to 10000"),
                               ("?since=0&limit=x", "limit must be"), ("?since=0&since=1", "given once"),
                               ("?since=0&v=1", "unknown query parameter 'v'"),
                               ("?since=0&dense=yes", "dense must be")):
            bad = await error(f"/v1/model/updates{query}", 400)
            assert bad["code"] == "invalid_query" and problem in bad["message"], bad
        ahead = await error(f"/v1/model/updates?since={head + 5}", 404)
        assert ahead["code"] == "position_not_found" and ahead["current"] == str(head)
        other = await error("/v1/model/updates?since=1.1", 404)
        assert other["code"] == "position_not_found" and "one non-negative integer" in other["message"]
        gk = JobKeys(JOB).group(0)
        redis.xtrim(gk.feed, maxlen=0, approximate=False)  # as a restore does
        redis.incr(gk.feed_head)
        gone = await error("/v1/model/updates?since=0", 410)
        assert gone["code"] == "feed_gone" and gone["oldest"] == gone["current"] == str(head + 1)
        for query, problem in (("", "ids is required"), ("?ids=1,x", "ids must be 64-bit integers"),
                               ("?ids=" + "9" * 20, "ids must be"), ("?ids=1,,2", "ids must be")):
            bad = await error(f"/v1/embeddings/user{query}", 400)
            assert bad["code"] == "invalid_query" and problem in bad["message"], bad
        unknown = await error("/v1/embeddings/nope?ids=1", 404)
        assert unknown["code"] == "unknown_table" and "tables: item, user" in unknown["message"]
    async with running_coordinator(replace(settings, job="nomodel")) as client:
        resp = await client.get("/v1/model/updates?since=0", headers=AUTH)
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "no_model"
