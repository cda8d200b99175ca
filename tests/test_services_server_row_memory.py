"""A server's memory of its group's rows (``--row-memory-rows``): the rows it writes are bit for bit
those of a server that reads every row from Redis, and anything that changed the rows behind its back
(a version bump, a sweep) makes it read them again."""

from __future__ import annotations

import time

import numpy as np
import redis as redis_lib
from plane_util import set_membership, small_model

from common.keys import JobKeys
from services import OptimizerConfig, ParameterServer, ParameterStore, Pusher, ServerSettings
from services.tables import RowGrads, RowOptimizerConfig, TableSpec, initial_rows, step_rows
from services.tables.rows import SEEN_DTYPE, row_dtype
from services.tables.store import sweep_rows

USER = TableSpec("user", 4, optimizer=RowOptimizerConfig("lazyadam", lr=0.05))
ITEM = TableSpec("item", 2, optimizer=RowOptimizerConfig("adagrad", lr=0.1), admit_after=2)


def setup(redis: redis_lib.Redis, job: str, tables: tuple[TableSpec, ...]) -> None:
    ParameterStore(redis, job).init_model(small_model(), shard_elems=64, optimizer=OptimizerConfig("lazyadam", lr=0.01),
                                          groups=1, tables=tables)
    set_membership(redis, job, {"a": [0]}, generation=1)


def push(redis: redis_lib.Redis, job: str, clock: int, rows: list[RowGrads]) -> None:
    Pusher(redis, job, "a", row_dtype="float32").push(None, generation=1, clock=clock,
                                                      offsets={0: (10 * (clock - 1), 10 * clock)},
                                                      samples=[("prod", 10 * (clock - 1), 10)], batch_size=10,
                                                      rows=rows)


def zipf_rows(clock: int, tables: tuple[TableSpec, ...]) -> list[RowGrads]:
    """A few dozen IDs per table out of a hundred, the small ones far more often (repeated across
    updates and within a batch)."""
    rng = np.random.default_rng(clock)
    out = []
    for t in tables:
        ids = np.unique(np.minimum(rng.zipf(1.3, 30), 100).astype(np.int64))
        out.append(RowGrads(t.name, ids, rng.standard_normal((ids.size, t.dim)).astype(np.float32)))
    return out


def server(redis_url: str, job: str, memory: int, batch: int = 3) -> ParameterServer:
    s = ParameterServer(ServerSettings(redis_url=redis_url, job=job, batch=batch, block_ms=10,
                                       row_memory_rows=memory, table_sweep_every_s=3600.0))
    s.load()
    return s


def drain(s: ParameterServer, updates: int) -> None:
    """Apply ``updates`` more updates, driving the server by hand (no thread, no sweep)."""
    goal = s.applied + updates
    for _ in range(10 * updates + 10):
        if s.applied >= goal:
            return
        s.step()
    raise AssertionError(f"{s.applied} updates applied, {goal} wanted")


def records(redis: redis_lib.Redis, job: str, spec: TableSpec, *, hash_name: str = "table_rows"
            ) -> dict[bytes, bytes]:
    """The table's records in Redis (rows, or sighting records), the time each was written (sighted)
    cleared: it is the wall clock."""
    got = redis.hgetall(getattr(JobKeys(job).group(0), hash_name)(spec.name))
    dtype, when = (row_dtype(spec), "written_ms") if hash_name == "table_rows" else (SEEN_DTYPE, "seen_ms")
    out = {}
    for k, v in got.items():
        rec = np.frombuffer(v, dtype=dtype).copy()
        rec[when] = 0
        out[k] = rec.tobytes()
    return out


def test_rows_held_in_memory_write_bit_for_bit_what_a_server_without_it_writes(redis: redis_lib.Redis,
                                                                                redis_url: str) -> None:
    tables = (USER, ITEM)
    for job in ("mem-on", "mem-small", "mem-off"):
        setup(redis, job, tables)
    runs = {job: server(redis_url, job, memory) for job, memory in (("mem-on", 1000), ("mem-small", 8),
                                                                     ("mem-off", 0))}
    try:
        for clock in range(1, 41):  # pushed in rounds: batches of 1 to 3 updates, many IDs again and again
            for job in runs:
                push(redis, job, clock, zipf_rows(clock, tables))
            if clock % 5 == 0:
                for s in runs.values():
                    drain(s, 5)
        assert runs["mem-on"].row_memory.held() > 0 and runs["mem-off"].row_memory.held() == 0
        assert runs["mem-small"].row_memory.held() <= 2 * 8  # bounded per table
        for spec in tables:
            want = records(redis, "mem-off", spec)
            assert want
            for job in ("mem-on", "mem-small"):
                assert records(redis, job, spec) == want, f"{job}: table {spec.name}"
                assert records(redis, job, spec, hash_name="table_seen") == \
                    records(redis, "mem-off", spec, hash_name="table_seen")
        versions = {job: int(redis.get(JobKeys(job).group(0).version) or 0) for job in runs}
        assert len(set(versions.values())) == 1, versions
    finally:
        for s in runs.values():
            s.close()


def _row(redis: redis_lib.Redis, job: str, spec: TableSpec, i: int) -> np.ndarray:
    raw = redis.hget(JobKeys(job).group(0).table_rows(spec.name), np.array([i], "<i8").tobytes())
    assert raw is not None
    return np.frombuffer(raw, dtype=row_dtype(spec))[0].copy()


def _one(i: int, grad: float) -> list[RowGrads]:
    return [RowGrads(USER.name, np.array([i], np.int64), np.full((1, USER.dim), grad, np.float32))]


def test_a_row_changed_behind_the_servers_back_is_read_again(redis: redis_lib.Redis, redis_url: str) -> None:
    """As a restore or another server of the group would: the row changed with the group's version
    bumped (the write loses its compare-and-set and reloads), or with only the feed moved (a sweep of
    a server that lost the group: the load sees it before serving the row from memory)."""
    job = "mem-behind"
    setup(redis, job, (USER,))
    s = server(redis_url, job, 1000, batch=1)
    gk = JobKeys(job).group(0)
    try:
        for clock, bump in ((1, None), (2, None), (3, "version"), (4, "feed_head")):
            if bump is not None:  # the row as someone else leaves it
                rec = _row(redis, job, USER, 7)
                rec["values"] += 1.0
                rec["state"] *= 0.5
                redis.hset(gk.table_rows(USER.name), np.array([7], "<i8").tobytes(), rec.tobytes())
                redis.incr(gk.version if bump == "version" else gk.feed_head)
                assert s.row_memory.held() > 0  # the server still holds its own copy
                values, state = rec["values"][None].astype(np.float32), rec["state"][None].astype(np.float32)
            else:
                before = _row(redis, job, USER, 7) if clock > 1 else None
                values = initial_rows(USER, np.array([7], np.int64)) if before is None else before["values"][None]
                state = np.zeros((1, USER.slots), np.float32) if before is None else before["state"][None]
                values, state = values.astype(np.float32), state.astype(np.float32)
            push(redis, job, clock, _one(7, 0.1 * clock))
            drain(s, 1)
            step_rows(USER.optimizer, values, state, np.full((1, USER.dim), 0.1 * clock, np.float32),
                      np.array([clock]))
            got = _row(redis, job, USER, 7)
            np.testing.assert_array_equal(got["values"], values[0], err_msg=f"update {clock}")
            np.testing.assert_array_equal(got["state"], state[0], err_msg=f"update {clock}")
    finally:
        s.close()


def test_after_a_sweep_expires_rows_an_update_starts_them_from_their_initial_value(redis: redis_lib.Redis,
                                                                                  redis_url: str) -> None:
    """The server's own sweep step, then one it does not know of (a server that lost the group, or a
    sweep run by hand): neither bumps the group version."""
    spec = TableSpec("user", 4, optimizer=RowOptimizerConfig("lazyadam", lr=0.05), expire_after_s=0.2)
    job = "mem-sweep"
    setup(redis, job, (spec,))
    s = server(redis_url, job, 1000, batch=1)
    try:
        for clock in (1, 2):
            push(redis, job, clock, _one(5, 0.3))
            drain(s, 1)
        time.sleep(0.4)  # the row is older than the expiry time
        for clock, sweep in ((3, "own"), (5, "behind")):
            if sweep == "own":
                assert s.sweep_tables() == (1, 0)
            else:
                assert sweep_rows(redis, job, 0, spec, 1, now_ms=int(time.time() * 1000) + 10_000).expired == 1
            assert redis.hlen(JobKeys(job).group(0).table_rows(spec.name)) == 0
            push(redis, job, clock, _one(5, 0.3))
            drain(s, 1)
            values = initial_rows(spec, np.array([5], np.int64)).astype(np.float32)
            state = np.zeros((1, spec.slots), np.float32)
            step_rows(spec.optimizer, values, state, np.full((1, spec.dim), 0.3, np.float32), np.array([clock]))
            got = _row(redis, job, spec, 5)
            np.testing.assert_array_equal(got["values"], values[0], err_msg=f"update {clock}")
            np.testing.assert_array_equal(got["state"], state[0], err_msg=f"update {clock}")
            if sweep == "own":  # the row is held again, then written again (update 4) before the next sweep
                push(redis, job, 4, _one(5, 0.3))
                drain(s, 1)
    finally:
        s.close()
