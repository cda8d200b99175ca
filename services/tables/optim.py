"""Row optimizers: one step at the rows a gradient touches, nothing else (pure numpy).

``lazyadam`` (``torch.optim.SparseAdam``'s arithmetic, with the table's step count) and ``adagrad``
(row-wise, one accumulator per row), their state kept beside the row (``rows.row_dtype``'s ``state``).
See docs/embeddings.md, *Pull, push, apply*.
"""

from __future__ import annotations

import math

import numpy as np

from .spec import RowOptimizerConfig

__all__ = ["step_rows"]


def step_rows(cfg: RowOptimizerConfig, values: np.ndarray, state: np.ndarray, grads: np.ndarray,
              t: int | np.ndarray) -> None:
    """Apply step ``t`` (1-based; or one step count per row) of ``grads`` to ``values`` and ``state``
    in place.

    Args:
        values: ``[k, dim]`` float32 rows.
        state: ``[k, slots]`` float32 optimizer state of those rows.
        grads: ``[k, dim]`` float32 gradients of those rows.
        t: the step count of the rows' tables (an int, or ``[k]`` ints: the same float32 arithmetic
            per row as a scalar count would give).
    """
    f32 = np.float32
    if cfg.name == "lazyadam":
        dim = values.shape[1]
        m, v = state[:, :dim], state[:, dim:]
        m += (grads - m) * f32(1 - cfg.beta1)
        v += (grads * grads - v) * f32(1 - cfg.beta2)
        if isinstance(t, np.ndarray):  # per row, computed in float64 as math.sqrt and ** would
            tf = t.astype(np.float64)
            sizes = cfg.lr * np.sqrt(1 - cfg.beta2 ** tf) / (1 - cfg.beta1 ** tf)
            values -= sizes.astype(f32)[:, None] * (m / (np.sqrt(v) + f32(cfg.eps)))
            return
        step_size = cfg.lr * math.sqrt(1 - cfg.beta2 ** t) / (1 - cfg.beta1 ** t)
        values -= f32(step_size) * (m / (np.sqrt(v) + f32(cfg.eps)))
    else:  # adagrad, row-wise
        acc = state[:, 0]
        acc += (grads * grads).mean(axis=1, dtype=np.float32)
        values -= (f32(cfg.lr) / (np.sqrt(acc) + f32(cfg.eps)))[:, None] * grads
