"""The trainer side of a push: validate gradients, compress with error feedback, push.

:class:`Pusher` keeps one error-feedback residual (and, for ``dgc``, one momentum buffer) per shard, and
moves them on only when a push is known committed: :meth:`Pusher.prepare` encodes, :meth:`Pusher.send`
pushes, :meth:`Pusher.adopt` makes the feedback current. Which codec each tensor travels with is
:class:`~services.codecs.SizeAdaptive`'s to say.
See docs/parameter-plane.md, *Public API (what a trainer calls)* and *Codecs*.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import redis
import torch

from ..codecs import CodecChain, Sent, SizeAdaptive
from ..errors import BadGradientError
from ..layout import ShardSpec
from ..protocol import Update
from ..store import ParameterStore
from ..tables.grads import WIRE_DTYPES, RowGrads, encode_row_grads, split_by_group
from .updates import DEFAULT_MAX_PENDING, push_update

logger = logging.getLogger(__name__)

__all__ = ["Feedback", "Prepared", "Pusher", "PushResult"]


@dataclass(frozen=True)
class PushResult:
    """What one push did."""

    update_id: str
    """Update-log entry id."""
    wire_bytes: int
    """Encoded gradient bytes sent (all shards and gradient rows)."""
    raw_bytes: int
    """The same gradients as float32."""


@dataclass(frozen=True)
class Feedback:
    """The error-feedback state one push leaves behind (:meth:`Pusher.adopt` makes it current once
    the push is known committed)."""

    residuals: Mapping[int, torch.Tensor]
    """Shard index -> its next residual (lossy codecs)."""
    momenta: Mapping[int, torch.Tensor]
    """Shard index -> its next momentum (with ``momentum`` only)."""
    gradients: bool = False
    """True when the push carried gradients (it counts as a step of the density warm-up)."""


@dataclass(frozen=True)
class Prepared:
    """A push encoded and ready to send (:meth:`Pusher.prepare`)."""

    update: Update
    """What :meth:`Pusher.send` pushes."""
    feedback: Feedback
    """The error-feedback state it leaves behind, to adopt once it is known committed."""
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
        momentum: trainer-side momentum with momentum correction and factor masking (the
            ``dgc`` optimizer's, :attr:`OptimizerConfig.trainer_momentum`); needs a top-k codec.
        row_dtype: how gradient rows of embedding tables travel (``float16`` or ``float32``); they
            are sent whole, for the batch's unique IDs only, never top-k'd.
        dense_below: tensors of fewer values travel dense with the chain's value codec (0: every
            tensor goes through the chain; the trainer passes its ``dense_below`` setting).
        density_warmup_steps: the top-k density decays from 25 % to its target over this many
            committed pushes (0: no warm-up).

    Raises:
        ValueError: ``momentum`` outside [0, 1), or set with a codec that sends every value
            (factor masking would then clear the momentum at every step).
    """

    def __init__(self, client: redis.Redis, job: str, member_id: str, *, codec: str = "none",
                 codec_options: Mapping[str, object] | None = None, error_feedback: bool = True,
                 max_pending: int = DEFAULT_MAX_PENDING, momentum: float = 0.0, row_dtype: str = "float16",
                 dense_below: int = 0, density_warmup_steps: int = 0) -> None:
        self.client = client
        self.job = job
        self.member_id = member_id
        self.adaptive = SizeAdaptive(codec, dense_below=dense_below, warmup_steps=density_warmup_steps,
                                     **dict(codec_options or {}))
        self.codec = self.adaptive.sparse
        self.steps = 0
        """Committed pushes with gradients so far (the density warm-up's clock)."""
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"trainer momentum must be in [0, 1), got {momentum!r}")
        if momentum and not self.codec.parts[0].info.sparsifier:
            raise ValueError(f"trainer momentum (optimizer dgc) needs a top-k codec such as topk+fp16; "
                             f"codec {codec!r} sends every value, so momentum factor masking would clear "
                             "the momentum at every step")
        self.momentum = float(momentum)
        self.error_feedback = (error_feedback and self.codec.lossy) or bool(momentum)
        self.max_pending = max_pending
        if row_dtype not in WIRE_DTYPES:
            raise ValueError(f"gradient rows travel as {' or '.join(WIRE_DTYPES)}, not {row_dtype!r}")
        self.row_dtype = row_dtype
        meta = ParameterStore(client, job).meta()
        self.layout = meta.layout
        self.groups = meta.groups
        self.tables = {t.name: t for t in meta.tables}
        self.residuals: dict[int, torch.Tensor] = {}
        self.momenta: dict[int, torch.Tensor] = {}

    def encode(self, grads: Mapping[str, torch.Tensor]) -> tuple[dict[int, bytes], dict[int, torch.Tensor],
                                                                 dict[int, torch.Tensor], int]:
        """Validate and encode ``grads`` (tensor name -> gradient).

        Returns:
            (shard index -> encoded bytes, shard index -> new residual, shard index -> new
            momentum (with ``momentum`` only), raw fp32 bytes).

        Raises:
            BadGradientError: an unknown tensor, a wrong shape or dtype, or NaN/inf
                values; the message names the tensor (and shard) and what was expected.
        """
        blobs: dict[int, bytes] = {}
        residuals: dict[int, torch.Tensor] = {}
        momenta: dict[int, torch.Tensor] = {}
        raw = 0
        self.adaptive.set_step(self.steps)
        for name, grad in grads.items():
            try:
                spec = self.layout.tensor(name)
            except KeyError:
                raise BadGradientError(f"gradient for unknown tensor {name!r}") from None
            if tuple(grad.shape) != spec.shape:
                raise BadGradientError(f"gradient of {name!r}: shape {list(grad.shape)}, expected {list(spec.shape)}")
            if grad.dtype != torch.float32:
                raise BadGradientError(f"gradient of {name!r}: dtype {grad.dtype}, expected torch.float32")
            codec = self.adaptive.for_tensor(spec.numel)
            shards = self.layout.shards_of(name)
            if grad.device.type != "cpu":  # error feedback and selection where the gradient is
                raw += 4 * grad.numel()
                self._encode_on_device(name, grad, shards, codec, blobs, residuals, momenta)
                continue
            flat = grad.detach().reshape(-1).numpy()
            sources = [flat[s.start:s.start + s.numel] for s in shards]
            if self.momentum:  # momentum correction: what accumulates is the momentum
                for s, part in zip(shards, sources, strict=True):
                    momenta[s.index] = self._momentum(part, s.index)
                sources = [momenta[s.index].numpy() for s in shards]
            parts = [self._corrected(part, s.index) for s, part in zip(shards, sources, strict=True)]
            # one check of g + residual, naming the tensor (the codec's own check is skipped below)
            if not all(np.isfinite(part).all() for part, _ in parts):
                raise BadGradientError(self._not_finite(name, flat))
            for shard, (part, owned) in zip(shards, parts):
                raw += 4 * shard.numel
                if not self.error_feedback:
                    blobs[shard.index] = codec.encode(torch.from_numpy(part), check_finite=False).data
                    continue
                enc, sent = codec.encode_sent(torch.from_numpy(part), check_finite=False)
                if not np.isfinite(sent.values).all():
                    bad = int((~np.isfinite(sent.values)).sum())
                    raise BadGradientError(f"gradient of {name!r} (shard {shard.index}): {bad} value(s) "
                                           f"overflow codec {codec.name} (NaN or infinite once encoded)")
                blobs[shard.index] = enc.data
                residuals[shard.index] = torch.from_numpy(_minus_sent(part, sent, in_place=owned))
                if self.momentum and sent.indices is not None:  # momentum factor masking: sent
                    momenta[shard.index].numpy()[sent.indices] = 0.0  # coordinates start afresh
        return blobs, residuals, momenta, raw

    def _encode_on_device(self, name: str, grad: torch.Tensor, shards: Sequence[ShardSpec], codec: CodecChain,
                          blobs: dict[int, bytes], residuals: dict[int, torch.Tensor],
                          momenta: dict[int, torch.Tensor]) -> None:
        """:meth:`encode` of one gradient that lives on an accelerator: momentum, the residual, the
        finiteness check and a sparsifier's selection run on the device (its residuals and momenta
        stay there), and only what travels crosses to the host: for a ``topk`` chain the kept
        values and their indices (``CodecChain.encode_sent_device``; there top-k is exact)."""
        flat = grad.detach().reshape(-1)
        parts = []
        for shard in shards:
            part = flat[shard.start:shard.start + shard.numel]
            if self.momentum:  # momentum correction: what accumulates is the momentum
                previous = self.momenta.get(shard.index)
                part = part.clone() if previous is None else previous * self.momentum + part
                momenta[shard.index] = part
            residual = self.residuals.get(shard.index) if self.error_feedback else None
            parts.append(part + residual if residual is not None else part)
        if not bool(torch.stack([torch.isfinite(part).all() for part in parts]).all()):  # one sync
            raise BadGradientError(self._not_finite(name, flat.to("cpu").numpy()))
        for shard, part in zip(shards, parts, strict=True):
            enc, sent, kept_at = codec.encode_sent_device(part)
            if not np.isfinite(sent.values).all():
                bad = int((~np.isfinite(sent.values)).sum())
                raise BadGradientError(f"gradient of {name!r} (shard {shard.index}): {bad} value(s) "
                                       f"overflow codec {codec.name} (NaN or infinite once encoded)")
            blobs[shard.index] = enc.data
            if not self.error_feedback:
                continue
            decoded = torch.from_numpy(sent.values).to(part.device)
            residual = part.clone()
            if kept_at is None:
                residual -= decoded
            else:
                residual[kept_at] -= decoded
                if self.momentum:  # momentum factor masking: sent coordinates start afresh
                    momenta[shard.index][kept_at] = 0.0
            residuals[shard.index] = residual

    def _corrected(self, part: np.ndarray, index: int) -> tuple[np.ndarray, bool]:
        """Shard ``index``'s values (a view of the gradient, or its momentum) plus its residual,
        and whether the array is a fresh one (which the next residual may then be built in)."""
        residual = self.residuals.get(index) if self.error_feedback else None
        if residual is None:
            return part, False
        with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN are refused by the caller, by name
            return np.add(part, residual.numpy()), True

    def _momentum(self, part: np.ndarray, index: int) -> torch.Tensor:
        """The next momentum ``m * u + g`` of shard ``index`` (a new tensor: committed on success)."""
        previous = self.momenta.get(index)
        if previous is None:
            return torch.from_numpy(part.copy())
        with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN are refused by the caller, by name
            return torch.from_numpy(previous.numpy() * np.float32(self.momentum) + part)

    def _not_finite(self, name: str, flat: np.ndarray) -> str:
        bad = int((~np.isfinite(flat)).sum())
        if bad:
            return f"gradient of {name!r}: {bad} NaN or infinite value(s)"
        return f"gradient of {name!r}: finite, but it overflows float32 once its error-feedback residual is added"

    def encode_rows(self, rows: Sequence[RowGrads]) -> tuple[dict[int, bytes], tuple[str, ...], int]:
        """Check and encode gradient rows of embedding tables: (group -> its blob, the tables, raw fp32
        bytes of the rows).

        Raises:
            BadGradientError: an unknown table, a row of the wrong width, IDs not unique and
                increasing, or values not finite (or overflowing the wire dtype); names the table.
        """
        by_group: dict[int, list[RowGrads]] = {}
        names, raw = [], 0
        for part in rows:
            spec = self.tables.get(part.table)
            if spec is None:
                raise BadGradientError(f"gradient rows of table {part.table!r}, which the model does not have "
                                       f"(tables: {sorted(self.tables)})")
            if part.table in names:
                raise BadGradientError(f"gradient rows of table {part.table!r} given twice")
            if part.grads.ndim != 2 or part.grads.shape != (part.ids.size, spec.dim):
                raise BadGradientError(f"gradient rows of table {part.table!r}: shape {list(part.grads.shape)}, "
                                       f"expected [{part.ids.size}, {spec.dim}]")
            if part.ids.dtype != np.int64 or (part.ids.size > 1 and not (part.ids[1:] > part.ids[:-1]).all()):
                raise BadGradientError(f"gradient rows of table {part.table!r}: IDs must be int64, unique and "
                                       "increasing")
            names.append(part.table)
            raw += 4 * part.grads.size
            for g, piece in split_by_group(part, self.groups).items():
                by_group.setdefault(g, []).append(piece)
        blobs = {g: encode_row_grads(parts, wire_dtype=self.row_dtype) for g, parts in sorted(by_group.items())}
        return blobs, tuple(names), raw

    def prepare(self, grads: Mapping[str, torch.Tensor] | None, *, generation: int, clock: int,
                offsets: Mapping[int, tuple[int, int]] | None = None,
                samples: Sequence[tuple[str, int, int]] = (), batch_size: int = 0,
                produced_ts_ms: int = 0, rows: Sequence[RowGrads] = ()) -> Prepared:
        """Encode ``grads`` (None or empty: an offsets-only update) and the gradient ``rows`` of
        embedding tables (the batch's unique IDs per table) into the update to send, with the
        error-feedback state it leaves behind. No I/O, and nothing changes here.

        Raises:
            BadGradientError: see :meth:`encode` and :meth:`encode_rows`.
        """
        blobs, residuals, momenta, raw = self.encode(grads or {})
        row_blobs, tables, row_raw = self.encode_rows(rows)
        update = Update(member_id=self.member_id, generation=generation, clock=clock, gradients=blobs,
                        codec=self.codec.name, offsets=dict(offsets or {}), samples=tuple(samples),
                        batch_size=batch_size, produced_ts_ms=produced_ts_ms, rows=row_blobs, tables=tables)
        return Prepared(update, Feedback(residuals, momenta, gradients=bool(blobs)), raw + row_raw)

    def send(self, prepared: Prepared, *, backpressure_timeout_s: float = 30.0) -> PushResult:
        """Push ``prepared`` atomically with its offsets. The error-feedback state stays as it is
        whatever happens: :meth:`adopt` ``prepared.feedback`` once the push is known committed.

        Raises:
            FencedError, OffsetConflictError, BackpressureError, PayloadError, and the
                ``common.outage.REDIS_DOWN`` errors (the push may have been committed:
                ``was_committed``): see :func:`services.push.updates.push_update`.
        """
        update_id = push_update(self.client, self.job, prepared.update, max_pending=self.max_pending,
                                backpressure_timeout_s=backpressure_timeout_s, groups=self.groups)
        update = prepared.update
        wire = sum(len(b) for b in update.gradients.values()) + sum(len(b) for b in update.rows.values())
        return PushResult(update_id, wire, prepared.raw_bytes)

    def adopt(self, feedback: Feedback) -> None:
        """The push that left ``feedback`` behind is committed: its residuals (and momenta) are
        the current ones now."""
        self.residuals.update(feedback.residuals)
        self.momenta.update(feedback.momenta)
        self.steps += feedback.gradients

    def push(self, grads: Mapping[str, torch.Tensor] | None, *, generation: int, clock: int,
             offsets: Mapping[int, tuple[int, int]] | None = None,
             samples: Sequence[tuple[str, int, int]] = (), batch_size: int = 0,
             produced_ts_ms: int = 0, backpressure_timeout_s: float = 30.0, rows: Sequence[RowGrads] = ()
             ) -> PushResult:
        """:meth:`prepare`, :meth:`send`, and :meth:`adopt` when the push succeeds. On any error the
        residuals stay as they were, even when the push went through after all (a connection lost
        after the commit): a caller that rides out outages settles such a push with
        ``was_committed`` and adopts itself (prepare, send, adopt), as the trainer does.

        Raises:
            BadGradientError: see :meth:`encode` (nothing is pushed).
            FencedError, OffsetConflictError, BackpressureError, PayloadError, REDIS_DOWN errors:
                see :meth:`send`.
        """
        prepared = self.prepare(grads, generation=generation, clock=clock, offsets=offsets, samples=samples,
                                batch_size=batch_size, produced_ts_ms=produced_ts_ms, rows=rows)
        result = self.send(prepared, backpressure_timeout_s=backpressure_timeout_s)
        self.adopt(prepared.feedback)
        return result

    def residual_norm(self) -> float:
        """L2 norm of all error-feedback residuals (0 when there are none)."""
        return float(sum(float(r.double().square().sum()) for r in self.residuals.values()) ** 0.5)


def _minus_sent(part: np.ndarray, sent: Sent, *, in_place: bool) -> np.ndarray:
    """``part`` minus what the receiver decodes (``sent``): bit for bit ``part - decode(bytes)``.

    A sparse ``sent`` changes only its few positions (``x - 0`` is ``x``, ``-0.0`` included).
    """
    if sent.indices is None:
        return np.subtract(part, sent.values, out=part if in_place else None)
    out = part if in_place else part.copy()
    out[sent.indices] -= sent.values
    return out
