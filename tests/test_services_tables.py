"""Embedding tables in the parameter plane, on the real Redis: rows born on first sight (no
collisions), admission and its dropped count, rows spread over the groups, pulls of the batch's IDs
only, and the row math exactly that of applying the updates one by one, across a server kill."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import redis as redis_lib
from plane_util import accounting_left, gradient_blobs, set_membership, small_model

from common.keys import JobKeys
from services import OptimizerConfig, ParameterServer, ParameterStore, Pusher, ServerSettings, ServerStatus
from services.errors import BadGradientError, LayoutError
from services.server.apply import write_batch
from services.store import connect
from services.tables import RowGrads, RowOptimizerConfig, TableSpec, group_of_ids, initial_rows, step_rows
from services.tables.apply import TableWrites
from services.tables.rows import SEEN_DTYPE, row_dtype
from services.tables.store import pull_rows
from streamtrain.launcher import wait_until

JOB = "tables"
ROOT = Path(__file__).resolve().parents[1]
USER = TableSpec("user", 4, optimizer=RowOptimizerConfig("lazyadam", lr=0.05))
ITEM = TableSpec("item", 2, optimizer=RowOptimizerConfig("adagrad", lr=0.1), admit_after=2)


def setup(redis: redis_lib.Redis, job: str = JOB, groups: int = 1,
          tables: tuple[TableSpec, ...] = (USER, ITEM)) -> ParameterStore:
    store = ParameterStore(redis, job)
    store.init_model(small_model(), shard_elems=64, optimizer=OptimizerConfig("lazyadam", lr=0.01), groups=groups,
                     tables=tables)
    set_membership(redis, job, {"a": [0]}, generation=1)
    return store


def batch_rows(clock: int, tables: tuple[TableSpec, ...] = (USER, ITEM)) -> list[RowGrads]:
    """The gradient rows of step ``clock``: a few IDs per table, overlapping across steps (a Zipf-ish
    mix of popular and new IDs, some far apart so any fixed-size hashing would collide them)."""
    rng = np.random.default_rng(clock)
    out = []
    for t in tables:
        ids = np.unique(np.concatenate([rng.integers(0, 6, 3), rng.integers(0, 2**62, 2),
                                        [(clock % 3) << 40, ((clock % 3) << 40) + 2**20]]).astype(np.int64))
        out.append(RowGrads(t.name, ids, rng.standard_normal((ids.size, t.dim)).astype(np.float32)))
    return out


def push_rows(redis: redis_lib.Redis, clocks: range, job: str = JOB, row_dtype_: str = "float32") -> None:
    pusher = Pusher(redis, job, "a", row_dtype=row_dtype_)
    for c in clocks:
        pusher.push(None, generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                    samples=[("prod", 10 * (c - 1), 10)], batch_size=10, rows=batch_rows(c))


def expected_rows(clocks: Sequence[int], tables: tuple[TableSpec, ...] = (USER, ITEM), *,
                  rounding: Callable[[np.ndarray, str], np.ndarray] | None = None
                  ) -> dict[str, dict[int, np.ndarray]]:
    """What applying the updates of ``clocks`` one by one gives, row by row (admission included);
    ``rounding(x, dtype)``: each step's values and state as a table of that ``value_dtype`` and
    ``state_dtype`` stores them (None: float32, unrounded)."""
    rows: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in tables}
    state: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in tables}
    seen: dict[str, dict[int, int]] = {t.name: {} for t in tables}
    for step, c in enumerate(clocks, start=1):
        for t, part in zip(tables, batch_rows(c, tables), strict=True):
            for i, g in zip(part.ids.tolist(), part.grads, strict=True):
                if i not in rows[t.name]:
                    seen[t.name][i] = seen[t.name].get(i, 0) + 1
                    if seen[t.name][i] < t.admit_after:
                        continue
                    rows[t.name][i] = initial_rows(t, np.array([i], dtype=np.int64))[0]
                    state[t.name][i] = np.zeros(t.slots, dtype=np.float32)
                v, s = rows[t.name][i][None].copy(), state[t.name][i][None].copy()
                step_rows(t.optimizer, v, s, g[None], step)
                if rounding is not None:
                    v, s = rounding(v, t.value_dtype), rounding(s, t.state_dtype)
                rows[t.name][i], state[t.name][i] = v[0], s[0]
    return rows


def stored(redis: redis_lib.Redis, job: str, spec: TableSpec, groups: int) -> dict[int, np.ndarray]:
    """Every row of ``spec`` in Redis, read straight from the groups' hashes."""
    out = {}
    for g in range(groups):
        for k, v in redis.hgetall(JobKeys(job).group(g).table_rows(spec.name)).items():
            out[int(np.frombuffer(k, "<i8")[0])] = np.frombuffer(v, dtype=row_dtype(spec))[0]
    return out


def applied(redis: redis_lib.Redis, job: str = JOB) -> int:
    return int(redis.hget(JobKeys(job).applied_clocks, "a") or 0)


@pytest.fixture
def servers() -> Iterator[list[ParameterServer]]:
    started: list[ParameterServer] = []
    yield started
    for s in reversed(started):
        s.close()
    assert all(s.status is ServerStatus.CLOSED for s in started)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("batch", [1, 16])
def test_rows_are_born_on_first_sight_and_stepped_like_one_by_one(redis: redis_lib.Redis, redis_url: str,
                                                                 servers: list, groups: int, batch: int) -> None:
    setup(redis, groups=groups)
    push_rows(redis, range(1, 9))
    servers += [ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, group=g, groups=groups, batch=batch))
                for g in range(groups)]
    for s in servers:
        s.start()
    wait_until(lambda: applied(redis) == 8, 60, what="8 updates applied")
    want = expected_rows(list(range(1, 9)))
    for spec in (USER, ITEM):
        got = stored(redis, JOB, spec, groups)
        # collisionless: one row per ID ever admitted, even IDs 2**20 apart or 2**62 wide
        assert sorted(got) == sorted(want[spec.name])
        for i, rec in got.items():
            np.testing.assert_array_equal(rec["values"], want[spec.name][i], err_msg=f"{spec.name} row {i}")
        # each row lives in the group that owns its ID
        for g in range(groups):
            ids = [int(np.frombuffer(k, "<i8")[0]) for k in redis.hkeys(JobKeys(JOB).group(g).table_rows(spec.name))]
            assert (group_of_ids(np.array(ids, dtype=np.int64), groups) == g).all()
        stats = [redis.hgetall(JobKeys(JOB).group(g).table_stats) for g in range(groups)]
        assert all(int(s[f"{spec.name}:steps".encode()]) == 8 for s in stats)  # every group counts every step
        assert sum(int(s.get(f"{spec.name}:admitted".encode(), 0)) for s in stats) == len(want[spec.name])
    # the row-gradient blobs go with the apply that wrote their rows
    assert redis.keys(f"st:{{{JOB}:g*}}:grad:*:rows") == []
    assert accounting_left(redis, JOB) == []


def test_admission_drops_and_counts_gradients_until_an_id_was_seen_often_enough(
        redis: redis_lib.Redis, redis_url: str, servers: list) -> None:
    setup(redis)
    push_rows(redis, range(1, 5))
    servers.append(ParameterServer(ServerSettings(redis_url=redis_url, job=JOB)))
    servers[0].start()
    wait_until(lambda: applied(redis) == 4, 60, what="4 updates applied")
    # item admits an ID at its second sighting: every first sighting's gradient was dropped, and counted
    sightings: dict[int, int] = {}
    for c in range(1, 5):
        for i in batch_rows(c)[1].ids.tolist():
            sightings[i] = sightings.get(i, 0) + 1
    stats = redis.hgetall(JobKeys(JOB).group(0).table_stats)
    assert int(stats[b"item:dropped"]) == len(sightings)
    assert int(stats[b"item:admitted"]) == sum(n >= 2 for n in sightings.values())
    assert b"user:dropped" not in stats
    seen = redis.hgetall(JobKeys(JOB).group(0).table_seen("item"))
    assert sorted(int(np.frombuffer(k, "<i8")[0]) for k in seen) == sorted(i for i, n in sightings.items() if n == 1)
    # an ID not admitted reads as its initial value; an admitted one as what the server wrote
    once = next(i for i, n in sightings.items() if n == 1)
    twice = next(i for i, n in sightings.items() if n >= 2)
    got = pull_rows(redis, JOB, {"item": ITEM}, 1, {"item": np.array([once, twice], dtype=np.int64)})
    rows = got.tables["item"]
    assert rows.present.tolist() == [False, True] and rows.versions[0] == 0 and rows.versions[1] > 0
    np.testing.assert_array_equal(rows.values[0], initial_rows(ITEM, np.array([once], dtype=np.int64))[0])
    np.testing.assert_array_equal(rows.values[1], expected_rows([1, 2, 3, 4])["item"][twice])


def test_a_pull_moves_the_rows_asked_for_only(redis: redis_lib.Redis, redis_url: str, servers: list) -> None:
    setup(redis, groups=2)
    push_rows(redis, range(1, 6))
    servers += [ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, group=g, groups=2)) for g in (0, 1)]
    for s in servers:
        s.start()
    wait_until(lambda: applied(redis) == 5, 60, what="5 updates applied")
    want = expected_rows([1, 2, 3, 4, 5])["user"]
    ids = np.array([*sorted(want)[:6], 123456789], dtype=np.int64)  # the last was never pushed
    got = pull_rows(redis, JOB, {"user": USER}, 2, {"user": ids})
    rows = got.tables["user"]
    assert rows.present.tolist() == [True] * 6 + [False]
    for j, i in enumerate(ids[:6].tolist()):
        np.testing.assert_array_equal(rows.values[j], want[i])
    # what moved: the whole record of each row found (native HMGETs: Redis cuts no prefix), nothing for the others
    assert got.wire_bytes == 6 * row_dtype(USER).itemsize
    assert set(got.group_versions) <= {0, 1}
    with pytest.raises(LayoutError, match="no embedding table 'colour'"):
        pull_rows(redis, JOB, {"user": USER}, 2, {"colour": ids})


def test_bad_gradient_rows_are_refused_before_the_push(redis: redis_lib.Redis) -> None:
    setup(redis)
    pusher = Pusher(redis, JOB, "a")
    ids = np.array([1, 2], dtype=np.int64)
    with pytest.raises(BadGradientError, match="table 'colour'"):
        pusher.prepare(None, generation=1, clock=1, rows=[RowGrads("colour", ids, np.zeros((2, 4), np.float32))])
    with pytest.raises(BadGradientError, match=r"shape \[2, 3\], expected \[2, 4\]"):
        pusher.prepare(None, generation=1, clock=1, rows=[RowGrads("user", ids, np.zeros((2, 3), np.float32))])
    with pytest.raises(BadGradientError, match="unique and increasing"):
        pusher.prepare(None, generation=1, clock=1,
                       rows=[RowGrads("user", ids[::-1].copy(), np.zeros((2, 4), np.float32))])
    nan = np.zeros((2, 4), np.float32)
    nan[0, 0] = np.nan
    with pytest.raises(BadGradientError, match="table 'user'"):
        pusher.prepare(None, generation=1, clock=1, rows=[RowGrads("user", ids, nan)])
    with pytest.raises(LayoutError, match="embedding tables"):  # another model's tables under this job
        ParameterStore(redis, JOB).init_model(small_model(), shard_elems=64, tables=(USER,))


def run_ps(redis_url: str, job: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "streamtrain.cli", "ps", "--redis-url", redis_url,
                             "--job", job, "--block-ms", "50", "--log-level", "WARNING", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.parametrize("fault", ["kill-before-write", "kill-after-write"])
def test_rows_are_bit_for_bit_those_of_a_server_never_killed(redis: redis_lib.Redis, redis_url: str,
                                                            fault: str) -> None:
    """The same pushes to two jobs; one job's server is SIGKILLed around a write and restarted: its
    rows, sighting records, counters and accounting equal those of the job whose server never died."""
    jobs = ["rows-killed", "rows-calm"]
    for job in jobs:
        setup(redis, job=job, groups=2)
    pushers = {job: Pusher(redis, job, "a") for job in jobs}
    for c in range(1, 13):
        for job in jobs:
            pushers[job].push(None, generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                              samples=[("prod", 10 * (c - 1), 10)], batch_size=10, rows=batch_rows(c))
    procs = [run_ps(redis_url, "rows-killed", "--groups", "2", "--group", "0", "--batch", "3", "--fault", fault,
                    "--fault-at", "5"),
             run_ps(redis_url, "rows-killed", "--groups", "2", "--group", "1", "--batch", "3"),
             *(run_ps(redis_url, "rows-calm", "--groups", "2", "--group", str(g), "--batch", "5") for g in (0, 1))]
    try:
        assert procs[0].wait(60) == -9  # the injected SIGKILL
        procs[0].stderr.close()
        procs[0] = run_ps(redis_url, "rows-killed", "--groups", "2", "--group", "0", "--batch", "3")
        for job in jobs:
            wait_until(lambda job=job: applied(redis, job) == 12, 90, what=f"{job}: 12 updates applied")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
            if p.stderr is not None:
                p.stderr.close()
    for spec in (USER, ITEM):
        killed, calm = stored(redis, "rows-killed", spec, 2), stored(redis, "rows-calm", spec, 2)
        assert sorted(killed) == sorted(calm)
        for i in calm:  # values, optimizer state and version (when written) bit for bit
            assert killed[i]["values"].tobytes() == calm[i]["values"].tobytes()
            assert killed[i]["state"].tobytes() == calm[i]["state"].tobytes()
        for g in (0, 1):
            seen = [redis.hgetall(JobKeys(job).group(g).table_seen(spec.name)) for job in jobs]
            assert {k: v[:4] for k, v in seen[0].items()} == {k: v[:4] for k, v in seen[1].items()}  # counts
    for g in (0, 1):
        stats = [redis.hgetall(JobKeys(job).group(g).table_stats) for job in jobs]
        assert stats[0] == stats[1]
    for job in jobs:
        entries = redis.xrange(JobKeys(job).applied_samples)
        assert len(entries) == 12 and {f[b"status"] for _, f in entries} == {b"applied"}
        assert accounting_left(redis, job) == [] and gradient_blobs(redis, job) == []


def test_row_gradients_travel_as_float16_when_asked(redis: redis_lib.Redis, redis_url: str, servers: list) -> None:
    setup(redis)
    push_rows(redis, range(1, 3), row_dtype_="float16")
    servers.append(ParameterServer(ServerSettings(redis_url=redis_url, job=JOB)))
    servers[0].start()
    wait_until(lambda: applied(redis) == 2, 60, what="2 updates applied")
    row = batch_rows(1)[0]
    j = next(j for j, i in enumerate(row.ids.tolist()) if i not in batch_rows(2)[0].ids.tolist())
    v = initial_rows(USER, row.ids[j:j + 1]).copy()
    s = np.zeros((1, USER.slots), np.float32)
    g = row.grads[j:j + 1]
    step_rows(USER.optimizer, v, s, g.astype(np.float16).astype(np.float32), 1)
    got = stored(redis, JOB, USER, 1)[int(row.ids[j])]["values"]
    np.testing.assert_array_equal(got, v[0])
    exact = initial_rows(USER, row.ids[j:j + 1]).copy()
    step_rows(USER.optimizer, exact, np.zeros((1, USER.slots), np.float32), g, 1)
    assert not np.array_equal(got, exact[0]) or np.array_equal(g.astype(np.float16).astype(np.float32), g)


def test_rows_expire_and_the_row_cap_evicts_the_least_recently_written(redis: redis_lib.Redis) -> None:
    """The sweep on rows written by hand at known times (the same records an apply writes)."""
    from services.tables.rows import SEEN_DTYPE, id_bytes
    from services.tables.store import sweep_rows

    spec = TableSpec("t", 2, expire_after_s=60.0, max_rows=50)
    gk = JobKeys("sweep").group(0)
    now = 10_000_000
    records = np.zeros(100, dtype=row_dtype(spec))
    records["written_ms"] = [now - 120_000 if i < 20 else now - 500 * i for i in range(100)]  # 20 expired
    ids = np.arange(100, dtype=np.int64)
    redis.hset(gk.table_rows("t"), mapping={id_bytes(ids[i:i + 1]): records[i].tobytes() for i in range(100)})
    seen = np.zeros(3, dtype=SEEN_DTYPE)
    seen["count"], seen["seen_ms"] = 1, [now - 61_000, now - 59_000, now - 1]
    redis.hset(gk.table_seen("t"), mapping={id_bytes(np.array([1000 + i])): seen[i].tobytes() for i in range(3)})
    step = sweep_rows(redis, "sweep", 0, spec, 1, now_ms=now, count=1000)
    assert (step.expired, step.seen_expired, step.cursor, step.seen_cursor) == (20, 1, "0", "0")
    # 80 left, cap 50: the 30 written longest ago go (approximately: sampled oldest-first)
    assert step.evicted == 30 and step.rows == 50 == redis.hlen(gk.table_rows("t"))
    left = sorted(int(np.frombuffer(k, "<i8")[0]) for k in redis.hkeys(gk.table_rows("t")))
    assert min(left) >= 20 and np.mean(left) < 65  # mostly the recently written (small i) survive
    stats = redis.hgetall(gk.table_stats)
    assert (int(stats[b"t:expired"]), int(stats[b"t:evicted"])) == (20, 30)
    # a cap shared by groups: each keeps its share (here 2 groups: 25)
    assert sweep_rows(redis, "sweep", 0, spec, 2, now_ms=now).rows == 25
    # nothing is removed from a table without expiry or cap
    calm = TableSpec("t", 2)
    assert sweep_rows(redis, "sweep", 0, calm, 1, now_ms=now + 10**9) == \
        type(step)("0", "0", 0, 0, 0, 25)


def _writes(spec: TableSpec, ids: np.ndarray, version: int, seen_ids: np.ndarray, unseen_ids: np.ndarray,
            rng: np.random.Generator) -> tuple[TableWrites, np.ndarray, np.ndarray]:
    """What a batch writes: rows of ``ids`` stamped ``version``, sighting records of ``seen_ids``."""
    records = np.zeros(ids.size, dtype=row_dtype(spec))
    records["version"] = version
    records["values"] = rng.standard_normal((ids.size, spec.dim))
    records["state"] = rng.standard_normal((ids.size, spec.slots))
    seen = np.zeros(seen_ids.size, dtype=SEEN_DTYPE)
    seen["count"] = rng.integers(1, 5, seen_ids.size)
    seen["seen_ms"] = rng.integers(1, 2**40, seen_ids.size)
    return (TableWrites(spec.name, row_dtype(spec).itemsize, ids, records.tobytes(), seen_ids, seen.tobytes(),
                        unseen_ids, 3, 0, 0), records, seen)


def _hash(client: redis_lib.Redis, key: str) -> dict[int, bytes]:
    return {int(np.frombuffer(k, "<i8")[0]): v for k, v in client.hgetall(key).items()}


@pytest.mark.parametrize("packed", [True, False], ids=["packed-args", "redis-py-args"])
def test_an_apply_of_thousands_of_rows_writes_them_their_sightings_and_its_feed_entry(
        redis: redis_lib.Redis, redis_url: str, packed: bool) -> None:
    """The group's half writes rows and sighting records with native HSET/HDEL after the script, in its
    MULTI/EXEC: every record as sent, the feed entry naming the IDs written, nothing when the group
    version moved, and, while a checkpoint holds the cut, the old records in the shadows first (more
    IDs than one of the script's 4000-field HMGETs)."""
    client = connect(redis_url) if packed else redis
    job, spec = f"rows-many-{packed}", TableSpec("user", 4, admit_after=2)
    gk, rng = JobKeys(job).group(0), np.random.default_rng(11)
    sighted = np.arange(6000, dtype=np.int64) * 3 + 2**40
    old_ids = np.arange(9000, dtype=np.int64) * 5 - 7
    first, old, seen1 = _writes(spec, old_ids, 1, sighted, np.zeros(0, np.int64), rng)
    assert write_batch(client, job, group=0, groups=1, cursor="", outcomes=[], shards=[], version=0,
                       tables=[first]).ok
    # the next batch overwrites 4500 rows, adds 4500, sights 4500 IDs and admits 4200 sighted ones
    ids = np.concatenate([old_ids[::2], np.arange(4500, dtype=np.int64) * 5 + 10**6])
    unseen, newly = sighted[:4200], np.arange(4500, dtype=np.int64) + 2**41
    writes, records, seen2 = _writes(spec, ids, 2, newly, unseen, rng)
    moved = write_batch(client, job, group=0, groups=1, cursor="", outcomes=[], shards=[], version=0,
                        tables=[writes])
    assert not moved.ok and moved.conflict == "GROUP 1" and redis.hlen(gk.table_rows("user")) == 9000
    redis.set(gk.table_cut, "1 save-1 0")  # a checkpoint's cut at version 1
    assert write_batch(client, job, group=0, groups=1, cursor="", outcomes=[], shards=[], version=1,
                       tables=[writes]).ok
    rows = _hash(redis, gk.table_rows("user"))
    want = {int(i): r.tobytes() for i, r in zip(old_ids, old, strict=True)}
    want |= {int(i): r.tobytes() for i, r in zip(ids, records, strict=True)}
    assert rows == want
    seen = _hash(redis, gk.table_seen("user"))
    want_seen = {int(i): r.tobytes() for i, r in zip(sighted[4200:], seen1[4200:], strict=True)}
    assert seen == want_seen | {int(i): r.tobytes() for i, r in zip(newly, seen2, strict=True)}
    (_, entry), = redis.xrevrange(gk.feed, count=1)
    assert entry[b"w:user"] == ids.astype("<i8").tobytes() and int(entry[b"v"]) == 2
    # the cut's shadows: the old record of each row overwritten, '' for each ID newly sighted, the
    # old sighting record of each ID admitted
    shadow = _hash(redis, gk.table_shadow("user"))
    assert shadow == {int(i): r.tobytes() for i, r in zip(old_ids[::2], old[::2], strict=True)}
    seen_shadow = _hash(redis, gk.seen_shadow("user"))
    assert seen_shadow == {int(i): b"" for i in newly} | {int(i): r.tobytes()
                                                          for i, r in zip(unseen, seen1[:4200], strict=True)}
    assert int(redis.hget(gk.table_stats, "user:steps")) == 3
