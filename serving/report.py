"""What a replica tells about itself: the served AUC and calibration of labelled requests, and the report it sends the
coordinator every ``--report-every-s`` (``POST /v1/serving/replicas/<name>``), which the status page and
``streamtrain up`` show. See docs/serving.md, *In the topology*.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ServedScores", "LatencyWindow", "served_auc", "served_calibration"]

MOST_LABELLED = 50_000
"""Labelled records the served AUC and calibration are computed over (the newest)."""


@dataclass
class ServedScores:
    """The labels and logits of labelled records the replica answered (``POST /v1/predict`` with ``y``):
    scored before any trainer trained on them when the producer sends them before producing them, so
    their AUC is the model's online quality as served."""

    logits: deque[float] = field(default_factory=lambda: deque(maxlen=MOST_LABELLED))
    labels: deque[int] = field(default_factory=lambda: deque(maxlen=MOST_LABELLED))
    seen: int = 0
    """Labelled records observed since start."""

    def observe(self, labels: np.ndarray, logits: np.ndarray) -> None:
        """Add the records whose label is known (a NaN label is skipped)."""
        known = ~np.isnan(labels)
        self.labels.extend(int(v) for v in labels[known])
        self.logits.extend(float(v) for v in logits.reshape(-1)[known])
        self.seen += int(known.sum())

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(labels, logits) of the labelled records kept, copied (for :func:`served_auc` on another thread)."""
        return np.fromiter(self.labels, np.int64, len(self.labels)), np.fromiter(self.logits, np.float64,
                                                                                  len(self.logits))


def served_calibration(labels: np.ndarray, logits: np.ndarray) -> tuple[float | None, float | None]:
    """``(mean predicted, observed rate)`` of labelled records: the mean probability the logits predict
    (their sigmoid) and the fraction of positive labels; a calibrated model's agree up to noise (a model
    trained on downsampled negatives agrees only when the trainers weighted them, docs/records.md).
    ``(None, None)`` when there are no records."""
    if labels.size == 0:
        return None, None
    predicted = 0.5 * (1.0 + np.tanh(0.5 * np.asarray(logits, np.float64)))  # the sigmoid, no overflow
    return float(predicted.mean()), float(np.count_nonzero(labels)) / labels.size


def served_auc(labels: np.ndarray, logits: np.ndarray) -> float | None:
    """ROC AUC of ``logits`` against 0/1 ``labels`` (None while they hold one class only, or none): the
    Mann-Whitney statistic from the scores' ranks, ties sharing their mean rank, as scikit-learn's
    ``roc_auc_score`` computes it, in one sort (a few ms for 50,000 records; no scikit-learn import and
    its input checks on the replica's threads)."""
    positives = int(np.count_nonzero(labels))
    negatives = int(labels.size) - positives
    if positives == 0 or negatives == 0:
        return None
    order = np.argsort(logits, kind="stable")
    ranked = logits[order]
    # the mean rank (1-based) of each run of equal scores
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    ends = np.r_[starts[1:], ranked.size]
    mean_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(ranked.size, np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    rank_sum = float(ranks[labels != 0].sum())
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


@dataclass
class LatencyWindow:
    """Request times since the last report (for its p99)."""

    seconds: list[float] = field(default_factory=list)

    def observe(self, s: float) -> None:
        """One request's time."""
        if len(self.seconds) < 100_000:
            self.seconds.append(s)

    def take_p99_ms(self) -> float | None:
        """The 99th percentile in ms of the times since the last call (None: no request), and forget them."""
        if not self.seconds:
            return None
        p99 = float(np.percentile(np.asarray(self.seconds), 99)) * 1000
        self.seconds = []
        return p99
