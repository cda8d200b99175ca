"""Server-side optimizers, learning-rate schedules and clipping (pure functions over tensors).

``sgd`` (momentum, optionally Nesterov's: the outer optimizer of local steps) and ``adam`` are dense;
``lazyadam`` and ``dgc`` are sparse: their step touches only the coordinates a gradient carries. Weight
decay is decoupled, so the state depends on the gradients alone and a restarted server rebuilds it by
replaying the log. See docs/parameter-plane.md, *Optimizers: a step as sparse as the gradient*.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .codecs import Sent
from .names import OPTIMIZERS

__all__ = ["OptimizerConfig", "learning_rate", "slots", "step", "sparse_steps", "clip_factor"]

SPARSE_OPTIMIZERS = ("lazyadam", "dgc")
"""Optimizers whose step touches only the coordinates of the gradient."""


@dataclass(frozen=True)
class OptimizerConfig:
    """How the parameter servers turn gradients into new parameters (stored in the job's meta)."""

    name: str = "sgd"
    """One of :data:`services.names.OPTIMIZERS`."""
    lr: float = 0.01
    """Base learning rate."""
    momentum: float = 0.9
    """SGD momentum (0 turns it off); for ``dgc`` the trainers' momentum."""
    nesterov: bool = False
    """``sgd`` only: Nesterov momentum (``p -= lr * (g + momentum * buf)``, torch's ``SGD(nesterov=True)``):
    the outer optimizer of local steps (DiLoCo), applied to the pushed pseudo-gradients."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.999
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (``p -= lr * wd * p`` where a step touches ``p``)."""
    clip_norm: float = 0.0
    """Clip each update's gradient to this L2 norm over the shards one server applies (0: off)."""
    schedule: str = "constant"
    """``constant``, ``cosine`` (to 0 at ``total_steps``) or ``step`` (x ``gamma`` every ``step_size``)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many steps (any schedule)."""
    total_steps: int = 10000
    """Horizon of the cosine schedule."""
    step_size: int = 1000
    """Period of the step schedule."""
    gamma: float = 0.1
    """Factor of the step schedule."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if self.schedule not in ("constant", "cosine", "step"):
            raise ValueError(f"lr schedule must be constant, cosine or step, got {self.schedule!r}")
        for field in ("lr", "weight_decay", "clip_norm", "eps"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"optimizer {field} must be a finite number >= 0, got {value!r}")
        for field in ("momentum", "beta1", "beta2"):
            value = getattr(self, field)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"optimizer {field} must be in [0, 1), got {value!r}")
        for field in ("warmup_steps", "total_steps", "step_size"):
            if getattr(self, field) < (0 if field == "warmup_steps" else 1):
                raise ValueError(f"optimizer {field} out of range: {getattr(self, field)!r}")
        if self.nesterov and self.name != "sgd":
            raise ValueError(f"Nesterov momentum is an option of sgd, not of {self.name!r}")

    @property
    def sparse(self) -> bool:
        """True when a step touches only the coordinates the gradient carries."""
        return self.name in SPARSE_OPTIMIZERS

    @property
    def trainer_momentum(self) -> float:
        """Momentum the trainers apply before compressing (``dgc``), else 0."""
        return self.momentum if self.name == "dgc" else 0.0

    def to_json(self) -> str:
        """JSON of every field."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> OptimizerConfig:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))


def slots(cfg: OptimizerConfig) -> int:
    """Number of server-side state tensors per shard: 2 for Adam, 1 for SGD with momentum, else 0."""
    if cfg.name in ("adam", "lazyadam"):
        return 2
    return 1 if cfg.name == "sgd" and cfg.momentum > 0 else 0


def learning_rate(cfg: OptimizerConfig, t: int) -> float:
    """Learning rate of step ``t`` (1-based)."""
    lr = cfg.lr
    if cfg.schedule == "cosine":
        lr *= 0.5 * (1.0 + math.cos(math.pi * min(t, cfg.total_steps) / cfg.total_steps))
    elif cfg.schedule == "step":
        lr *= cfg.gamma ** ((t - 1) // cfg.step_size)
    if cfg.warmup_steps and t <= cfg.warmup_steps:
        lr *= t / cfg.warmup_steps
    return lr


def clip_factor(cfg: OptimizerConfig, grads: list[Sent]) -> float:
    """Factor that scales ``grads`` to at most ``cfg.clip_norm`` total L2 norm (1.0 when off)."""
    if cfg.clip_norm <= 0 or not grads:
        return 1.0
    norm = math.sqrt(sum(float(np.dot(g.values.astype(np.float64), g.values)) for g in grads))
    return min(1.0, cfg.clip_norm / (norm + 1e-12))


def step(cfg: OptimizerConfig, param: torch.Tensor, grad: Sent, state: list[torch.Tensor], t: int,
         scale: float = 1.0) -> np.ndarray | None:
    """Apply step ``t`` (1-based) of ``grad`` times ``scale`` to ``param`` and ``state`` in place.

    ``param`` and the state are contiguous float32 CPU tensors of one shard;
    ``grad`` is dense (``indices`` None) or sparse (sorted unique ``indices``).

    Returns:
        The sorted indices the step changed, or None when it changed every coordinate.
    """
    values = grad.values if scale == 1.0 else grad.values * np.float32(scale)
    lr = learning_rate(cfg, t)
    if cfg.sparse:
        idx = grad.indices
        if idx is None:
            idx = np.arange(param.numel())
        _sparse_step(cfg, param.numpy(), idx, values, [s.numpy() for s in state], t)
        return grad.indices
    dense = torch.from_numpy(np.ascontiguousarray(values))
    if grad.indices is not None:  # a dense optimizer fills in the zeros
        dense = torch.zeros(param.numel(), dtype=torch.float32)
        dense[torch.from_numpy(grad.indices)] = torch.from_numpy(values)
    if cfg.weight_decay:
        param.mul_(1.0 - lr * cfg.weight_decay)
    if cfg.name == "adam":
        m, v = state
        m.mul_(cfg.beta1).add_(dense, alpha=1 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(dense, dense, value=1 - cfg.beta2)
        bias1 = 1 - cfg.beta1 ** t
        bias2 = 1 - cfg.beta2 ** t
        denom = v / bias2
        # numpy's sqrt: correctly rounded, and ~15x faster than torch's CPU sqrt on the zeros that
        # sparse (top-k) gradients leave in v (bench/paramserver.py); the tensors are CPU float32
        np.sqrt(denom.numpy(), out=denom.numpy())
        denom.add_(cfg.eps)
        param.addcdiv_(m, denom, value=-lr / bias1)
    elif state:
        buf = state[0]
        buf.mul_(cfg.momentum).add_(dense)
        if cfg.nesterov:
            param.add_(dense, alpha=-lr).add_(buf, alpha=-lr * cfg.momentum)
        else:
            param.add_(buf, alpha=-lr)
    else:
        param.add_(dense, alpha=-lr)
    return None


def sparse_steps(cfg: OptimizerConfig, rows: np.ndarray, parts: Sequence[tuple[int, int, Sent, int]],
                 scale: float = 1.0) -> None:
    """One update's step of a sparse optimizer on several shards at once, in place: exactly
    :func:`step` of each part (bit for bit), in a few array operations for all of them.

    ``rows`` holds consecutive shards in one float32 buffer: ``rows[0]`` their values,
    ``rows[1 + s]`` their optimizer state slot ``s`` (``slots(cfg)`` of them). ``parts``:
    (offset of the shard in ``rows``, its number of values, its gradient, step ``t`` of it) of
    each shard the update touches, no shard twice; ``scale`` multiplies every gradient (the
    update's clipping factor). One gather of the touched columns (values and state together),
    the arithmetic, one scatter per row.
    """
    if not parts:
        return
    idx = np.concatenate([np.arange(off, off + n) if grad.indices is None else grad.indices + off
                          for off, n, grad, _ in parts])
    g = np.concatenate([grad.values for _, _, grad, _ in parts])
    if scale != 1.0:
        g = g * np.float32(scale)
    ts = [t for *_, t in parts]
    decay: np.float32 | np.ndarray
    rate: np.float32 | np.ndarray
    if ts.count(ts[0]) == len(ts):  # one step count (the usual case): scalar coefficients
        decay, rate = _coefficients(cfg, ts[0])
    else:  # each shard's coefficients at its values (the same float32 products, element by element)
        sizes = [n if grad.indices is None else grad.indices.size for _, n, grad, _ in parts]
        pairs = np.array([_coefficients(cfg, t) for t in ts], dtype=np.float32)
        decay, rate = np.repeat(pairs[:, 0], sizes), np.repeat(pairs[:, 1], sizes)
    got = np.take(rows, idx, axis=1)  # (1 + slots, touched): one gather of values and state
    _sparse_update(cfg, got[0], list(got[1:]), g, decay, rate)
    for row, new in zip(rows, got, strict=True):
        row[idx] = new


def _coefficients(cfg: OptimizerConfig, t: int) -> tuple[np.float32, np.float32]:
    """(weight-decay factor, step size) of step ``t`` of a sparse optimizer, as float32."""
    lr = learning_rate(cfg, t)
    rate = lr * math.sqrt(1 - cfg.beta2 ** t) / (1 - cfg.beta1 ** t) if cfg.name == "lazyadam" else lr
    return np.float32(1.0 - lr * cfg.weight_decay), np.float32(rate)


def _sparse_step(cfg: OptimizerConfig, p: np.ndarray, idx: np.ndarray, g: np.ndarray,
                 state: list[np.ndarray], t: int) -> None:
    """The step of a sparse optimizer at coordinates ``idx`` only (numpy views of the tensors)."""
    w = p[idx]
    state_i = [s[idx] for s in state]
    decay, rate = _coefficients(cfg, t)
    _sparse_update(cfg, w, state_i, g, decay, rate)
    for s, s_i in zip(state, state_i, strict=True):
        s[idx] = s_i
    p[idx] = w


def _sparse_update(cfg: OptimizerConfig, w: np.ndarray, state: list[np.ndarray], g: np.ndarray,
                   decay: np.float32 | np.ndarray, rate: np.float32 | np.ndarray) -> None:
    """The arithmetic of a sparse step on the touched coordinates' values ``w`` and state, in
    place (float32 throughout; ``decay`` and ``rate`` per coordinate or for all)."""
    if cfg.weight_decay:
        w *= decay
    if cfg.name == "lazyadam":
        # the arithmetic of torch.optim.SparseAdam, at the touched coordinates
        f32 = np.float32
        m_i, v_i = state
        m_i += (g - m_i) * f32(1 - cfg.beta1)
        v_i += (g * g - v_i) * f32(1 - cfg.beta2)
        w -= rate * (m_i / (np.sqrt(v_i) + f32(cfg.eps)))
    else:  # dgc: plain SGD; momentum was applied by the trainer
        w -= rate * g
