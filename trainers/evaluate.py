"""Scoring a model on held-out data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .models import LossFn


@dataclass(frozen=True)
class EvalResult:
    """Loss and the task's metrics of one model version on held-out data.

    Classification has an accuracy; regression has the mean absolute error and
    the coefficient of determination R² (1 - residual sum of squares / total
    sum of squares around the targets' mean) instead.
    """

    version: int
    """Parameter version that was scored."""
    loss: float
    """Mean loss over the held-out set; for a binary model, the log loss of scikit-learn's
    ``log_loss`` (see :attr:`auc`)."""
    accuracy: float | None
    """Fraction of correct predictions (None for regression)."""
    samples: int
    """Number of held-out samples."""
    mae: float | None = None
    """Regression: mean absolute error of the predictions (None for classification)."""
    r2: float | None = None
    """Regression: R², 1.0 for perfect predictions, 0.0 for predicting the mean, negative for worse
    (None for classification, and when every target is the same, where R² is undefined)."""
    auc: float | None = None
    """Binary classification: the area under the ROC curve of the logits (scikit-learn's
    ``roc_auc_score``; None otherwise, and when the held-out labels are all one class). The loss is
    then the log loss, also scikit-learn's: ``log_loss`` of the sigmoid of the logits, clipped as it
    clips probabilities — the mean of the model's own loss (``binary_cross_entropy_with_logits``) up to
    that clipping and float rounding (``tests/test_streamtrain_scoring.py`` checks they agree)."""
    mean_predicted: float | None = None
    """Binary classification: the mean predicted probability (sigmoid of the logits); a calibrated
    model's equals :attr:`observed_rate` up to noise. None otherwise."""
    observed_rate: float | None = None
    """Binary classification: the fraction of positive held-out labels (the mean label). None otherwise."""

    @property
    def classification(self) -> bool:
        """True when this scores a classifier (it has an accuracy)."""
        return self.accuracy is not None


@torch.no_grad()
def evaluate(model: torch.nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
             version: int, classification: bool, binary: bool = False, batch_size: int = 1024,
             inputs: Callable[[int, int], tuple[Any, ...]] | None = None) -> EvalResult:
    """Score ``model`` on ``(x, y)`` in batches; the model's mode is restored afterwards.

    Classification counts correct predictions (argmax of the logits; with
    ``binary``, one logit per row, a positive logit predicts 1, and the AUC and the
    log loss of the logits come from scikit-learn); regression
    sums absolute and squared errors (in float64) for :attr:`EvalResult.mae` and
    :attr:`EvalResult.r2`, comparing an output of one value per row (``[n]`` or
    ``[n, 1]``) with the targets; any other output (a loss that is neither
    cross-entropy nor one value per target) gets the loss alone. ``inputs(start,
    stop)``: more forward arguments of rows ``start:stop`` (a model with
    embedding tables takes the pooled rows of their IDs).

    Raises:
        ValueError: empty data, or a label count that differs from the rows.
    """
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"held-out data must be non-empty with as many labels as rows, got {len(x)} and {len(y)}")
    was_training = model.training
    model.eval()
    total_loss, correct, abs_err, sq_err = 0.0, 0, 0.0, 0.0
    logits: list[torch.Tensor] = []
    per_target = not classification  # regression metrics while every output is one value per target
    try:
        for start in range(0, len(x), batch_size):
            stop = min(start + batch_size, len(x))
            xb, yb = x[start:stop], y[start:stop]
            out = model(xb, *inputs(start, stop)) if inputs is not None else model(xb)
            if binary:  # the loss below, from all the logits at once
                out = out.reshape(-1).float()
                correct += int(((out > 0).long() == yb.reshape(-1).long()).sum())
                logits.append(out.cpu())
                continue
            total_loss += float(loss_fn(out, yb)) * len(xb)
            if classification:
                correct += int((out.argmax(dim=1) == yb).sum())
                continue
            per_target = per_target and out.numel() == yb.numel()
            if not per_target:
                continue
            err = out.reshape(yb.shape).double() - yb.double()
            abs_err += float(err.abs().sum())
            sq_err += float((err * err).sum())
    finally:
        model.train(was_training)
    n = len(x)
    if binary:
        from sklearn.metrics import log_loss, roc_auc_score  # scikit-learn loads in ~1 s: only when scoring one

        labels = y.reshape(-1).long().cpu().numpy()
        scores = torch.cat(logits).double().numpy()
        auc = float(roc_auc_score(labels, scores)) if len(set(labels.tolist())) == 2 else None
        p = 1.0 / (1.0 + np.exp(-scores))
        logloss = float(log_loss(labels, p, labels=[0, 1]))
        return EvalResult(version, logloss, correct / n, n, auc=auc, mean_predicted=float(p.mean()),
                          observed_rate=float(labels.mean()))
    if classification:
        return EvalResult(version, total_loss / n, correct / n, n)
    if not per_target:
        return EvalResult(version, total_loss / n, None, n)
    total = float(((y.double() - y.double().mean()) ** 2).sum())
    return EvalResult(version, total_loss / n, None, n, mae=abs_err / y.numel(),
                      r2=1.0 - sq_err / total if total > 0 else None)
