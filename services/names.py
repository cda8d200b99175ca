"""Names of the parameter plane that the planes above offer and check without importing it.

The coordinator validates a job's optimizer and codec when it starts or changes a job, and starts
without torch or redis-py's parameter-plane code (it imports the parameter plane only once
``GET /v1/model`` is first asked for, :mod:`coordinator.model_route`). So the names it needs live
here, in a module that imports nothing, and the parameter plane reads them from here too:
:class:`services.optim.OptimizerConfig` accepts :data:`OPTIMIZERS`, and a codec is a sparsifier
(``services.codecs.CodecInfo.sparsifier``) when its name is in :data:`SPARSIFIERS`.
"""

from __future__ import annotations

__all__ = ["OPTIMIZERS", "SPARSIFIERS"]

OPTIMIZERS = ("sgd", "adam", "lazyadam", "dgc")
"""Optimizer names a job may use (``services.optim``)."""

SPARSIFIERS = ("topk",)
"""Codecs that keep only some coordinates of a gradient and hand them to an inner value codec
(``topk+fp16``); the others send every value."""
