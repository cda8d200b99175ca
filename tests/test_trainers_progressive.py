"""Progressive validation as pure functions: the trainer's windows (``trainers/progressive.py``), what a
heartbeat carries of them (``trainers/progress.py``, ``coordinator/validation.py``) and the
coordinator's series (``coordinator/progressive.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from coordinator.progressive import ProgressiveHistory, mean_auc, pooled
from coordinator.validation import HEARTBEAT, InvalidBody, validate
from datastream.jagged import Jagged
from trainers.device import plan_device
from trainers.models import build_model
from trainers.progress import MAX_PROGRESSIVE_WINDOWS, Progress
from trainers.progressive import ClosedWindow, ProgressiveWindow, WindowScore, score_window
from trainers.step import Replica
from trainers.tables import plan_lookups


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def test_a_window_scores_auc_and_log_loss_as_scikit_learn_does() -> None:
    logits = np.array([2.0, -1.0, 0.5, -3.0, 1.0, -0.2])
    labels = np.array([1, 0, 0, 0, 1, 1])
    w = score_window(ClosedWindow(6, logits, labels))
    # of the nine positive-negative pairs one is ranked wrong: the negative at 0.5 above the positive at -0.2
    assert w.auc == pytest.approx(roc_auc_score(labels, logits))
    assert w.auc == pytest.approx(8 / 9)
    assert w.log_loss == pytest.approx(log_loss(labels, _sigmoid(logits)))
    assert (w.records, w.n) == (6, 6)


def test_a_perfect_ranking_scores_1_and_a_reversed_one_0() -> None:
    labels = np.array([0, 0, 1, 1])
    assert score_window(ClosedWindow(4, np.array([-2.0, -1.0, 1.0, 2.0]), labels)).auc == 1.0
    assert score_window(ClosedWindow(4, np.array([2.0, 1.0, -1.0, -2.0]), labels)).auc == 0.0


@pytest.mark.parametrize("label", [0, 1])
def test_a_window_of_one_class_has_no_auc_but_a_log_loss(label: int) -> None:
    w = score_window(ClosedWindow(3, np.array([0.3, -0.4, 1.2]), np.full(3, label)))
    assert w.auc is None
    p = _sigmoid(np.array([0.3, -0.4, 1.2]))
    expected = -np.mean(np.log(p if label else 1 - p))
    assert w.log_loss == pytest.approx(expected)
    assert w.as_json()["auc"] is None


def test_extreme_logits_give_a_finite_log_loss() -> None:
    w = score_window(ClosedWindow(2, np.array([1e4, -1e4]), np.array([0, 1])))
    assert w.auc == 0.0 and math.isfinite(w.log_loss) and w.log_loss > 10


def test_an_empty_or_mismatched_window_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        score_window(ClosedWindow(0, np.array([]), np.array([])))
    with pytest.raises(ValueError, match="as many labels"):
        score_window(ClosedWindow(2, np.array([1.0, 2.0]), np.array([1])))
    with pytest.raises(ValueError, match="at least 1 record"):
        ProgressiveWindow(0)
    with pytest.raises(ValueError, match="3 logits for 2 labels"):
        ProgressiveWindow(4).add(np.zeros(3), np.zeros(2))


def test_windows_span_batches_and_split_a_batch_at_their_boundary() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=23)
    labels = (rng.random(23) < 0.5).astype(np.int64)
    labels[:2] = [0, 1]  # every window of 5 below holds both classes where it can
    window = ProgressiveWindow(5)
    closed: list[WindowScore] = []
    for start, stop in ((0, 3), (3, 4), (4, 16), (16, 23)):  # 3 + 1 + 12 (two boundaries inside) + 7
        closed += map(score_window, window.add(logits[start:stop], labels[start:stop]))
    assert [w.records for w in closed] == [5, 10, 15, 20]
    assert all(w.n == 5 for w in closed)
    assert window.records == 23 and window.open == 3
    for i, w in enumerate(closed):
        x, y = logits[5 * i:5 * i + 5], labels[5 * i:5 * i + 5]
        assert w.log_loss == pytest.approx(log_loss(y, _sigmoid(x), labels=[0, 1]))
        assert w.auc == (pytest.approx(roc_auc_score(y, x)) if len(set(y)) == 2 else None)


def test_a_batch_that_closes_no_window_returns_none() -> None:
    window = ProgressiveWindow(100)
    assert window.add(np.zeros(40), np.ones(40)) == []
    assert window.add(np.zeros(59), np.ones(59)) == []
    [closed] = window.add(np.zeros(1), np.zeros(1))
    assert closed.records == 100 and closed.labels.tolist() == [1] * 99 + [0]
    w = score_window(closed)
    assert (w.records, w.n) == (100, 100) and w.auc == 0.5  # all ties: chance


def test_a_binary_replica_returns_the_logits_it_trained_on_before_any_update() -> None:
    spec = build_model("dlrm?features=2&dense=3&dim=4", seed=1)
    replica = Replica(spec, plan_device("cpu", 1, False), keep_logits=True)
    assert replica.keep_logits
    dense = Replica(build_model("digits-mlp", seed=1), plan_device("cpu", 1, False), keep_logits=True)
    assert not dense.keep_logits  # not a binary model: nothing to score
    x = torch.randn(6, 3)
    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    ids = {f"c{i}": Jagged.from_lists([[r + 10 * i] for r in range(6)]) for i in (1, 2)}
    lookups = plan_lookups({t.name: t for t in spec.tables}, ids, 6)
    rows = {name: np.full((len(lk.ids), lk.spec.dim), 0.1, np.float32) for name, lk in lookups.items()}
    before = {n: t.clone() for n, t in replica.tensors.items()}
    result = replica.step(x, y, lookups, rows)
    assert result.logits is not None and result.logits.shape == (6,) and result.logits.dtype == np.float32
    with torch.no_grad():  # the logits are the model's on the parameters as they were: the step changed none
        assert all(torch.equal(before[n], t) for n, t in replica.tensors.items())


def test_the_heartbeat_carries_the_windows_closed_since_the_last_one() -> None:
    progress = Progress(started=0.0)
    stats = progress.heartbeat_stats(1.0, clock=0, staleness=0, accuracy=None, lag={})
    assert "progressive" not in stats and "progressive_auc" not in stats
    progress.scored([WindowScore(100, 100, 0.61, 0.69), WindowScore(200, 100, None, 0.5)])
    stats = progress.heartbeat_stats(2.0, clock=1, staleness=0, accuracy=None, lag={})
    assert stats["progressive"] == [{"records": 100, "n": 100, "auc": 0.61, "log_loss": 0.69},
                                    {"records": 200, "n": 100, "auc": None, "log_loss": 0.5}]
    assert "progressive_auc" not in stats  # the newest window has no AUC
    assert progress.last_window == WindowScore(200, 100, None, 0.5)
    assert validate({"stats": stats}, HEARTBEAT)["stats"]["progressive"] == stats["progressive"]
    stats = progress.heartbeat_stats(3.0, clock=1, staleness=0, accuracy=None, lag={})
    assert "progressive" not in stats  # sent once
    progress.scored([WindowScore(100 * i, 100, 0.7, 0.6) for i in range(3, 3 + MAX_PROGRESSIVE_WINDOWS + 5)])
    stats = progress.heartbeat_stats(4.0, clock=1, staleness=0, accuracy=None, lag={})
    windows = stats["progressive"]
    assert isinstance(windows, list) and len(windows) == MAX_PROGRESSIVE_WINDOWS
    assert windows[-1]["records"] == 100 * (2 + MAX_PROGRESSIVE_WINDOWS + 5)  # the newest kept
    assert stats["progressive_auc"] == 0.7


@pytest.mark.parametrize(("window", "problem"), [
    ({"records": 10, "n": 10, "auc": 1.5, "log_loss": 0.3}, "auc: must be <= 1"),
    ({"records": 10, "n": 0, "auc": 0.5, "log_loss": 0.3}, "n: must be >= 1"),
    ({"records": 10, "n": 10, "log_loss": 0.3}, "auc: required field is missing"),
    ({"records": 10, "n": 10, "auc": 0.5, "log_loss": 0.3, "x": 1}, "unknown field"),
])
def test_a_heartbeat_with_a_bad_window_is_refused_naming_it(window: dict, problem: str) -> None:
    with pytest.raises(InvalidBody, match=r"stats\.progressive\[0\]") as err:
        validate({"stats": {"progressive": [window]}}, HEARTBEAT)
    assert problem in str(err.value)
    with pytest.raises(InvalidBody, match="expected a list of objects"):
        validate({"stats": {"progressive": {"records": 1}}}, HEARTBEAT)


def test_a_point_pools_windows_weighted_by_their_records() -> None:
    p = pooled(5, 700, [{"records": 300, "n": 300, "auc": 0.6, "log_loss": 0.7},
                        {"records": 400, "n": 100, "auc": None, "log_loss": 0.3},
                        {"records": 700, "n": 300, "auc": 0.8, "log_loss": 0.5}])
    assert (p.t_ms, p.records, p.n) == (5, 700, 700)
    assert p.auc == pytest.approx(0.7)  # the one-class window weighs nothing in the AUC
    assert p.log_loss == pytest.approx((300 * 0.7 + 100 * 0.3 + 300 * 0.5) / 700)
    assert pooled(1, 10, [{"records": 10, "n": 10, "auc": None, "log_loss": 0.1}]).auc is None
    with pytest.raises(ValueError, match="at least one window"):
        pooled(1, 0, [])


def _w(records: int, n: int, auc: float | None, loss: float = 0.5) -> dict:
    return {"records": records, "n": n, "auc": auc, "log_loss": loss}


def test_the_history_keeps_a_series_per_trainer_and_one_pooled_for_the_job() -> None:
    h = ProgressiveHistory(capacity=3)
    assert h.pool(1000) is None  # nothing observed: no point
    h.observe("a", [_w(100, 100, 0.6), _w(200, 100, 0.7)])
    h.observe("b", [_w(300, 300, 0.5)])
    job = h.pool(2000)
    assert job is not None and (job.records, job.n) == (500, 500)
    assert job.auc == pytest.approx((100 * 0.6 + 100 * 0.7 + 300 * 0.5) / 500)
    h.observe("a", [_w(300, 100, 0.9)])
    h.pool(3000)
    cols = h.columns()
    assert cols["job"]["t_ms"] == [2000, 3000] and cols["job"]["records"] == [500, 600]
    assert cols["members"]["a"] == {"t_ms": [2000, 3000], "records": [200, 300], "n": [200, 100],
                                    "auc": [pytest.approx(0.65), 0.9], "log_loss": [0.5, 0.5]}
    assert cols["members"]["b"]["records"] == [300]
    later = h.columns(since_ms=2000)
    assert later["job"]["t_ms"] == [3000] and list(later["members"]) == ["a"]
    for t in (4000, 5000):  # capacity 3: the oldest point goes
        h.observe("a", [_w(t // 10, 100, 0.9)])
        h.pool(t)
    assert h.columns()["job"]["t_ms"] == [3000, 4000, 5000]
    assert h.columns()["members"]["a"]["t_ms"] == [3000, 4000, 5000]
    with pytest.raises(ValueError, match="capacity"):
        ProgressiveHistory(0)


def test_the_history_keeps_a_bounded_number_of_trainers_dropping_the_longest_silent() -> None:
    from coordinator.progressive import MAX_MEMBERS

    h = ProgressiveHistory(capacity=10)
    for i in range(MAX_MEMBERS + 3):
        h.observe(f"m{i}", [_w(10, 10, 0.5)])
        h.observe("steady", [_w(10 * (i + 1), 10, 0.5)])
        h.pool(1000 + i)
    kept = h.columns()["members"]
    assert len(kept) == MAX_MEMBERS and "steady" in kept
    assert "m0" not in kept and f"m{MAX_MEMBERS + 2}" in kept
    assert h.records == 20 * (MAX_MEMBERS + 3)  # the job's count keeps every window, dropped trainers' too


def test_mean_auc_over_the_first_and_last_tenth_of_the_records() -> None:
    # points stand for the records (records - n, records]: 0-100, 100-200, 200-500, 500-900, 900-1000
    series = {"records": [100, 200, 500, 900, 1000], "n": [100, 100, 300, 400, 100],
              "auc": [0.5, 0.55, None, 0.8, 0.9]}
    assert mean_auc(series, 0.0, 0.1) == pytest.approx(0.5)
    assert mean_auc(series, 0.0, 0.2) == pytest.approx(0.525)
    assert mean_auc(series, 0.9, 1.0) == pytest.approx(0.9)
    assert mean_auc(series, 0.8, 1.0) == pytest.approx((100 * 0.8 + 100 * 0.9) / 200)  # by the overlap
    assert mean_auc(series, 0.3, 0.5) is None  # the one point there has no AUC
    coarse = {"records": [4000, 16000], "n": [4000, 12000], "auc": [0.6, 0.75]}  # a fast run's first second
    assert mean_auc(coarse, 0.0, 0.1) == pytest.approx(0.6)
    assert mean_auc(coarse, 0.2, 0.3) == pytest.approx(0.675)  # 800 records of each point
    assert mean_auc({"records": [], "n": [], "auc": []}, 0.0, 0.1) is None
    with pytest.raises(ValueError, match="span"):
        mean_auc(series, 0.5, 0.5)


def test_up_shows_the_trainers_progressive_auc_and_sums_up_the_run() -> None:
    from rich.console import Console

    from streamtrain.up import Task, _view, progressive_summary

    status = {"job": "clicks", "versions": {"max": 9}, "generation": 2, "lag": 0, "loss": 0.6,
              "members": [{"member_id": "a", "state": "active", "partitions": [0], "stats": {"progressive_auc": 0.7}},
                          {"member_id": "b", "state": "active", "partitions": [1], "stats": {"progressive_auc": 0.8}}]}
    console = Console(width=200, record=True)
    console.print(_view(status, {"auc": 0.71, "loss": 0.6, "accuracy": 0.7}, 10.0, Task(True, binary=True), None))
    text = console.export_text()
    assert "progressive AUC" in text and "0.75" in text and "0.7" in text and "0.8" in text
    dense = {**status, "members": [{"member_id": "a", "state": "active", "partitions": [0], "stats": {}}]}
    console = Console(width=200, record=True)
    console.print(_view(dense, {}, 10.0, Task(True), None))
    assert "progressive" not in console.export_text()  # not a binary model: no column

    series = {"job": {"records": [100, 500, 1000], "n": [100, 400, 500], "auc": [0.55, 0.6, 0.8]}}
    assert progressive_summary(series) == ("0.55 over the first tenth → 0.8 over the last tenth of "
                                           "1,000 records scored before training on them")
    assert progressive_summary(None) is None
    assert progressive_summary({"job": {"records": [], "n": [], "auc": []}, "members": {}}) is None
