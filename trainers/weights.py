"""Sample weights in the loss: the weighted mean ``sum(w_i * l_i) / sum(w_i)`` of a batch.

A joiner that keeps each negative with probability r writes it with the weight ``w = 1/r``
(docs/records.md, the ``w`` of single records); a consumer's :class:`datastream.Batch` carries the
weights as ``Batch.w``. Weighting the loss by them makes a kept negative count for the ``1/r`` it
stands for, so the model stays calibrated: a record of weight k gives the gradient of that record
k times in an unweighted batch.

The weighted mean needs each record's own loss, which only a loss streamtrain knows can give
(:data:`WEIGHTED_LOSSES`); a weighted batch with any other loss raises :class:`LossWeightsError`
rather than silently training unweighted. A batch without weights computes ``loss_fn(output,
target)`` itself, exactly as before.
"""

from __future__ import annotations

import torch
from torch import nn

from .models import LossFn
from .ranking import binary_logistic_loss

__all__ = ["WEIGHTED_LOSSES", "LossWeightsError", "weighted_loss"]

WEIGHTED_LOSSES = ("trainers.ranking.binary_logistic_loss", "torch.nn.functional.cross_entropy",
                   "torch.nn.CrossEntropyLoss()", "torch.nn.functional.mse_loss", "torch.nn.MSELoss()")
"""The losses a batch with sample weights can train (a module loss with its default
``reduction="mean"`` and no class ``weight``)."""


class LossWeightsError(ValueError):
    """A batch carries sample weights but the model's loss cannot be weighted per record."""


def _refuse(loss_fn: LossFn, why: str) -> LossWeightsError:
    return LossWeightsError(
        f"the batch carries sample weights (records with 'w', e.g. negatives kept by `streamtrain join "
        f"--negative-rate`), but the loss {loss_fn!r} {why}; weighted batches train only with "
        f"{', '.join(WEIGHTED_LOSSES)} — use one of them, or write the records without 'w'")


def _per_record(loss_fn: LossFn, output: torch.Tensor, target: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each record's loss ``[n]`` as ``loss_fn`` would average it, and the mask of the records it
    counts (None: all of them)."""
    functional = nn.functional
    if loss_fn is binary_logistic_loss:
        return functional.binary_cross_entropy_with_logits(
            output.reshape(-1), target.reshape(-1).float(), reduction="none"), None
    if loss_fn is functional.cross_entropy or isinstance(loss_fn, nn.CrossEntropyLoss):
        ignore, smoothing = -100, 0.0
        if isinstance(loss_fn, nn.CrossEntropyLoss):
            if loss_fn.weight is not None or loss_fn.reduction != "mean":
                raise _refuse(loss_fn, "has class weights or a reduction other than 'mean'")
            ignore, smoothing = loss_fn.ignore_index, loss_fn.label_smoothing
        per = functional.cross_entropy(output, target, reduction="none", ignore_index=ignore,
                                       label_smoothing=smoothing)
        return per, target != ignore
    if loss_fn is functional.mse_loss or isinstance(loss_fn, nn.MSELoss):
        if isinstance(loss_fn, nn.MSELoss) and loss_fn.reduction != "mean":
            raise _refuse(loss_fn, "has a reduction other than 'mean'")
        if output.numel() != target.numel():
            raise _refuse(loss_fn, f"compares an output of {list(output.shape)} with targets of "
                                   f"{list(target.shape)}, not one value per target")
        per = functional.mse_loss(output.reshape(target.shape), target, reduction="none")
        return per.reshape(len(target), -1).mean(dim=1), None
    raise _refuse(loss_fn, "is not one streamtrain can weight per record")


def weighted_loss(loss_fn: LossFn, output: torch.Tensor, target: torch.Tensor,
                  w: torch.Tensor | None) -> torch.Tensor:
    """The batch's loss: ``loss_fn(output, target)`` when ``w`` is None; otherwise the weighted mean
    ``sum(w_i * l_i) / sum(w_i)`` of the records' losses ``l_i`` (``w`` float ``[n]``, each > 0), so a
    record of weight k counts as k copies of it.

    Raises:
        LossWeightsError: ``w`` is given and ``loss_fn`` is not one of :data:`WEIGHTED_LOSSES`.
        ValueError: ``w`` is not one weight per record.
    """
    if w is None:
        return loss_fn(output, target)
    if w.ndim != 1 or len(w) != len(target):
        raise ValueError(f"sample weights must be [n] for {len(target)} records, got {list(w.shape)}")
    per, counted = _per_record(loss_fn, output, target)
    weights = w.to(per.device, per.dtype)
    if counted is not None:  # records the loss ignores weigh nothing in the mean either
        weights = weights * counted
    return (per * weights).sum() / weights.sum()
