"""The trainer's row cache: bounded, least recently used out, and never staler than its table allows; what
rows are fetched ahead, and how they merge into it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datastream import Batch
from datastream.jagged import Jagged
from services.tables import TableSpec
from trainers.rowahead import ahead_depth, wanted_ahead
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


def test_an_older_read_never_replaces_a_newer_one() -> None:
    cache = RowCache(TABLES, 10)
    asp = TableBound("asp", 1)
    ids, values = _rows([1, 2])
    cache.insert("t", ids, values, clock=5, covers=4, as_of=np.array([7, 7]))
    # a read as of group version 6 (older) for ID 1, as of 9 (newer) for ID 2, both made at clock 3
    cache.insert("t", ids, values * 10, clock=3, covers=2, as_of=np.array([6, 9]))
    hit, got = cache.lookup("t", ids, clock=6, bound=asp, required=None)
    assert hit.tolist() == [True, True] and got[:, 0].tolist() == [1, 20]
    # the newer read keeps the later clocks of the read it replaced: still fresh at clock 6 under S = 1
    assert cache.holds("t", ids, at=np.array([6, 6]), bound=asp).tolist() == [True, True]
    assert cache.holds("t", ids, at=np.array([7, 7]), bound=asp).tolist() == [False, False]
    assert cache.holds("t", ids, at=np.array([7, 8]), bound=SSP2).tolist() == [True, False]  # both cover 4
    assert cache.stats().hits == 2  # holds counts nothing


def test_rows_wanted_ahead_are_deduplicated_across_batches_and_against_the_cache() -> None:
    tables = {"t": TableSpec("t", 2, features=("a", "b")), "u": TableSpec("u", 2)}

    def batch(a: list[int], b: list[int]) -> Batch:
        ids = {"a": Jagged(np.array(a, dtype=np.int64), np.arange(len(a) + 1, dtype=np.int64)),
               "b": Jagged(np.array(b, dtype=np.int64), np.arange(len(b) + 1, dtype=np.int64))}
        return Batch(torch.zeros(len(a), 1), torch.zeros(len(a)), {}, [], 0, 0, ids)

    cache = RowCache(tables, 10)
    asp = TableBound("asp", 2)
    cache.insert("t", *_rows([5, 6]), clock=9, covers=0)  # at clock 10 both serve until clock 11
    batches = [batch([3, 5, 3], [4, 4, 9]), batch([6, 3, 1], [9, 9, 9])]
    wanted = wanted_ahead(tables, batches, cache, clock=10, bound=asp)
    # 5 is used at clock 11 only: the cache serves it; 6 is used last at clock 12: fetched anew
    assert list(wanted) == ["t"] and wanted["t"].tolist() == [1, 3, 4, 6, 9]
    assert ahead_depth(asp, 4) == 2 and ahead_depth(TableBound("bsp", 0), 4) == 0
    assert ahead_depth(TableBound("ssp", 3), 2) == 2 and ahead_depth(TableBound("asp", 0), 2) == 0


def test_a_row_an_insert_replaces_is_not_evicted_to_make_room_for_it() -> None:
    cache = RowCache(TABLES, 4)
    cache.insert("t", *_rows([0, 1, 2, 3]), clock=1, covers=100)
    cache.lookup("t", np.array([0, 1, 2]), clock=2, bound=SSP2, required=0)  # 3 is now the least recently used
    cache.insert("t", *_rows([3, 10]), clock=3, covers=100)  # full: 3 is read again, 10 needs a slot
    hit, got = cache.lookup("t", np.array([3, 10]), clock=3, bound=SSP2, required=0)
    assert hit.tolist() == [True, True] and got.tolist() == [[3, -3], [10, -10]]
    assert cache.stats().rows == 4
