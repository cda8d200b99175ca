"""The trainer side of a push: validate gradients, compress with error feedback, push.

:class:`Pusher` holds one error-feedback residual per shard for lossy codecs:
it encodes ``g + residual`` and keeps what was not sent as the next residual,
so nothing of the gradient is lost, only delayed. The residual is committed
only when the push succeeds; a refused push leaves it as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import redis
import torch

from .codecs import decode_gradient, get_codec
from .errors import BadGradientError
from .store import ParameterStore
from .updates import DEFAULT_MAX_PENDING, Update, push_update

logger = logging.getLogger(__name__)

__all__ = ["Pusher", "PushResult"]


@dataclass(frozen=True)
class PushResult:
    """What one push did."""

    update_id: str
    """Update-log entry id."""
    wire_bytes: int
    """Encoded gradient bytes sent (all shards)."""
    raw_bytes: int
    """The same gradients as float32."""


class Pusher:
    """Encode and push a trainer's gradients for job ``job`` as member ``member_id``.

    Args:
        client: redis-py client (not closed here).
        job: the job.
        member_id: this trainer's member id.
        codec: codec chain name (``none``, ``fp16``, ``topk+fp16``...).
        codec_options: e.g. ``{"density": 0.01}``.
        error_feedback: keep residuals for lossy codecs (on by default).
        max_pending: backpressure bound of the update log.
    """

    def __init__(self, client: redis.Redis, job: str, member_id: str, *, codec: str = "none",
                 codec_options: Mapping[str, object] | None = None, error_feedback: bool = True,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.client = client
        self.job = job
        self.member_id = member_id
        self.codec = get_codec(codec, **dict(codec_options or {}))
        self.error_feedback = error_feedback and self.codec.lossy
        self.max_pending = max_pending
        self.layout = ParameterStore(client, job).layout
        self.residuals: dict[int, torch.Tensor] = {}

    def encode(self, grads: Mapping[str, torch.Tensor]) -> tuple[dict[int, bytes], dict[int, torch.Tensor], int]:
        """Validate and encode ``grads`` (tensor name -> gradient).

        Returns:
            (shard index -> encoded bytes, shard index -> new residual, raw fp32 bytes).

        Raises:
            BadGradientError: an unknown tensor, a wrong shape or dtype, or NaN/inf
                values; the message names the tensor (and shard) and what was expected.
        """
        blobs: dict[int, bytes] = {}
        residuals: dict[int, torch.Tensor] = {}
        raw = 0
        for name, grad in grads.items():
            try:
                spec = self.layout.tensor(name)
            except KeyError:
                raise BadGradientError(f"gradient for unknown tensor {name!r}") from None
            if tuple(grad.shape) != spec.shape:
                raise BadGradientError(f"gradient of {name!r}: shape {list(grad.shape)}, expected {list(spec.shape)}")
            if grad.dtype != torch.float32:
                raise BadGradientError(f"gradient of {name!r}: dtype {grad.dtype}, expected torch.float32")
            flat = grad.detach().to("cpu").reshape(-1)
            finite = np.isfinite(flat.numpy())
            if not finite.all():
                raise BadGradientError(f"gradient of {name!r}: {int((~finite).sum())} NaN or infinite value(s)")
            for shard in self.layout.shards_of(name):
                part = flat[shard.start:shard.start + shard.numel]
                if self.error_feedback and shard.index in self.residuals:
                    part = part + self.residuals[shard.index]
                enc = self.codec.encode(part)
                blobs[shard.index] = enc.data
                raw += 4 * shard.numel
                if self.error_feedback:
                    residuals[shard.index] = part - decode_gradient(enc.data, numel=shard.numel)
        return blobs, residuals, raw

    def push(self, grads: Mapping[str, torch.Tensor] | None, *, generation: int, clock: int,
             offsets: Mapping[int, tuple[int, int]] | None = None,
             samples: Sequence[tuple[str, int, int]] = (), batch_size: int = 0,
             produced_ts_ms: int = 0, backpressure_timeout_s: float = 30.0) -> PushResult:
        """Encode ``grads`` (None or empty: an offsets-only update) and push them atomically.

        Raises:
            BadGradientError: see :meth:`encode` (nothing is pushed).
            FencedError, OffsetConflictError, BackpressureError, PayloadError: see
                :func:`services.updates.push_update` (residuals are kept as they were).
        """
        blobs, residuals, raw = self.encode(grads or {})
        update = Update(member_id=self.member_id, generation=generation, clock=clock, gradients=blobs,
                        codec=self.codec.name, offsets=dict(offsets or {}), samples=tuple(samples),
                        batch_size=batch_size, produced_ts_ms=produced_ts_ms)
        update_id = push_update(self.client, self.job, update, max_pending=self.max_pending,
                                backpressure_timeout_s=backpressure_timeout_s)
        self.residuals.update(residuals)
        return PushResult(update_id, sum(len(b) for b in blobs.values()), raw)

    def residual_norm(self) -> float:
        """L2 norm of all error-feedback residuals (0 when there are none)."""
        return float(sum(float(r.double().square().sum()) for r in self.residuals.values()) ** 0.5)
