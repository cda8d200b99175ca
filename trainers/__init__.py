"""Trainer services: consume assigned partitions, compute gradients with PyTorch, push them.

Each public name is imported from its module on first use (:func:`common.exports.lazy_exports`):
importing the pure core (``trainers.state``) does not import torch.
"""

from typing import TYPE_CHECKING

from common.exports import lazy_exports

__all__ = [
    # configuration
    "TrainerSettings",
    # models and devices
    "ModelSpec",
    "build_model",
    "builtin_specs",
    "mlp",
    "DevicePlan",
    "plan_device",
    # evaluation
    "EvalResult",
    "evaluate",
]

lazy_exports(__name__, __all__, {
    ".device": ("DevicePlan", "plan_device"),
    ".evaluate": ("EvalResult", "evaluate"),
    ".models": ("ModelSpec", "build_model", "builtin_specs", "mlp"),
    ".settings": ("TrainerSettings",),
})

if TYPE_CHECKING:  # the same names, eagerly, for type checkers (tests/test_structure.py keeps the two alike)
    from .device import DevicePlan, plan_device
    from .evaluate import EvalResult, evaluate
    from .models import ModelSpec, build_model, builtin_specs, mlp
    from .settings import TrainerSettings
