"""Compression that fits the tensor: small tensors dense, large ones sparse, and a density warm-up.

:class:`SizeAdaptive` sends every tensor of fewer than ``dense_below`` values dense with the chain's
value codec and the larger ones through the whole chain (as hivemind's ``SizeAdaptiveCompression``);
:func:`warmup_density` is Deep Gradient Compression's density warm-up. See docs/parameter-plane.md,
*Codecs* (*Compression that fits the tensor*, *Density warm-up*).
"""

from __future__ import annotations

import math

from .registry import CodecChain, get_codec
from .sparse import TopKCodec

__all__ = ["SizeAdaptive", "warmup_density", "DEFAULT_DENSE_BELOW", "WARMUP_START_DENSITY"]

DEFAULT_DENSE_BELOW = 2048
"""Tensors with fewer values than this travel dense. Below it, top-k at 1 % keeps under 21 values a
step, so each coordinate moves about once in a hundred steps; dense, such a tensor costs at most
4 KiB in fp16, and a model made only of such tensors (a plug-in classifier of a thousand parameters)
trains as uncompressed fp16. Only biases go dense on the built-in MLPs: on ``mlp-2m`` 2,058 values
(about 6 % more bytes than top-k alone), on ``digits-mlp`` 522 (``topk+fp16`` at 1 % from ~112x to
~85x smaller than fp32). hivemind's 2**16 is meant for models of 10**8 parameters: it would send
``digits-mlp`` almost whole."""

WARMUP_START_DENSITY = 0.25
"""Density at the first step of the warm-up (DGC's 25 %)."""


def warmup_density(step: int, target: float, warmup_steps: int, start: float = WARMUP_START_DENSITY) -> float:
    """The top-k density of push ``step`` (0-based): ``start`` at step 0, decaying exponentially to
    ``target`` at step ``warmup_steps`` and ``target`` from then on (and always with no warm-up, or
    when ``target >= start``).

    Raises:
        ValueError: ``step`` or ``warmup_steps`` negative, or a density outside (0, 1].
    """
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"warm-up step and length must be >= 0, got {step!r} and {warmup_steps!r}")
    for what, value in (("target", target), ("start", start)):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"warm-up {what} density must be in (0, 1], got {value!r}")
    if warmup_steps == 0 or step >= warmup_steps or target >= start:
        return target
    return start * math.exp(math.log(target / start) * step / warmup_steps)


class SizeAdaptive:
    """Which codec chain each tensor travels with: every value (the chain's value codec) below
    ``dense_below`` values, else the chain ``name`` itself, whose top-k density follows
    :func:`warmup_density` over the first ``warmup_steps`` steps (:meth:`set_step`).

    Args:
        name: the job's codec chain (``topk+fp16``...); a chain without a sparsifier sends every
            tensor with itself.
        dense_below: tensors with fewer values travel dense (0: none does).
        warmup_steps: steps of the density warm-up (0: the target density from the start).
        options: codec options (``density=0.01``...).

    Raises:
        UnknownCodecError, ValueError: see :func:`get_codec`; ``dense_below`` or ``warmup_steps``
            negative.
    """

    def __init__(self, name: str, *, dense_below: int = DEFAULT_DENSE_BELOW, warmup_steps: int = 0,
                 **options: object) -> None:
        if not isinstance(dense_below, int) or dense_below < 0:
            raise ValueError(f"dense_below must be an int >= 0, got {dense_below!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"density warm-up steps must be an int >= 0, got {warmup_steps!r}")
        self.sparse = get_codec(name, **options)
        self.dense_below = dense_below
        self.warmup_steps = warmup_steps
        self._topk = self.sparse.parts[0] if isinstance(self.sparse.parts[0], TopKCodec) else None
        self.target_density = self._topk.density if self._topk is not None else 1.0
        value = self.sparse.parts[-1]
        if self.sparse.parts[0].info.sparsifier:
            self.dense: CodecChain = get_codec(value.info.name, **{o: getattr(value, o) for o in value.options})
        else:
            self.dense = self.sparse

    @property
    def name(self) -> str:
        """The job's chain name."""
        return self.sparse.name

    @property
    def density(self) -> float:
        """The sparse chain's current top-k density (1.0 without a sparsifier)."""
        return self._topk.density if self._topk is not None else 1.0

    def set_step(self, step: int) -> None:
        """Set the top-k density of push ``step`` (0-based) by the warm-up schedule."""
        if self._topk is not None:
            self._topk.density = warmup_density(step, self.target_density, self.warmup_steps)

    def for_tensor(self, numel: int) -> CodecChain:
        """The chain a tensor of ``numel`` values travels with."""
        return self.dense if numel < self.dense_below else self.sparse
