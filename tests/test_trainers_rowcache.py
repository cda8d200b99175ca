"""The trainer's row cache: bounded, least recently used out, and never staler than its table allows."""

from __future__ import annotations

import numpy as np
import pytest

from services.tables import TableSpec
from trainers.rowcache import RowCache, TableBound

TABLES = {"t": TableSpec("t", 2)}
SSP2 = TableBound("ssp", 2)


def _rows(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array(ids, dtype=np.int64)
    return a, np.stack([a.astype(np.float32), -a.astype(np.float32)], axis=1)


def test_a_row_serves_while_it_covers_the_ssp_bound() -> None:
    cache = RowCache(TABLES, 10)
    ids, values = _rows([3, 7])
    cache.insert("t", ids, values, clock=5, covers=4)
    # at clock c the bound needs every update up to c - S - 1
    hit, got = cache.lookup("t", np.array([7, 3, 9]), clock=7, bound=SSP2, required=4)
    assert hit.tolist() == [True, True, False] and got.tolist() == [[7, -7], [3, -3]]
    hit, _ = cache.lookup("t", np.array([3]), clock=8, bound=SSP2, required=5)
    assert hit.tolist() == [False]  # the bound moved past what the pull covered
    hit, _ = cache.lookup("t", np.array([3]), clock=6, bound=TableBound("bsp", 0), required=5)
    assert hit.tolist() == [False]  # BSP: always read afresh after the wait
    assert cache.stats().hits == 2 and cache.stats().misses == 3 and cache.stats().hit_rate == 0.4


def test_an_asp_row_serves_for_s_more_steps_of_its_reader() -> None:
    cache = RowCache(TABLES, 10)
    cache.insert("t", *_rows([1]), clock=10, covers=0)
    asp = TableBound("asp", 3)
    assert cache.lookup("t", np.array([1]), clock=13, bound=asp, required=None)[0].tolist() == [True]
    assert cache.lookup("t", np.array([1]), clock=14, bound=asp, required=None)[0].tolist() == [False]
    assert cache.lookup("t", np.array([1]), clock=10, bound=TableBound("asp", 0), required=None)[0].tolist() == [True]
    assert cache.lookup("t", np.array([1]), clock=11, bound=TableBound("asp", 0), required=None)[0].tolist() == [False]


def test_the_cache_holds_at_most_its_capacity_and_drops_the_least_recently_used() -> None:
    cache = RowCache(TABLES, 8)
    for step in range(1, 5):  # rows 0-7, two per step
        cache.insert("t", *_rows([2 * step - 2, 2 * step - 1]), clock=step, covers=100)
    cache.lookup("t", np.array([0, 1]), clock=5, bound=SSP2, required=0)  # 0 and 1 used again
    cache.insert("t", *_rows([100, 101]), clock=6, covers=100)  # full: the least recently used go
    assert cache.stats().rows <= 8
    held = cache.lookup("t", np.arange(8), clock=6, bound=SSP2, required=0)[0]
    assert held[:2].all() and not held[2:4].any()  # 2 and 3 were used longest ago
    assert cache.lookup("t", np.array([100, 101]), clock=6, bound=SSP2, required=0)[0].all()
    many, values = _rows(list(range(1000, 1020)))  # more new rows in one step than it holds
    cache.insert("t", many, values, clock=7, covers=100)
    assert cache.stats().rows <= 8


def test_a_cache_of_no_rows_serves_nothing_and_clear_forgets() -> None:
    empty = RowCache(TABLES, 0)
    empty.insert("t", *_rows([1]), clock=1, covers=5)
    assert not empty.lookup("t", np.array([1]), clock=1, bound=SSP2, required=0)[0].any()
    cache = RowCache(TABLES, 4)
    cache.insert("t", *_rows([1, 2]), clock=1, covers=5)
    cache.clear()
    assert cache.stats().rows == 0 and not cache.lookup("t", np.array([1]), clock=1, bound=SSP2, required=0)[0].any()
    with pytest.raises(ValueError, match="capacity"):
        RowCache(TABLES, -1)
    with pytest.raises(ValueError, match="bsp, ssp or asp"):
        TableBound("eventual", 1)
