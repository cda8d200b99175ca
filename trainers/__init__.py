"""Trainer services: consume assigned partitions, compute gradients with PyTorch, push them.

Each public name is imported from its module on first use (:func:`common.exports.lazy_exports`):
importing the pure core (``trainers.state``) does not import torch.
"""

from typing import TYPE_CHECKING

from common.exports import lazy_exports

lazy_exports(__name__)

if TYPE_CHECKING:  # the public names, each from its module: lazy_exports reads them here (common.exports)
    from .device import DevicePlan as DevicePlan
    from .device import plan_device as plan_device
    from .evaluate import EvalResult as EvalResult
    from .evaluate import evaluate as evaluate
    from .models import ModelSpec as ModelSpec
    from .models import build_model as build_model
    from .models import builtin_specs as builtin_specs
    from .models import mlp as mlp
    from .settings import TrainerSettings as TrainerSettings
    from .weights import LossWeightsError as LossWeightsError
    from .weights import weighted_loss as weighted_loss
