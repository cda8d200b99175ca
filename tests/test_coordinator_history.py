"""The coordinator's history as a pure thing: samples from stats, a bounded ring, columns; and the
pure parts of its embedding tables' view (names from the meta, sums over groups, rates)."""

from __future__ import annotations

import json

import pytest

from coordinator.history import (
    JOB_SERIES,
    MEMBER_SERIES,
    TABLE_SERIES,
    History,
    MemberSample,
    Sample,
    quantile,
    take_sample,
)
from coordinator.tables import TableTotals, mean_hit_rate, table_names, table_totals, tables_view


def sample(t_ms: int, **members: float) -> Sample:
    """A sample at ``t_ms`` whose members report the given losses."""
    return Sample(t_ms=t_ms, loss=sum(members.values()) / len(members) if members else None,
                  members={m: MemberSample(loss=v) for m, v in members.items()})


def test_quantile_interpolates_between_ranks_like_numpy() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([float(i) for i in range(101)], 0.99) == pytest.approx(99.0)
    assert quantile([0.0, 10.0], 0.99) == pytest.approx(9.9)
    with pytest.raises(ValueError, match=r"1\.5"):
        quantile([1.0], 1.5)


def test_take_sample_aggregates_members_and_keeps_missing_values_null() -> None:
    stats = {"a": {"loss": 0.5, "accuracy": 0.75, "auc": 0.7, "log_loss": 0.6, "records_per_s": 100.0,
                   "staleness": 9},
             "b": {"loss": 0.25, "records_per_s": 50.0},
             "c": {}}  # registered, no step yet
    s = take_sample(10_000, stats, lag=42, staleness={"a": 1, "b": 3, "gone": 100}, version=7,
                    freshness_s=[0.1, 0.2, 0.3, 0.4, 5.0], previous=None)
    assert s.loss == pytest.approx(0.375)
    assert s.accuracy == 0.75  # the mean of those that report one, not a zero for b and c
    assert (s.auc, s.log_loss) == (0.7, 0.6)
    assert s.records_per_s == 150.0
    assert s.lag == 42
    assert (s.staleness_max, s.staleness_mean) == (3.0, 2.0)  # a departed member's entry is ignored
    assert s.freshness_p50_s == pytest.approx(0.3)
    assert s.freshness_p99_s == pytest.approx(0.4 + 4.6 * 0.96)
    assert s.version == 7 and s.versions_per_s is None  # no previous sample: no rate
    assert s.members["c"] == MemberSample(None, None, None)
    assert s.members["a"] == MemberSample(loss=0.5, accuracy=0.75, auc=0.7, log_loss=0.6, records_per_s=100.0)


def test_take_sample_with_nothing_reported_is_all_null_not_zero() -> None:
    s = take_sample(1, {"a": {"clock": 3}}, lag=None, staleness={}, version=None, freshness_s=[],
                    previous=None)
    assert [getattr(s, name) for name in JOB_SERIES] == [None] * len(JOB_SERIES)


def test_staleness_falls_back_to_reported_stats_without_the_hash() -> None:
    stats = {"a": {"staleness": 2}, "b": {"staleness": 4}, "c": {"loss": 1.0}}
    s = take_sample(1, stats, lag=None, staleness={}, version=None, freshness_s=[], previous=None)
    assert (s.staleness_max, s.staleness_mean) == (4.0, 3.0)


def test_versions_per_second_from_the_previous_sample() -> None:
    first = take_sample(1_000, {}, lag=None, staleness={}, version=100, freshness_s=[], previous=None)
    second = take_sample(3_000, {}, lag=None, staleness={}, version=160, freshness_s=[], previous=first)
    assert second.versions_per_s == 30.0
    reset = take_sample(4_000, {}, lag=None, staleness={}, version=5, freshness_s=[], previous=second)
    assert reset.versions_per_s is None  # versions went back (a fresh job): no negative rate
    gone = take_sample(5_000, {}, lag=None, staleness={}, version=None, freshness_s=[], previous=reset)
    assert gone.versions_per_s is None


def test_non_finite_or_non_numeric_stats_are_null() -> None:
    s = take_sample(1, {"a": {"loss": float("nan"), "records_per_s": True, "accuracy": "high"}},
                    lag=None, staleness={}, version=None, freshness_s=[], previous=None)
    assert s.members["a"] == MemberSample(None, None, None) and s.loss is None


def test_history_is_bounded_and_drops_the_oldest() -> None:
    h = History(3)
    assert h.capacity == 3 and len(h) == 0 and h.last is None
    for t in range(1, 6):
        h.add(sample(t * 1000, a=float(t)))
    assert len(h) == 3 and h.last is not None and h.last.t_ms == 5000
    assert h.columns()["t_ms"] == [3000, 4000, 5000]
    with pytest.raises(ValueError, match="capacity"):
        History(0)


def test_history_refuses_a_sample_not_newer_than_the_last() -> None:
    h = History(10)
    h.add(sample(2000))
    with pytest.raises(ValueError, match="not newer"):
        h.add(sample(2000))
    with pytest.raises(ValueError, match="not newer"):
        h.add(sample(1000))
    assert len(h) == 1


def test_columns_align_members_that_come_and_go() -> None:
    h = History(100)
    h.add(sample(1000, a=1.0))
    h.add(sample(2000, a=0.5, b=0.75))
    h.add(sample(3000, b=0.25))
    cols = h.columns()
    assert cols["t_ms"] == [1000, 2000, 3000]
    assert cols["capacity"] == 100 and cols["interval_s"] == 1.0
    assert set(cols["job"]) == set(JOB_SERIES)
    assert cols["job"]["loss"] == [1.0, 0.625, 0.25]
    assert cols["members"]["a"]["loss"] == [1.0, 0.5, None]
    assert cols["members"]["b"]["loss"] == [None, 0.75, 0.25]
    assert set(cols["members"]["a"]) == set(MEMBER_SERIES)
    for columns in [cols["job"], *cols["members"].values()]:
        assert all(len(c) == 3 for c in columns.values())
    json.dumps(cols, allow_nan=False)  # what /v1/history answers is strict JSON


def test_columns_since_answer_only_newer_samples() -> None:
    h = History(100)
    for t in (1000, 2000, 3000):
        h.add(sample(t, a=1.0 if t < 3000 else 2.0))
    newer = h.columns(since_ms=2000)
    assert newer["t_ms"] == [3000] and newer["members"]["a"]["loss"] == [2.0]
    none = h.columns(since_ms=3000)
    assert none["t_ms"] == [] and none["members"] == {} and none["job"]["loss"] == []


# -- embedding tables --------------------------------------------------------------------------------------

def test_table_names_come_from_the_meta_json_in_declaration_order() -> None:
    meta = {"groups": 2, "layout": {}, "optimizer": {},
            "tables": [{"name": "user", "dim": 4}, {"name": "item", "dim": 2}]}
    assert table_names(json.dumps(meta).encode()) == ("user", "item")
    assert table_names(json.dumps({"groups": 1, "layout": {}}).encode()) == ()  # a dense model
    assert table_names(None) == ()  # no model yet
    assert table_names(b"not json") == () and table_names(b"[1, 2]") == ()


def test_table_totals_sum_each_table_over_the_groups() -> None:
    names = ["user", "item"]
    replies = [  # per group: HGETALL table_stats, then HLEN and MEMORY USAGE of each table's rows
        {b"user:admitted": b"10", b"user:dropped": b"3", b"user:steps": b"99", b"item:evicted": b"2"},
        7, 1000, 0, None,  # group 0 holds no item row: MEMORY USAGE of a missing key is None
        {b"user:admitted": b"5", b"user:expired": b"1", b"item:admitted": b"4", b"item:evicted": b"1"},
        3, 500, 4, 300,
    ]
    totals = table_totals(replies, 2, names)
    assert list(totals) == names
    assert totals["user"] == TableTotals(rows=10, bytes=1500, admitted=15, dropped=3, expired=1, evicted=0)
    assert totals["item"] == TableTotals(rows=4, bytes=300, admitted=4, dropped=0, expired=0, evicted=3)
    assert table_totals([{}, 0, None], 1, ["t"]) == {"t": TableTotals()}
    with pytest.raises(ValueError, match="expected 5 replies"):
        table_totals(replies, 1, names)


def test_hit_rate_is_the_mean_of_the_members_that_report_one() -> None:
    assert mean_hit_rate({"a": {"row_cache_hit_rate": 0.5}, "b": {"row_cache_hit_rate": 1.0}, "c": {}}) == 0.75
    assert mean_hit_rate({"a": {"loss": 1.0}}) is None
    assert mean_hit_rate({"a": {"row_cache_hit_rate": True}, "b": {"row_cache_hit_rate": float("nan")}}) is None
    view = tables_view({"user": TableTotals(rows=2, bytes=64, admitted=2)}, {"a": {"row_cache_hit_rate": 0.25}})
    assert view == {"row_cache_hit_rate": 0.25, "per_table": [
        {"name": "user", "rows": 2, "bytes": 64, "admitted": 2, "dropped": 0, "expired": 0, "evicted": 0}]}
    assert tables_view({}, {}) == {"row_cache_hit_rate": None, "per_table": []}


def _tables(t_ms: int, previous: Sample | None, **totals: TableTotals) -> Sample:
    return take_sample(t_ms, {}, lag=None, staleness={}, version=1, freshness_s=[], previous=previous,
                       tables=totals)


def test_table_counters_become_rates_per_second_per_table_and_summed() -> None:
    first = _tables(1_000, None, user=TableTotals(rows=10, bytes=100, admitted=10, dropped=4),
                    item=TableTotals(rows=1, bytes=10, admitted=1))
    assert (first.table_rows, first.table_bytes) == (11, 110)
    assert first.tables["user"].admitted_per_s is None and first.table_admitted_per_s is None  # no previous
    second = _tables(3_000, first, user=TableTotals(rows=14, bytes=140, admitted=20, dropped=10, expired=6),
                     item=TableTotals(rows=1, bytes=10, admitted=5, evicted=4))
    user, item = second.tables["user"], second.tables["item"]
    assert (user.rows, user.bytes) == (14, 140)
    assert (user.admitted_per_s, user.dropped_per_s, user.expired_per_s, user.evicted_per_s) == (5.0, 3.0, 3.0, 0.0)
    assert (item.admitted_per_s, item.evicted_per_s) == (2.0, 2.0)
    assert (second.table_admitted_per_s, second.table_dropped_per_s, second.table_expired_per_s,
            second.table_evicted_per_s) == (7.0, 3.0, 3.0, 2.0)
    # a counter that went back (a checkpoint restored) gives no rate, not a negative one
    third = _tables(4_000, second, user=TableTotals(rows=14, admitted=2, dropped=11, expired=6),
                    item=TableTotals(rows=1, admitted=6, evicted=4))
    assert third.tables["user"].admitted_per_s is None and third.tables["user"].dropped_per_s == 1.0
    assert third.table_admitted_per_s == 1.0  # the item table's alone
    # a table first seen has no rate yet; the others keep theirs
    fourth = _tables(5_000, third, user=TableTotals(rows=14, admitted=3, dropped=11, expired=6),
                     extra=TableTotals(rows=9, admitted=9))
    assert fourth.tables["extra"].admitted_per_s is None and fourth.table_admitted_per_s == 1.0


def test_a_dense_model_has_no_table_series_and_the_hit_rate_is_the_members_mean() -> None:
    s = take_sample(1, {"a": {"row_cache_hit_rate": 0.5}, "b": {"row_cache_hit_rate": 0.75}}, lag=None,
                    staleness={}, version=1, freshness_s=[], previous=None)
    assert s.tables == {} and s.table_rows is None and s.table_admitted_per_s is None
    assert s.row_cache_hit_rate == 0.625


def test_columns_of_tables_align_with_the_time_axis() -> None:
    h = History(100)
    h.add(_tables(1_000, None))  # before the model existed: no tables
    h.add(_tables(2_000, h.last, user=TableTotals(rows=1, bytes=8, admitted=1)))
    h.add(_tables(3_000, h.last, user=TableTotals(rows=3, bytes=24, admitted=3, dropped=1)))
    cols = h.columns()
    assert list(cols["tables"]) == ["user"] and set(cols["tables"]["user"]) == set(TABLE_SERIES)
    assert cols["tables"]["user"]["rows"] == [None, 1, 3]
    assert cols["tables"]["user"]["admitted_per_s"] == [None, None, 2.0]
    assert cols["job"]["table_rows"] == [None, 1, 3] and cols["job"]["table_dropped_per_s"] == [None, None, 1.0]
    assert h.columns(since_ms=3_000)["tables"] == {}
    json.dumps(cols, allow_nan=False)
