"""Plug-in models the benches train (``--model bench.models:<factory>``).

A trainer imports its plug-in model by name in its own process, in its own folder: this module is
found there because the benches give their processes the repository on ``PYTHONPATH``
(:func:`bench.harness.child_environment`). It imports only what a trainer has anyway (torch, the
trainers package), so a trainer does not load a bench to build its model.
"""

from __future__ import annotations

from typing import Any


def small_mlp() -> tuple[Any, Any]:
    """A 64-16-10 MLP for digits (1,210 parameters): ``bench/compression.py``'s small model."""
    from torch import nn

    from trainers.models import mlp
    return mlp([64, 16, 10]), nn.functional.cross_entropy
