"""Task-aware scoring: regression metrics of ``trainers.evaluate`` and ``up``'s stop rules. Pure, no servers."""

from __future__ import annotations

import argparse

import pytest
import torch
from rich.console import Console
from sklearn.metrics import mean_absolute_error, r2_score
from torch import nn

from common import settings as cfg
from streamtrain.overload import LagSample, assess
from streamtrain.settings import FOREVER_RATE, UpSettings
from streamtrain.up import Outcome, Task, _calibration_line, _view, cluster_spec, exit_code, reached_target
from trainers import build_model, evaluate


def identity(squeeze: bool) -> nn.Module:
    """A model whose prediction is its single input feature."""
    lin = nn.Linear(1, 1)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.zero_()
    return nn.Sequential(lin, nn.Flatten(0)) if squeeze else lin


def test_regression_metrics_against_hand_computed_values() -> None:
    pred = torch.tensor([[1.5], [2.0], [2.0], [5.0]])
    y = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # errors 0.5, 0, -1, 1: MAE 2.5 / 4; SS_res 2.25; mean 2.5, SS_tot 2.25 + 0.25 + 0.25 + 2.25 = 5
    for squeeze, batch in ((True, 1024), (False, 3)):  # [n] or [n, 1] outputs, one batch or two
        result = evaluate(identity(squeeze), nn.functional.mse_loss if squeeze else
                          (lambda out, t: nn.functional.mse_loss(out[:, 0], t)),
                          pred, y, version=7, classification=False, batch_size=batch)
        assert result.accuracy is None and not result.classification
        assert result.mae == pytest.approx(0.625)
        assert result.r2 == pytest.approx(1 - 2.25 / 5)
        assert result.loss == pytest.approx(2.25 / 4)
        assert (result.samples, result.version) == (4, 7)


def test_regression_metrics_match_scikit_learn() -> None:
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(1000, generator=gen) * 3 + 1
    pred = y + torch.randn(1000, generator=gen)
    result = evaluate(identity(True), nn.functional.mse_loss, pred[:, None], y, version=0,
                      classification=False, batch_size=128)
    assert result.mae == pytest.approx(mean_absolute_error(y.numpy(), pred.numpy()), rel=1e-5)
    assert result.r2 == pytest.approx(r2_score(y.numpy(), pred.numpy()), rel=1e-5)


def test_r2_of_perfect_mean_and_constant_targets() -> None:
    y = torch.tensor([1.0, 2.0, 3.0])
    perfect = evaluate(identity(True), nn.functional.mse_loss, y[:, None], y, version=0, classification=False)
    assert perfect.r2 == 1.0 and perfect.mae == 0.0
    mean = evaluate(identity(True), nn.functional.mse_loss, torch.full((3, 1), 2.0), y, version=0,
                    classification=False)
    assert mean.r2 == pytest.approx(0.0)
    constant = evaluate(identity(True), nn.functional.mse_loss, y[:, None], torch.full((3,), 5.0), version=0,
                        classification=False)
    assert constant.r2 is None and constant.mae == pytest.approx(3.0)  # R² undefined, MAE still there


def test_an_output_that_is_not_one_value_per_target_gets_the_loss_alone() -> None:
    # e.g. a classifier trained with a loss other than cross-entropy: no made-up MAE or R²
    result = evaluate(nn.Linear(2, 3), lambda out, t: out.sum() * 0 + 1.5, torch.ones(2, 2), torch.ones(2),
                      version=0, classification=False)
    assert result.loss == 1.5 and result.mae is None and result.r2 is None and result.accuracy is None


def test_classification_has_accuracy_and_no_regression_metrics() -> None:
    spec = build_model("digits-mlp")
    result = evaluate(spec.model, spec.loss_fn, torch.zeros(5, 64), torch.zeros(5, dtype=torch.long), version=0,
                      classification=True)
    assert result.classification and result.accuracy is not None
    assert result.mae is None and result.r2 is None


CLASSIFIER, REGRESSION, BINARY = Task(classification=True), Task(classification=False), Task(True, binary=True)


def settings(**given: object) -> UpSettings:
    return cfg.from_args(UpSettings, argparse.Namespace(**given), environ={})


def test_targets_follow_the_task() -> None:
    s = settings(target_accuracy=0.9, target_loss=0.5)
    assert reached_target({"accuracy": 0.91, "loss": 2.0}, s, CLASSIFIER)
    assert reached_target({"accuracy": 0.5, "loss": 0.5}, s, CLASSIFIER)  # the loss target too
    assert not reached_target({"accuracy": 0.5, "loss": 0.6}, s, CLASSIFIER)
    assert reached_target({"loss": 0.4, "mae": 0.3}, s, REGRESSION)
    assert not reached_target({"loss": 0.6, "accuracy": 0.99}, s, REGRESSION)  # accuracy: classification only
    assert not reached_target({}, s, CLASSIFIER)
    assert not reached_target({"loss": 0.1}, settings(), REGRESSION)  # no loss target


def test_exit_codes() -> None:
    default, limited = settings(), settings(max_records=7000)
    forever = settings(forever=True)
    assert exit_code(Outcome.TARGET, default, CLASSIFIER) == 0
    # the stream (up to --max-records) consumed, as asked, whatever the score
    assert exit_code(Outcome.CONSUMED, limited, CLASSIFIER) == 0
    assert exit_code(Outcome.CONSUMED, limited, REGRESSION) == 0
    # a bounded stream ended before the target that was the stop condition
    assert exit_code(Outcome.CONSUMED, default, CLASSIFIER) == 1
    assert exit_code(Outcome.CONSUMED, settings(target_loss=0.1), REGRESSION) == 1
    assert exit_code(Outcome.CONSUMED, default, REGRESSION) == 0  # regression without a target
    assert exit_code(Outcome.TIMEOUT, default, CLASSIFIER) == 1
    assert exit_code(Outcome.TIMEOUT, limited, REGRESSION) == 1
    assert exit_code(Outcome.INTERRUPTED, forever, CLASSIFIER) == 0
    assert exit_code(Outcome.INTERRUPTED, default, CLASSIFIER) == 130


def test_forever_streams_at_a_bounded_rate_by_default() -> None:
    def producer(**given: object):
        return cluster_spec(settings(**given), environ={}).producer

    assert producer().rate is None  # a bounded run: as fast as the trainers go
    assert producer(forever=True).rate == FOREVER_RATE
    assert producer(forever=True, rate=250.0).rate == 250.0
    assert producer(forever=True, rate=0.0).rate is None  # 0: unbounded, on request
    assert producer(forever=True).source == "digits?repeat=0"


def render(*parts: object) -> str:
    console = Console(record=True, width=200)
    console.print(*parts)
    return console.export_text()


def test_live_view_shows_the_task_metrics_and_the_keeping_up_line() -> None:
    status = {"job": "j", "throughput_records_per_s": 900.0, "loss": 0.2, "versions": {"max": 12},
              "generation": 3, "lag": 4, "staleness": {"clock_spread": 1},
              "members": [{"member_id": "t1", "state": "active", "partitions": [0, 1],
                           "stats": {"records_per_s": 900.0, "loss": 0.2, "accuracy": 0.5}}]}
    score = {"loss": 0.125, "mae": 0.25, "r2": 0.875}
    behind = assess([LagSample(i, 100 + 40 * i, 100 + 30 * i, 10 * i) for i in range(11)], trainers=1,
                    records_per_message=32)
    regression = render(_view(status, score, 5.0, REGRESSION, behind))
    assert "MAE" in regression and "R²" in regression and "0.875" in regression and "0.25" in regression
    assert "acc" not in regression  # neither the job's held-out accuracy nor the trainers' column
    assert "falling behind: lag +320 records/s; consumption 960/s vs input 1,280/s; add about 1 trainer " \
           "(each does ~960 records/s)" in regression
    classifier = render(_view(status, {"accuracy": 0.9, "loss": 0.3}, 5.0, CLASSIFIER, None))
    assert "held-out acc" in classifier and "90.0%" in classifier and "50.0%" in classifier
    assert "MAE" not in classifier and "keeping up" not in classifier and "falling" not in classifier
    assert "AUC" not in classifier
    binary = render(_view(status, {"auc": 0.71234, "loss": 0.61, "accuracy": 0.66}, 5.0, BINARY, None))
    assert binary.index("held-out AUC") < binary.index("log loss") < binary.index("acc ")  # AUC first
    assert "0.7123" in binary and "0.6100" in binary and "66.0%" in binary and "MAE" not in binary


def test_the_final_score_of_a_binary_model_states_its_calibration() -> None:
    assert _calibration_line(0.38123, 0.375) == "mean predicted 0.3812 against observed 0.3750"
    assert _calibration_line(None, None) == "mean predicted - against observed -"
