"""The serving replica's row store (pure; no servers): round trips against a reference dict, the version
guard, LRU eviction when bounded, slot reuse, a seeded random sequence of operations, the memory bound,
and the errors that name a bad argument."""

from __future__ import annotations

import numpy as np
import pytest

from serving.rowstore import RowStore

DIM = 4
I64_MIN = np.iinfo(np.int64).min
I64_MAX = np.iinfo(np.int64).max


def ids_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def rows_for(ids: np.ndarray, seed: int = 0, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((len(ids), dim)).astype(np.float32)


def vers(n: int, version: int) -> np.ndarray:
    return np.full(n, version, dtype=np.uint64)


def check_against(store: RowStore, ref: dict[int, tuple[np.ndarray, int]], gather: bool = True) -> None:
    """The store holds exactly the reference's rows, and (if ``gather``) gather finds exactly them."""
    ids, values, versions = store.items()
    assert store.rows == len(ref)
    assert ids.tolist() == sorted(ref)
    for i, key in enumerate(ids.tolist()):
        np.testing.assert_array_equal(values[i], ref[key][0])
        assert int(versions[i]) == ref[key][1]
    if gather and ref:
        out = np.full((len(ref), store.dim), np.nan, dtype=np.float32)
        keys = np.array(sorted(ref), dtype=np.int64)
        assert store.gather(keys, out).all()
        np.testing.assert_array_equal(out, np.stack([ref[k][0] for k in keys.tolist()]))


def test_insert_gather_remove_round_trip() -> None:
    store = RowStore(DIM)
    ids = ids_of(5, -3, 17, 0, 1 << 40)
    values = rows_for(ids)
    assert store.upsert(ids, values, vers(5, 1)) == 5
    ref = {int(k): (values[i], 1) for i, k in enumerate(ids)}
    check_against(store, ref)

    query = ids_of(17, 99, -3, 5, 1234)
    out = np.full((5, DIM), -7.0, dtype=np.float32)
    found = store.gather(query, out)
    assert found.tolist() == [True, False, True, True, False]
    np.testing.assert_array_equal(out[0], ref[17][0])
    np.testing.assert_array_equal(out[2], ref[-3][0])
    assert (out[[1, 4]] == -7.0).all()  # absent IDs leave out untouched

    assert store.remove(ids_of(17, 99, 5)) == 2
    del ref[17], ref[5]
    check_against(store, ref)
    assert store.remove(ids_of(17, 5)) == 0


def test_gather_with_duplicate_ids() -> None:
    store = RowStore(DIM)
    ids = ids_of(1, 2, 3)
    values = rows_for(ids)
    store.upsert(ids, values, vers(3, 0))
    out = np.zeros((5, DIM), dtype=np.float32)
    found = store.gather(ids_of(2, 2, 9, 3, 2), out)
    assert found.tolist() == [True, True, False, True, True]
    np.testing.assert_array_equal(out[[0, 1, 4]], np.stack([values[1]] * 3))
    np.testing.assert_array_equal(out[3], values[2])


def test_extreme_int64_ids() -> None:
    store = RowStore(DIM)
    ids = ids_of(I64_MAX, I64_MIN, 0, -1, I64_MIN + 1, I64_MAX - 1)
    values = rows_for(ids)
    store.upsert(ids, values, vers(len(ids), 3))
    ref = {int(k): (values[i], 3) for i, k in enumerate(ids)}
    check_against(store, ref)
    out = np.zeros((3, DIM), dtype=np.float32)
    assert store.gather(ids_of(I64_MIN, I64_MAX, 1), out).tolist() == [True, True, False]
    assert store.remove(ids_of(I64_MIN, I64_MAX)) == 2
    del ref[int(I64_MIN)], ref[int(I64_MAX)]
    check_against(store, ref)


def test_version_guard() -> None:
    store = RowStore(DIM)
    ids = ids_of(1, 2, 3)
    first = rows_for(ids, seed=1)
    store.upsert(ids, first, vers(3, 10))
    second = rows_for(ids, seed=2)
    # 1: older (kept), 2: equal (written), 3: newer (written)
    written = store.upsert(ids, second, np.array([9, 10, 11], dtype=np.uint64))
    assert written == 2
    check_against(store, {1: (first[0], 10), 2: (second[1], 10), 3: (second[2], 11)})


def test_insert_false_ignores_absent_ids() -> None:
    store = RowStore(DIM)
    store.upsert(ids_of(1), rows_for(ids_of(1), seed=1), vers(1, 1))
    ids = ids_of(1, 2)
    values = rows_for(ids, seed=2)
    assert store.upsert(ids, values, vers(2, 2), insert=False) == 1
    check_against(store, {1: (values[0], 2)})


def test_lru_eviction_keeps_gathered_rows() -> None:
    store = RowStore(DIM, max_rows=4)
    for key in (1, 2, 3, 4):  # inserted in separate calls: stamps 1 < 2 < 3 < 4
        store.upsert(ids_of(key), rows_for(ids_of(key), seed=key), vers(1, 1))
    out = np.zeros((2, DIM), dtype=np.float32)
    assert store.gather(ids_of(1, 2), out).all()  # 1 and 2 now the most recently used
    # an update of 3 is not a use
    store.upsert(ids_of(3), rows_for(ids_of(3), seed=30), vers(1, 2), insert=False)

    assert store.upsert(ids_of(5), rows_for(ids_of(5), seed=5), vers(1, 1)) == 1
    assert store.evictions == 1
    assert store.items()[0].tolist() == [1, 2, 4, 5]  # 3 was the least recently used

    assert store.upsert(ids_of(6, 7), rows_for(ids_of(6, 7), seed=6), vers(2, 1)) == 2
    assert store.evictions == 3
    assert store.items()[0].tolist() == [2, 5, 6, 7]  # then 4, then 1 (gathered before 2)
    assert store.rows == 4
    assert store.capacity == 4  # allocated once, at max_rows


def test_bounded_insert_of_more_rows_than_max_keeps_the_first() -> None:
    store = RowStore(DIM, max_rows=3)
    store.upsert(ids_of(100), rows_for(ids_of(100)), vers(1, 1))
    ids = ids_of(9, 1, 8, 2, 7)
    values = rows_for(ids, seed=3)
    assert store.upsert(ids, values, vers(5, 4)) == 3
    assert store.evictions == 1
    check_against(store, {9: (values[0], 4), 1: (values[1], 4), 8: (values[2], 4)})


def test_from_rows_bulk_and_bounded_truncation() -> None:
    ids = ids_of(30, 10, 20, -5)
    values = rows_for(ids)
    versions = np.array([1, 2, 3, 4], dtype=np.uint64)
    store = RowStore.from_rows(DIM, ids, values, versions)
    check_against(store, {int(k): (values[i], int(versions[i])) for i, k in enumerate(ids)})
    assert store.capacity == 4
    store.upsert(ids_of(40), rows_for(ids_of(40), seed=9), vers(1, 1))  # grows from the exact allocation
    assert store.rows == 5

    small = RowStore.from_rows(DIM, ids, values, versions, max_rows=2)
    check_against(small, {30: (values[0], 1), 10: (values[1], 2)})
    assert small.evictions == 0
    with pytest.raises(ValueError, match="unique"):
        RowStore.from_rows(DIM, ids_of(1, 1), rows_for(ids_of(1, 1)), vers(2, 0))


def test_removed_slots_are_reused() -> None:
    store = RowStore(DIM)
    ids = np.arange(1000, dtype=np.int64)
    store.upsert(ids, rows_for(ids), vers(1000, 1))
    assert store.remove(ids[::2]) == 500
    after_remove = store.nbytes
    capacity = store.capacity
    for round_ in range(5):
        fresh = np.arange(10_000 + 1000 * round_, 10_000 + 1000 * round_ + 500, dtype=np.int64)
        store.upsert(fresh, rows_for(fresh, seed=round_), vers(500, 2))
        assert store.rows == 1000
        assert store.capacity == capacity
        store.remove(fresh)
        assert store.nbytes == after_remove


def test_clear() -> None:
    store = RowStore(DIM)
    ids = np.arange(100, dtype=np.int64)
    store.upsert(ids, rows_for(ids), vers(100, 1))
    store.clear()
    assert store.rows == 0
    assert store.nbytes == 0
    check_against(store, {})
    out = np.zeros((1, DIM), dtype=np.float32)
    assert not store.gather(ids_of(5), out).any()

    bounded = RowStore(DIM, max_rows=10)
    allocated = bounded.nbytes
    bounded.upsert(ids, rows_for(ids), vers(100, 1))
    bounded.clear()
    assert bounded.rows == 0
    assert bounded.nbytes == allocated


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    store = RowStore(DIM)
    ref: dict[int, tuple[np.ndarray, int]] = {}
    universe = np.concatenate([rng.integers(-500, 500, 200), [I64_MIN, I64_MAX]]).astype(np.int64)
    universe = np.unique(universe)
    for _ in range(300):
        op = rng.integers(0, 3)
        ids = rng.choice(universe, size=int(rng.integers(0, 40)), replace=op != 1)
        if op == 0:
            gout = np.zeros((len(ids), DIM), dtype=np.float32)
            found = store.gather(ids, gout)
            assert found.tolist() == [int(k) in ref for k in ids]
            for i in np.flatnonzero(found):
                np.testing.assert_array_equal(gout[i], ref[int(ids[i])][0])
        elif op == 1:
            values = rng.standard_normal((len(ids), DIM)).astype(np.float32)
            versions = rng.integers(0, 6, len(ids)).astype(np.uint64)
            insert = bool(rng.integers(0, 4))
            expected = 0
            for key, row, version in zip(ids.tolist(), values, versions.tolist()):
                if key in ref:
                    if version >= ref[key][1]:
                        ref[key] = (row, version)
                        expected += 1
                elif insert:
                    ref[key] = (row, version)
                    expected += 1
            assert store.upsert(ids, values, versions, insert=insert) == expected
        else:
            present = {int(k) for k in ids if int(k) in ref}
            assert store.remove(ids) == len(present)
            for key in present:
                del ref[key]
    check_against(store, ref)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_bounded_operations_evict_only_least_recently_used(seed: int) -> None:
    """Reference recency per ID; after each insert the victims are no more recent than any survivor."""
    rng = np.random.default_rng(seed)
    max_rows = 50
    store = RowStore(DIM, max_rows=max_rows)
    ref: dict[int, tuple[np.ndarray, int]] = {}
    used: dict[int, int] = {}
    clock = 0
    evicted = 0
    for _ in range(300):
        ids = rng.choice(np.arange(200, dtype=np.int64), size=int(rng.integers(1, 30)), replace=False)
        clock += 1
        if rng.integers(0, 2):
            gout = np.zeros((len(ids), DIM), dtype=np.float32)
            found = store.gather(ids, gout)
            assert found.tolist() == [int(k) in ref for k in ids]
            for i in np.flatnonzero(found):
                np.testing.assert_array_equal(gout[i], ref[int(ids[i])][0])
                used[int(ids[i])] = clock
            continue
        values = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        versions = rng.integers(0, 6, len(ids)).astype(np.uint64)
        before = set(ref)
        for key, row, version in zip(ids.tolist(), values, versions.tolist()):
            if key in ref:
                if version >= ref[key][1]:
                    ref[key] = (row, version)
            else:
                ref[key] = (row, version)
                used[key] = clock
        store.upsert(ids, values, versions)
        held = set(store.items()[0].tolist())
        victims = set(ref) - held
        assert held <= set(ref)
        assert victims <= before  # only rows held before the call are evicted
        assert len(held) == min(len(ref), max_rows)
        survivors = before - victims
        if victims and survivors:
            assert max(used[k] for k in victims) <= min(used[k] for k in survivors)
        evicted += len(victims)
        for key in victims:
            del ref[key], used[key]
        assert store.evictions == evicted
        check_against(store, ref, gather=False)  # items() is not a use
    assert evicted > 0


def test_memory_bound_unbounded_dim16() -> None:
    dim = 16
    store = RowStore(dim)
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(100_000, dtype=np.int64) * 7919 - 10**12)
    bound = 1.5 * (8 + dim * 4)
    for start in range(0, len(ids), 1000):
        batch = ids[start:start + 1000]
        store.upsert(batch, np.ones((len(batch), dim), dtype=np.float32), vers(len(batch), 1))
        assert store.nbytes / store.rows <= bound, (store.rows, store.nbytes / store.rows)
    assert store.rows == 100_000


@pytest.mark.parametrize(("call", "message"), [
    (lambda s: s.upsert(np.array([1, 2], dtype=np.int32), np.zeros((2, DIM), np.float32), vers(2, 0)),
     "ids must be int64"),
    (lambda s: s.upsert(np.zeros((2, 1), np.int64), np.zeros((2, DIM), np.float32), vers(2, 0)),
     "ids must be 1-D"),
    (lambda s: s.upsert(ids_of(1, 2), np.zeros((2, DIM), np.float64), vers(2, 0)), "values must be float32"),
    (lambda s: s.upsert(ids_of(1, 2), np.zeros((2, DIM + 1), np.float32), vers(2, 0)), "values must have shape"),
    (lambda s: s.upsert(ids_of(1, 2), np.zeros((2, DIM), np.float32), np.zeros(2, np.int64)),
     "versions must be uint64"),
    (lambda s: s.upsert(ids_of(1, 2), np.zeros((2, DIM), np.float32), vers(3, 0)), "versions must have shape"),
    (lambda s: s.upsert(ids_of(1, 1), np.zeros((2, DIM), np.float32), vers(2, 0)), "unique.*ID 1 repeats"),
    (lambda s: s.gather(ids_of(1, 2), np.zeros((2, DIM), np.float64)), "out must be float32"),
    (lambda s: s.gather(ids_of(1, 2), np.zeros((3, DIM), np.float32)), "out must have shape"),
    (lambda s: s.gather(np.array([1.0]), np.zeros((1, DIM), np.float32)), "ids must be int64"),
    (lambda s: s.remove(np.array([1], dtype=np.uint64)), "ids must be int64"),
])
def test_bad_arguments_raise_value_error(call, message) -> None:
    store = RowStore(DIM)
    store.upsert(ids_of(1), np.zeros((1, DIM), np.float32), vers(1, 0))
    with pytest.raises(ValueError, match=message):
        call(store)
    assert store.rows == 1  # a rejected call changed nothing


def test_gather_into_read_only_out_raises() -> None:
    store = RowStore(DIM)
    out = np.zeros((1, DIM), dtype=np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        store.gather(ids_of(1), out)


@pytest.mark.parametrize(("dim", "max_rows", "message"), [
    (0, 0, "dim must be"), (-1, 0, "dim must be"), (2.0, 0, "dim must be"), (4, -1, "max_rows must be"),
])
def test_bad_construction_raises_value_error(dim, max_rows, message) -> None:
    with pytest.raises(ValueError, match=message):
        RowStore(dim, max_rows=max_rows)


def test_a_store_that_lost_most_of_its_rows_gives_the_memory_back_and_keeps_the_rest() -> None:
    store = RowStore(16)
    ids = np.arange(10_000, dtype=np.int64) * 7 - 30_000
    values = np.random.default_rng(5).standard_normal((ids.size, 16)).astype(np.float32)
    store.upsert(ids, values, np.arange(ids.size, dtype=np.uint64))
    full = store.nbytes
    store.remove(ids[:9_000])
    assert store.rows == 1_000 and store.nbytes < full / 4
    got_ids, got_values, got_versions = store.items()
    assert np.array_equal(got_ids, ids[9_000:]) and np.array_equal(got_values, values[9_000:])
    assert np.array_equal(got_versions, np.arange(9_000, 10_000, dtype=np.uint64))
    out = np.zeros((3, 16), np.float32)
    assert store.gather(ids[[0, 9_500, 9_999]], out).tolist() == [False, True, True]
    assert np.array_equal(out[1:], values[[9_500, 9_999]])
    store.upsert(ids[:5], values[:5], np.zeros(5, np.uint64))  # inserts after the compaction land
    assert store.rows == 1_005
