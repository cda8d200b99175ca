"""A tiny regression job for the end-to-end test of ``streamtrain up`` (``tests/test_streamtrain_up.py``).

``regression_job:records`` is a ``module:callable`` source and
``regression_job:linear_model`` a ``module:factory`` model spec; the services
that ``up`` starts import them too, so the test puts this folder on
``PYTHONPATH``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch import nn


def records(limit: str = "5000", features: str = "8", seed: str = "0") -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``limit`` records of a noisy linear teacher, ``y = x @ w + 0.5 + noise``, in blocks of 256.

    The options arrive as strings (from the source spec's query); the same seed gives the same records.
    """
    n, d = int(limit), int(features)
    rng = np.random.default_rng(int(seed))
    w = rng.uniform(-1.0, 1.0, d).astype(np.float32)
    for start in range(0, n, 256):
        x = rng.standard_normal((min(256, n - start), d), dtype=np.float32)
        yield x, x @ w + np.float32(0.5) + np.float32(0.1) * rng.standard_normal(len(x), dtype=np.float32)


def linear_model(features: int = 8) -> tuple[nn.Module, object]:
    """A linear model with one output per record (``[n]``, as the targets) and the MSE loss."""
    return nn.Sequential(nn.Linear(features, 1), nn.Flatten(0)), nn.functional.mse_loss
