"""Local steps (DiLoCo, Douillard et al. 2023): H inner-optimizer steps on the replica between a pull
and a push, and the push of the parameters' difference since the pull.

With ``local_steps`` H > 1 a trainer pushes, once a window of H steps, the *pseudo-gradient*
``theta_pulled - theta_now`` with the offsets of every batch the window consumed, at one clock
(:class:`LocalSteps`, :func:`window_batch`); the parameter servers apply it with the outer optimizer
(:func:`server_optimizer`). The rules (which optimizers and codecs, the bounds) live in
:mod:`services.local_steps`; how a window steps and waits in :mod:`trainers.steps`. The arithmetic
and why: ``docs/parameter-plane.md``, *Local steps: an outer optimizer on pseudo-gradients (DiLoCo)*.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from coordinator.assignment import JobConfig
from datastream import Batch
from services import OptimizerConfig
from services.local_steps import INNER_OPTIMIZERS, OUTER_OPTIMIZER, check_dense_model

from .models import ModelSpec

__all__ = ["LocalSteps", "check_model", "inner_optimizer", "server_optimizer", "window_batch"]


def server_optimizer(config: JobConfig) -> OptimizerConfig:
    """What the parameter servers apply to a push of ``config``'s job: the job's ``optimizer`` at its
    ``lr`` to gradients, or with local steps the outer optimizer (SGD with Nesterov momentum at
    ``outer_lr`` and ``outer_momentum``) to pseudo-gradients."""
    if config.local_steps == 1:
        return OptimizerConfig(name=config.optimizer, lr=config.lr)
    return OptimizerConfig(name=OUTER_OPTIMIZER, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=True)


def inner_optimizer(config: JobConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The trainer's inner optimizer of ``config``'s job (local steps), the one
    ``services.local_steps.INNER_OPTIMIZERS`` names (SGD with momentum for ``sgd``, AdamW for ``adam``
    and ``lazyadam``), with the job's ``lr`` and the hyperparameters the servers' optimizer of that name
    has (``services.OptimizerConfig``'s defaults).

    Raises:
        ValueError: an optimizer that cannot be an inner one (``dgc``; ``JobConfig`` refuses it first).
    """
    hyper = OptimizerConfig(name=config.optimizer, lr=config.lr)
    params = list(params)
    fused = fused_supported(params)
    inner = INNER_OPTIMIZERS.get(hyper.name)
    if inner == "sgd":
        return torch.optim.SGD(params, lr=hyper.lr, momentum=hyper.momentum, weight_decay=hyper.weight_decay,
                               fused=fused)
    if inner == "adamw":
        return torch.optim.AdamW(params, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                                 weight_decay=hyper.weight_decay, fused=fused)
    raise ValueError(f"optimizer {hyper.name!r} cannot be the inner optimizer of local steps")


def fused_supported(params: Sequence[torch.Tensor]) -> bool | None:
    """Whether the inner optimizer may take PyTorch's fused kernels for ``params`` (floating point, on
    the CPU or a CUDA device): ``True``, else ``None`` (PyTorch's default).

    The inner optimizer steps every local step on the trainer. PyTorch's default on the CPU is the
    per-tensor loop (its ``foreach`` and ``fused`` defaults apply to CUDA tensors only); the fused
    kernel does the whole update in one pass: AdamW over the 1.86M parameters of ``mlp-2m`` took
    4.6 ms a step in the loop, 2.5 ms with ``foreach`` and 0.8 ms fused (2 threads, this machine).
    """
    return (bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)) or None


def check_model(config: JobConfig, spec: ModelSpec) -> None:
    """Refuse a model local steps do not support (``services.local_steps.check_dense_model``).

    Raises:
        ValueError: ``config`` has local steps and the model has embedding tables.
    """
    check_dense_model(config.local_steps, spec.name, [t.name for t in spec.tables])


def window_batch(batches: Sequence[Batch]) -> Batch:
    """What the push of a window carries: the records and offsets of ``batches`` (consumed one after
    another) as one batch. Per partition its offsets run from the first batch's first offset to the
    last one's next; its samples are the batches' in order; its produce time the oldest. Its ``x``
    and ``y`` hold no values (``x`` is ``[n, 0]``: the steps are taken).

    Raises:
        ValueError: no batches, or a partition's offsets are not contiguous from one batch to the next
            (a gap the push would cover without having trained on it).
    """
    if not batches:
        raise ValueError("a window without batches has nothing to push")
    offsets: dict[int, tuple[int, int]] = {}
    for batch in batches:
        for partition, (first, nxt) in batch.offsets.items():
            if partition in offsets:
                start, end = offsets[partition]
                if first != end:
                    raise ValueError(f"partition {partition}: a batch of the window starts at offset {first}, "
                                     f"not at {end} where the one before it ended")
                offsets[partition] = (start, nxt)
            else:
                offsets[partition] = (first, nxt)
    n = sum(len(b) for b in batches)
    return Batch(x=torch.empty(n, 0), y=torch.empty(n), offsets=offsets,
                 samples=[run for b in batches for run in b.samples],
                 produced_ts_ms=min(b.produced_ts_ms for b in batches),
                 rejected=sum(b.rejected for b in batches))


class LocalSteps:
    """The window of local steps in hand: the parameters at its start (the *anchor*), the batches its
    steps consumed, and the inner optimizer (whose state lives across windows).

    Not shared across threads at once: the shell begins a window and steps on its worker thread, and
    closes or discards it on its event loop, never while a step runs."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], inner: torch.optim.Optimizer, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"local steps must be >= 1, got {steps}")
        self.params = dict(params)
        self.inner = inner
        """The inner optimizer over :attr:`params` (:func:`inner_optimizer`)."""
        self.steps = steps
        """Steps per window (H)."""
        self.batches: list[Batch] = []
        """The batches of the window in hand, in order (a batch of dead-lettered records only too)."""
        self._anchor: dict[str, torch.Tensor] | None = None

    @property
    def open(self) -> bool:
        """A window is in hand (it has stepped on at least one batch)."""
        return bool(self.batches)

    @property
    def full(self) -> bool:
        """The window has taken its H steps: push it."""
        return len(self.batches) >= self.steps

    def begin(self) -> None:
        """A window starts on the parameters the replica holds now (after the pull, if any)."""
        self._anchor = {name: p.detach().clone() for name, p in self.params.items()}

    def stepped(self, batch: Batch) -> None:
        """The window's inner optimizer stepped on ``batch`` (or it was empty: its offsets only).

        Raises:
            RuntimeError: no window was begun.
        """
        if self._anchor is None:
            raise RuntimeError("a local step outside a window: begin() first")
        self.batches.append(batch)

    def close(self) -> tuple[dict[str, torch.Tensor], Batch]:
        """End the window: its pseudo-gradient (``anchor - now`` per parameter, float32 on the CPU) and
        its :func:`window_batch`; the replica goes back to the anchor.

        Raises:
            RuntimeError: no window is open.
            ValueError: the window's offsets have a gap (:func:`window_batch`); the window is discarded.
        """
        if self._anchor is None or not self.batches:
            raise RuntimeError("no window of local steps to close")
        anchor, batches = self._anchor, self.batches
        delta = {name: (anchor[name] - p.detach()).to("cpu", torch.float32) for name, p in self.params.items()}
        self.discard()
        return delta, window_batch(batches)

    def discard(self) -> None:
        """Drop the window in hand (its records are not pushed: they go to the next owner from the
        committed offsets); the replica goes back to the anchor. Nothing to do when none is open."""
        if self._anchor is not None:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(self._anchor[name])
        self._anchor = None
        self.batches = []
