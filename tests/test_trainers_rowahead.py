"""Rows fetched ahead, on the real Redis: a row changed between its fetch ahead and its use is read
again whenever the table's bound requires it (BSP, SSP, ASP), and a step takes the rows fetched for it."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis as redis_lib
import torch
from plane_util import set_membership, small_model

from common.keys import JobKeys
from datastream import Batch
from datastream.jagged import Jagged
from services import OptimizerConfig, ParameterStore
from services.tables import TableSpec, initial_rows
from services.tables.rows import id_bytes, row_dtype
from trainers.rowahead import RowsAhead
from trainers.rowcache import RowCache, TableBound
from trainers.steps import TableRows
from trainers.tables import RowFetcher, plan_lookups, table_required

JOB = "ahead"
T = TableSpec("t", 4)
TABLES = {"t": T}
X = 7  # the row the server changes between the fetch ahead and its use


def _batch(ids: list[int]) -> Batch:
    col = Jagged(np.array(ids, dtype=np.int64), np.arange(len(ids) + 1, dtype=np.int64))
    return Batch(torch.zeros(len(ids), 1), torch.zeros(len(ids)), {}, [], 0, 0, {"t": col})


def _write_row(redis: redis_lib.Redis, ident: int, value: float) -> None:
    """Write row ``ident`` as an apply does: a record stamped with the group's next version."""
    keys = JobKeys(JOB).group(0)
    version = int(redis.incr(keys.version))
    record = np.zeros(1, dtype=row_dtype(T))
    record["version"] = version
    record["values"] = value
    redis.hset(keys.table_rows("t"), id_bytes(np.array([ident], dtype=np.int64)), record.tobytes())


def _set_clocks(redis: redis_lib.Redis, applied: int) -> None:
    keys = JobKeys(JOB)
    redis.hset(keys.clocks, "a", applied + 1)
    redis.hset(keys.applied_clocks, "a", applied)


@pytest.fixture
def parts(redis: redis_lib.Redis) -> Iterator[tuple[RowCache, RowFetcher, RowsAhead]]:
    ParameterStore(redis, JOB).init_model(small_model(), shard_elems=64, optimizer=OptimizerConfig("sgd", lr=0.1),
                                         tables=(T,))
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    _write_row(redis, X, 1.0)
    cache = RowCache(TABLES, 64)
    ahead = RowsAhead(redis, JOB, TABLES, 1, cache, depth=4)
    try:
        yield cache, RowFetcher(redis, JOB, TABLES, 1, cache), ahead
    finally:
        ahead.close()


def _use(fetcher: RowFetcher, ids: list[int], clock: int, bound: TableBound) -> np.ndarray:
    """The rows a step at ``clock`` computes on for ``ids`` (after a wait that observed nothing new)."""
    lookups = plan_lookups(TABLES, _batch(ids).ids, len(ids), groups=1)
    got = fetcher.fetch(lookups, clock=clock, bound=bound, required=table_required(bound, clock), covers=-1)
    return got.rows["t"]


@pytest.mark.parametrize(("bound", "applied", "use_at", "fresh"), [
    (TableBound("asp", 2), 0, 6, False),   # used 1 step after its fetch: S = 2 allows the row fetched ahead
    (TableBound("asp", 2), 0, 7, False),   # 2 steps: still allowed
    (TableBound("asp", 2), 0, 8, True),    # 3 steps: the bound needs the row read again
    (TableBound("ssp", 1), 4, 6, False),   # it covers 4 (read before the rows), clock 6 needs 6 - 1 - 1 = 4
    (TableBound("ssp", 1), 3, 6, True),    # it covers 3 only: read again
    (TableBound("ssp", 1), 4, 7, True),    # clock 7 needs 5
])
def test_a_row_fetched_ahead_serves_only_as_the_bound_allows(
        redis: redis_lib.Redis, parts: tuple[RowCache, RowFetcher, RowsAhead], bound: TableBound, applied: int,
        use_at: int, fresh: bool) -> None:
    cache, fetcher, ahead = parts
    _set_clocks(redis, applied)
    assert ahead.start([_batch([X, 9]), _batch([X])], clock=5, bound=bound, covers=-1, member_id="a")
    fetched = ahead.take()  # the fetch ahead has read the rows ...
    assert fetched is not None and fetched.rows == 2 and fetched.clock == 5
    _write_row(redis, X, 2.0)  # ... then the server changes X
    ahead.merge(fetched, use_at)
    rows = _use(fetcher, [9, X], use_at, bound)
    assert rows[0].tolist() == [2.0 if fresh else 1.0] * 4  # the lookup's IDs are sorted: X, then 9
    assert np.array_equal(rows[1], initial_rows(T, np.array([9]))[0])  # 9 has no row: its initial value
    assert cache.stats().hits == (0 if fresh else 2)  # 9 was fetched ahead with X: as fresh


def test_under_bsp_nothing_is_fetched_ahead_and_the_step_reads_the_row_anew(
        redis: redis_lib.Redis, parts: tuple[RowCache, RowFetcher, RowsAhead]) -> None:
    _, fetcher, ahead = parts
    bsp = TableBound("bsp", 0)
    _set_clocks(redis, 4)
    # rows read during step 5 cover at most 4: step 6 needs 5, so no fetch ahead can serve it
    assert not ahead.start([_batch([X])], clock=5, bound=bsp, covers=4, member_id="a")
    assert ahead.take() is None
    fetched_early = _use(fetcher, [X], 5, bsp)  # the step at 5 caches X as covering nothing newer
    _write_row(redis, X, 2.0)
    assert fetched_early[0, 0] == 1.0 and _use(fetcher, [X], 6, bsp)[0, 0] == 2.0


def test_a_clear_drops_the_fetch_in_flight_and_a_step_takes_the_rows_fetched_for_it(
        redis: redis_lib.Redis, parts: tuple[RowCache, RowFetcher, RowsAhead]) -> None:
    cache, fetcher, ahead = parts
    asp = TableBound("asp", 4)
    rows = TableRows(TABLES, fetcher, ahead)
    assert ahead.start([_batch([X])], clock=5, bound=asp, covers=-1, member_id="a")
    cache.clear()  # a resync: what was read before it is not trusted
    assert ahead.take() is None
    # the step at 5 pulls its batch's rows and starts the fetch of the next two batches' ones
    rows.fetch(_batch([1, 2]), 5, asp, None, upcoming=(_batch([X, 1]), _batch([3])), member_id="a")
    pulls = fetcher.pulled_bytes
    _, got = rows.fetch(_batch([X, 3, 1]), 6, asp, None, upcoming=(), member_id="a")
    assert np.array_equal(got["t"], np.concatenate([initial_rows(T, np.array([1, 3])), np.ones((1, 4))]))  # IDs sorted
    assert cache.stats().hits == 3 and cache.stats().misses == 2  # all three from the cache at step 6
    assert fetcher.pulled_bytes > pulls  # the rows fetched ahead count as pulled
    assert ahead.merged == 1 and ahead.rows == 2  # X and 3 (1 was cached by the step at 5)
