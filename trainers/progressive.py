"""Progressive validation: a binary model's quality on the *next* records, scored before training on them.

A trainer's forward pass on a batch computes the model's predictions before that
batch's gradient is applied anywhere: the parameters it ran on hold only updates
of records consumed earlier. So the training logits of a batch are an honest
score of the model on records it has never trained on, at no extra cost
(Blum, Kalai and Langford's *progressive validation*; the "online AUC" of
online-learning papers). :class:`ProgressiveWindow` collects those logits and
the labels, and closes a window every ``every`` records (a batch that straddles
the boundary is split, so every window holds exactly ``every`` records);
:func:`score_window` scores a closed window, its AUC and log loss
(scikit-learn's ``roc_auc_score`` and ``log_loss``: some milliseconds of input
checks each, so the service scores on a thread of its own, off the training
step). Pure bookkeeping, no I/O; the service feeds it and sends the scored
windows with its heartbeat (``docs/online.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ClosedWindow", "WindowScore", "ProgressiveWindow", "score_window"]


@dataclass(frozen=True)
class ClosedWindow:
    """A window of records, closed, not yet scored."""

    records: int
    """Records scored so far when it closed (this one's included)."""
    logits: np.ndarray
    """The logits of its records (float ``[n]``), computed before training on them."""
    labels: np.ndarray
    """Their 0/1 labels."""


@dataclass(frozen=True)
class WindowScore:
    """One closed window of progressive validation."""

    records: int
    """Records this trainer had scored when the window closed (its x axis: records consumed so far)."""
    n: int
    """Records in the window."""
    auc: float | None
    """ROC AUC of the window's logits against its labels; None when the window holds one class only."""
    log_loss: float
    """Mean log loss of the window's predicted probabilities (sigmoid of the logits)."""

    def as_json(self) -> dict[str, object]:
        """The window as a heartbeat carries it (``stats.progressive[]``)."""
        return {"records": self.records, "n": self.n, "auc": self.auc, "log_loss": self.log_loss}


def score_window(window: ClosedWindow) -> WindowScore:
    """Score one window: the AUC and log loss of its logits (one per record) against its 0/1 labels.

    Raises:
        ValueError: empty window, or logits and labels of different lengths.
    """
    records = window.records
    logits = np.asarray(window.logits, dtype=np.float64).reshape(-1)
    labels = np.asarray(window.labels).reshape(-1).astype(np.int64)
    if len(logits) == 0 or len(logits) != len(labels):
        raise ValueError(f"a window needs as many labels as logits, at least one: got {len(logits)} "
                         f"and {len(labels)}")
    from sklearn.metrics import log_loss, roc_auc_score  # ~1 s to import: only once a window closes

    p = 1.0 / (1.0 + np.exp(-np.clip(logits, -50.0, 50.0)))
    both = bool(labels.min() != labels.max())
    auc = float(roc_auc_score(labels, logits)) if both else None
    loss = float(log_loss(labels, p, labels=[0, 1]))
    return WindowScore(records=records, n=len(logits), auc=auc, log_loss=loss)


@dataclass
class ProgressiveWindow:
    """Collects a binary model's training logits and labels; every ``every`` records closes a window.

    Args:
        every: records per window (at least 1).

    Raises:
        ValueError: ``every`` is below 1.
    """

    every: int
    records: int = 0
    """Records scored so far (in closed windows and the open one)."""
    _logits: list[np.ndarray] = field(default_factory=list, init=False)
    _labels: list[np.ndarray] = field(default_factory=list, init=False)
    _open: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"progressive window must hold at least 1 record, got {self.every}")

    @property
    def open(self) -> int:
        """Records in the window not yet closed."""
        return self._open

    def add(self, logits: np.ndarray, labels: np.ndarray) -> list[ClosedWindow]:
        """Add one batch's logits (computed before training on it) and labels; return the windows
        it closed, oldest first (none, one, or several for a batch larger than a window), for
        :func:`score_window`.

        Raises:
            ValueError: logits and labels of different lengths.
        """
        logits = np.asarray(logits).reshape(-1)
        labels = np.asarray(labels).reshape(-1)
        if len(logits) != len(labels):
            raise ValueError(f"{len(logits)} logits for {len(labels)} labels")
        closed = []
        start = 0
        while start < len(logits):
            take = min(self.every - self._open, len(logits) - start)
            self._logits.append(logits[start:start + take])
            self._labels.append(labels[start:start + take])
            self._open += take
            self.records += take
            start += take
            if self._open == self.every:
                closed.append(ClosedWindow(self.records, np.concatenate(self._logits),
                                           np.concatenate(self._labels)))
                self._logits, self._labels, self._open = [], [], 0
        return closed
