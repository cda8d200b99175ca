"""One training step on a local replica: forward and backward on parameters pulled into it.

The trainer service (``trainers/service.py``) owns the I/O; this module owns
the arithmetic, so it can be read (and tested) on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.tables import RowGrads

from .device import DevicePlan
from .models import ModelSpec
from .tables import TableLookup, pool, row_gradients
from .weights import weighted_loss


@dataclass(frozen=True)
class StepResult:
    """What one step computed."""

    loss: float
    """Training loss of the batch."""
    grads: dict[str, torch.Tensor]
    """Gradient per parameter name, float32, on the replica's device: on an accelerator it stays
    there, and the push's encoder selects and compresses it there (``Pusher.encode``)."""
    rows: int
    """Records in the batch."""
    row_grads: list[RowGrads] = field(default_factory=list)
    """Gradient rows of the embedding tables: per table, the batch's unique IDs and their rows."""
    logits: np.ndarray | None = None
    """A binary model's logits of the batch (float32 ``[n]`` on the CPU), computed before its gradient
    is applied anywhere, when the replica keeps them (progressive validation, :mod:`trainers.progressive`)."""


class Replica:
    """A trainer's local copy of the model; pulls write straight into its parameters
    (``ParameterStore.pull(out=replica.tensors)``), with no second copy."""

    def __init__(self, spec: ModelSpec, plan: DevicePlan, *, row_dtype: torch.dtype = torch.float32,
                 keep_logits: bool = False) -> None:
        self.spec = spec
        self.keep_logits = keep_logits and spec.binary
        """Return a binary model's logits with each step (only the small ``[n]`` vector leaves the device)."""
        self.plan = plan
        self.row_dtype = row_dtype
        """The dtype gradient rows of embedding tables are cast to on the device (what they travel as)."""
        self.model = spec.model.to(plan.device)
        self.model.train()
        self.params = dict(self.model.named_parameters())

    def initial_tensors(self) -> dict[str, torch.Tensor]:
        """The freshly initialised parameters (what ``init_model`` stores), on the CPU."""
        return {name: p.detach().to("cpu", torch.float32) for name, p in self.params.items()}

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The parameters' own storage (no autograd), for a pull to write into in place."""
        return {name: p.data for name, p in self.params.items()}

    def step(self, x: torch.Tensor, y: torch.Tensor, lookups: Mapping[str, TableLookup] | None = None,
             rows: Mapping[str, np.ndarray] | None = None, *, inner: torch.optim.Optimizer | None = None,
             w: torch.Tensor | None = None) -> StepResult:
        """Forward and backward on one batch; the parameters themselves are not changed here, unless
        ``inner`` is given: a local step (:mod:`trainers.local`), where that optimizer steps the
        parameters on the gradient and the result carries no gradients. A model with embedding
        tables also takes the batch's ``lookups`` and their fetched ``rows`` (``trainers.tables``),
        and returns the gradient rows. ``w``: the batch's sample weights (``Batch.w``): the loss is
        then their weighted mean (:func:`trainers.weights.weighted_loss`).

        Raises:
            trainers.weights.LossWeightsError: ``w`` is given and the model's loss cannot be weighted.
        """
        x = x.to(self.plan.device, non_blocking=True)
        y = y.to(self.plan.device, non_blocking=True)
        for p in self.params.values():
            p.grad = None
        leaves: Mapping[str, Any] = {}
        with self.plan.autocast():
            if self.spec.tables:
                if lookups is None or rows is None:
                    raise ValueError(f"model {self.spec.name} has embedding tables: a step needs its rows")
                pooled, leaves = pool(lookups, rows, self.plan.device)
                out = self.model(x, pooled)
            else:
                out = self.model(x)
        loss = weighted_loss(self.spec.loss_fn, out.float(), y, w)
        loss.backward()
        if inner is not None:
            inner.step()
        grads = {} if inner is not None else {name: p.grad.detach().to(torch.float32)
                                              for name, p in self.params.items() if p.grad is not None}
        row_grads = row_gradients(lookups, leaves, self.row_dtype) if leaves and lookups is not None else []
        logits = out.detach().reshape(-1).float().cpu().numpy() if self.keep_logits else None
        return StepResult(float(loss.detach()), grads, int(x.shape[0]), row_grads, logits)
