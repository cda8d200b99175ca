"""Trainer services: consume assigned partitions, compute gradients with PyTorch, push them."""

from .device import DevicePlan, plan_device
from .evaluate import EvalResult, evaluate
from .models import ModelSpec, build_model, builtin_specs, mlp
from .settings import TrainerSettings

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
