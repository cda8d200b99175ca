"""Scoring a model on held-out data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models import LossFn


@dataclass(frozen=True)
class EvalResult:
    """Loss and accuracy of one model version on held-out data."""

    version: int
    """Parameter version that was scored."""
    loss: float
    """Mean loss over the held-out set."""
    accuracy: float | None
    """Fraction of correct predictions (None for regression)."""
    samples: int
    """Number of held-out samples."""


@torch.no_grad()
def evaluate(model: torch.nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *,
             version: int, classification: bool, batch_size: int = 1024) -> EvalResult:
    """Score ``model`` on ``(x, y)`` in batches; the model's mode is restored afterwards."""
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"held-out data must be non-empty with as many labels as rows, got {len(x)} and {len(y)}")
    was_training = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    try:
        for start in range(0, len(x), batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            out = model(xb)
            total_loss += float(loss_fn(out, yb)) * len(xb)
            if classification:
                correct += int((out.argmax(dim=1) == yb).sum())
    finally:
        model.train(was_training)
    n = len(x)
    return EvalResult(version, total_loss / n, correct / n if classification else None, n)


def score_job(redis_url: str, job: str, model: str, eval_source: str, *, limit: int | None = None) -> EvalResult:
    """Score the parameters a job stores in Redis now on ``eval_source``'s test split.

    This is the independent check used by ``streamtrain up`` and the tests: it
    reads one consistent snapshot, not what a trainer reports.
    """
    from datastream import load_source
    from services import ParameterStore, connect

    from .models import build_model

    client = connect(redis_url)
    try:
        snapshot = ParameterStore(client, job).pull()
    finally:
        client.close()
    spec = build_model(model)
    spec.model.load_state_dict(snapshot.tensors)
    x, y = load_source(eval_source, split="test").read(limit=limit)
    target = torch.from_numpy(y).long() if spec.classification else torch.from_numpy(y).float()
    return evaluate(spec.model, spec.loss_fn, torch.from_numpy(x).float(), target,
                    version=snapshot.version, classification=spec.classification)
