"""The replica's own figures: the served AUC equals scikit-learn's ROC AUC (ties, one class, none), the
served calibration (mean predicted against observed rate), labels without a value are skipped, and the
latency window's p99 forgets what it reported."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from serving.report import LatencyWindow, ServedScores, served_auc, served_calibration


@pytest.mark.parametrize("n", [2, 7, 1000, 20_000])
def test_the_served_auc_is_scikit_learn_s_roc_auc_ties_included(n: int) -> None:
    rng = np.random.default_rng(n)
    labels = rng.integers(0, 2, n)
    labels[:2] = [0, 1]
    logits = np.round(rng.standard_normal(n) + 0.7 * labels, 1)  # rounded: many ties
    assert served_auc(labels, logits) == pytest.approx(roc_auc_score(labels, logits), abs=1e-12)


def test_one_class_or_none_has_no_auc() -> None:
    assert served_auc(np.zeros(0, np.int64), np.zeros(0)) is None
    assert served_auc(np.ones(5, np.int64), np.arange(5.0)) is None
    assert served_auc(np.zeros(5, np.int64), np.arange(5.0)) is None


def test_records_without_a_label_are_skipped() -> None:
    scores = ServedScores()
    scores.observe(np.array([1.0, np.nan, 0.0]), np.array([2.0, 9.0, -1.0], np.float32))
    labels, logits = scores.arrays()
    assert labels.tolist() == [1, 0] and logits.tolist() == [2.0, -1.0] and scores.seen == 2
    assert served_auc(labels, logits) == 1.0


def test_the_latency_window_reports_its_p99_once() -> None:
    window = LatencyWindow()
    assert window.take_p99_ms() is None
    for s in np.linspace(0.001, 0.1, 100):
        window.observe(float(s))
    assert window.take_p99_ms() == pytest.approx(np.percentile(np.linspace(1, 100, 100), 99), rel=1e-9)
    assert window.take_p99_ms() is None


def test_the_served_calibration_is_the_mean_probability_against_the_positive_rate() -> None:
    assert served_calibration(np.zeros(0, np.int64), np.zeros(0)) == (None, None)
    labels = np.array([1, 0, 0, 1, 0])
    logits = np.array([0.0, -2.0, 800.0, -800.0, 1.5])  # extreme logits: no overflow, no warning
    predicted, observed = served_calibration(labels, logits)
    want = np.mean([0.5, 1 / (1 + np.exp(2.0)), 1.0, 0.0, 1 / (1 + np.exp(-1.5))])
    assert predicted == pytest.approx(want, abs=1e-12) and observed == 0.4


def test_the_replica_reports_the_calibration_of_the_labelled_records_it_answered() -> None:
    import asyncio

    from serving.replica import Replica
    from serving.settings import ServeSettings
    from trainers.models import build_model

    model = "dlrm?features=2&dense=3&dim=4"
    replica = Replica(ServeSettings(model=model, job_token="t"), spec=build_model(model))
    assert asyncio.run(replica.served_calibration()) == {"served_mean_predicted": None,
                                                          "served_observed_rate": None}
    replica.observe_labels(np.array([1.0, np.nan, 0.0, 0.0]), {"logit": np.array([2.0, 5.0, -1.0, 0.0], np.float32)})
    got = asyncio.run(replica.served_calibration())
    want = np.mean([1 / (1 + np.exp(-2.0)), 1 / (1 + np.exp(1.0)), 0.5])
    assert got["served_mean_predicted"] == pytest.approx(want, abs=1e-7)
    assert got["served_observed_rate"] == pytest.approx(1 / 3)
    assert "served_mean_predicted" not in replica.report()  # the coordinator's report keeps its schema
