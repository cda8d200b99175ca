"""Model specs: a name (or ``module:factory``) -> a fresh ``nn.Module`` and its loss.

:func:`build_model` builds ``digits-mlp``, ``mlp-2m``, the ranking model ``dlrm?OPTIONS`` or a plug-in
``package.module:factory`` returning ``(model, loss_fn)``; the loss decides the task, and a ``tables``
attribute keeps the model's embedding tables in the parameter plane. See docs/architecture.md,
*A trainer, step by step* (*The model*), and docs/embeddings.md, *The data model*.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from common.options import split_spec
from services.tables import TableSpec
from services.tables.spec import validate_tables

from .ranking import binary_logistic_loss, dlrm_from_options

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """A model built from a spec."""

    name: str
    """The spec it was built from."""
    model: nn.Module
    """The freshly initialised module."""
    loss_fn: LossFn
    """Training loss ``loss_fn(output, target)``."""
    classification: bool
    """True when outputs are class logits (accuracy is meaningful)."""
    binary: bool = False
    """True when the output is one logit per record against 0/1 labels (accuracy, log loss, AUC)."""
    tables: tuple[TableSpec, ...] = ()
    """The model's embedding tables (empty for a dense model): ``model.forward(x, pooled)``."""


def mlp(sizes: list[int]) -> nn.Sequential:
    """A ReLU MLP with the given layer widths (input first, classes last)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


_BUILTIN: dict[str, list[int]] = {
    "digits-mlp": [64, 256, 256, 10],
    "mlp-2m": [784, 1024, 1024, 10],
}


def builtin_specs() -> list[str]:
    """Names of the built-in model specs (``dlrm`` takes options: ``dlrm?dim=16``)."""
    return sorted([*_BUILTIN, "dlrm"])


def build_model(spec: str, *, seed: int = 0) -> ModelSpec:
    """Build the model named by ``spec`` with deterministic initial weights.

    Raises:
        ValueError: ``spec`` is neither built in nor an importable ``module:factory``,
            or the factory did not return ``(nn.Module, loss_fn)``.
    """
    torch.manual_seed(seed)
    if spec in _BUILTIN:
        return ModelSpec(spec, mlp(_BUILTIN[spec]), nn.functional.cross_entropy, True)
    if spec.partition("?")[0] == "dlrm":
        model = dlrm_from_options(split_spec(spec)[1])
        return ModelSpec(spec, model, binary_logistic_loss, True, binary=True, tables=model.tables)
    if ":" not in spec:
        raise ValueError(f"unknown model spec {spec!r}: use one of {', '.join(builtin_specs())} "
                         "or 'package.module:factory'")
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model spec {spec!r}: cannot import {attr!r} from {module_name!r}: {exc}") from exc
    built = factory()
    if (not isinstance(built, tuple) or len(built) != 2 or not isinstance(built[0], nn.Module)
            or not callable(built[1])):
        raise ValueError(f"model spec {spec!r}: factory must return (nn.Module, loss_fn), got {type(built).__name__}")
    model, loss_fn = built
    binary = loss_fn is binary_logistic_loss
    classification = binary or loss_fn in (nn.functional.cross_entropy,) or isinstance(loss_fn, nn.CrossEntropyLoss)
    tables = getattr(model, "tables", ())
    try:
        tables = validate_tables(list(tables))
    except ValueError as exc:
        raise ValueError(f"model spec {spec!r}: its tables: {exc}") from None
    return ModelSpec(spec, model, loss_fn, classification, binary=binary, tables=tables)
