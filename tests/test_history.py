"""The coordinator's history as a pure thing: samples from stats, a bounded ring, columns."""

from __future__ import annotations

import json

import pytest

from coordinator.history import JOB_SERIES, MEMBER_SERIES, History, MemberSample, Sample, quantile, take_sample


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
    stats = {"a": {"loss": 0.5, "accuracy": 0.75, "records_per_s": 100.0, "staleness": 9},
             "b": {"loss": 0.25, "records_per_s": 50.0},
             "c": {}}  # registered, no step yet
    s = take_sample(10_000, stats, lag=42, staleness={"a": 1, "b": 3, "gone": 100}, version=7,
                    freshness_s=[0.1, 0.2, 0.3, 0.4, 5.0], previous=None)
    assert s.loss == pytest.approx(0.375)
    assert s.accuracy == 0.75  # the mean of those that report one, not a zero for b and c
    assert s.records_per_s == 150.0
    assert s.lag == 42
    assert (s.staleness_max, s.staleness_mean) == (3.0, 2.0)  # a departed member's entry is ignored
    assert s.freshness_p50_s == pytest.approx(0.3)
    assert s.freshness_p99_s == pytest.approx(0.4 + 4.6 * 0.96)
    assert s.version == 7 and s.versions_per_s is None  # no previous sample: no rate
    assert s.members["c"] == MemberSample(None, None, None)
    assert s.members["a"] == MemberSample(loss=0.5, accuracy=0.75, records_per_s=100.0)


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
