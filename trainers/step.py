"""One training step on a local replica: load fresh parameters, forward, backward.

The trainer service (``trainers/service.py``) owns the I/O; this module owns
the arithmetic, so it can be read (and tested) on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services import Layout, Snapshot

from .device import DevicePlan
from .models import ModelSpec


@dataclass(frozen=True)
class StepResult:
    """What one step computed."""

    loss: float
    """Training loss of the batch."""
    grads: dict[str, torch.Tensor]
    """Gradient per parameter name, float32 on the CPU."""
    rows: int
    """Records in the batch."""


class Replica:
    """A trainer's local copy of the model, refreshed from parameter snapshots."""

    def __init__(self, spec: ModelSpec, plan: DevicePlan) -> None:
        self.spec = spec
        self.plan = plan
        self.model = spec.model.to(plan.device)
        self.model.train()
        self.params = dict(self.model.named_parameters())
        self.version = -1

    def initial_tensors(self) -> dict[str, torch.Tensor]:
        """The freshly initialised parameters (what ``init_model`` stores), on the CPU."""
        return {name: p.detach().to("cpu", torch.float32) for name, p in self.params.items()}

    @torch.no_grad()
    def load(self, snapshot: Snapshot, layout: Layout) -> None:
        """Copy the tensors that changed in ``snapshot`` into the model."""
        if self.version < 0:
            names = set(self.params)
        else:
            names = {layout.shards[i].name for i in snapshot.fetched}
        for name in names:
            self.params[name].copy_(snapshot.tensors[name], non_blocking=True)
        self.version = snapshot.version

    def step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        """Forward and backward on one batch; the parameters themselves are not changed here."""
        x = x.to(self.plan.device, non_blocking=True)
        y = y.to(self.plan.device, non_blocking=True)
        for p in self.params.values():
            p.grad = None
        with self.plan.autocast():
            out = self.model(x)
        loss = self.spec.loss_fn(out.float(), y)
        loss.backward()
        grads = {name: p.grad.detach().to("cpu", torch.float32) for name, p in self.params.items()
                 if p.grad is not None}
        return StepResult(float(loss.detach()), grads, int(x.shape[0]))
