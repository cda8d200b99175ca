"""``topk``: keep about the largest ``density`` fraction of values, indices delta+varint encoded.

The threshold is estimated DGC-style on a random sample of the magnitudes and trimmed by an exact top-k
of the candidates: *approximate-k*, never more than ``k = ceil(density * n)``. The kept values go to an
inner value codec (``topk+fp16``); the error feedback is the trainer's (``services.push.encoder``).
See docs/parameter-plane.md, *Codecs*.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..errors import PayloadError
from .base import Codec, CodecInfo, Sent, field_bytes
from .floating import NoneCodec, _count

__all__ = ["TopKCodec", "varint_encode", "varint_decode"]

_OVERSHOOT = 2.0
"""The sampled threshold aims at this many times k candidates, then an exact top-k over
the candidates trims them to k: the result is the exact top-k unless the estimate
undershoots (rare), in which case fewer than k values are kept."""

_EXACT_BELOW = 65536
"""Tensors smaller than this use exact torch.topk (sampling is not worth it)."""


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128-encode non-negative integers (vectorized): 1 byte below 128, 2 below 16384..."""
    vals = values.astype(np.uint64, copy=False)
    if vals.size == 0:
        return b""
    width = max(1, (int(vals.max()).bit_length() + 6) // 7)  # bytes of the largest value
    groups = np.empty((vals.size, width), dtype=np.uint8)
    has = np.ones((vals.size, width), dtype=bool)  # value i has a byte j
    for j in range(width):  # scalar shifts: numpy vectorizes them, not per-element (broadcast) ones
        groups[:, j] = (vals >> np.uint64(7 * j)).astype(np.uint8) & np.uint8(0x7F)
        if j + 1 < width:
            has[:, j + 1] = vals >= np.uint64(1 << (7 * (j + 1)))
            groups[:, j] |= has[:, j + 1].view(np.uint8) << np.uint8(7)  # continuation bit
    return groups[has].tobytes()  # row-major: each value's bytes in order


def varint_decode(data: bytes, codec: str = "topk") -> np.ndarray:
    """Inverse of :func:`varint_encode`; PayloadError on a truncated or over-long varint.

    Integer arithmetic from each value's last byte back to its first: one pass per byte
    of the longest value (1-2 for top-k gaps), ~2x cheaper than summing every byte's
    weight (bench/paramserver.py)."""
    b = np.frombuffer(data, dtype=np.uint8)
    if b.size == 0:
        return np.zeros(0, dtype=np.int64)
    if b[-1] & 0x80:
        raise PayloadError(f"codec {codec}: truncated varint at the end of the indices")
    last = np.flatnonzero(b < 0x80)  # each value's last (most significant) byte
    vals = b[last].astype(np.int64)
    if last.size == b.size:  # every value one byte
        return vals
    before = np.empty_like(last)  # bytes of each value before its last
    before[0] = last[0]
    np.subtract(last[1:], last[:-1] + 1, out=before[1:])
    width = int(before.max())
    if width > 4:  # indices are below 2**35; 5 bytes is plenty
        raise PayloadError(f"codec {codec}: varint longer than 5 bytes in the indices")
    for j in range(1, width + 1):  # the j-th byte before the last (wraps harmlessly where masked out)
        vals = np.where(before >= j, (vals << 7) | (b[last - j] & 0x7F), vals)
    return vals


class TopKCodec(Codec):
    """Sparsify to ~``density`` of the values (approximate-k, see module doc)."""

    info = CodecInfo("topk", lossy=True,
                     description="top-k by magnitude (sampled threshold), delta+varint indices")
    options = ("density", "sample")

    def __init__(self, density: float = 0.01, sample: float = 0.01) -> None:
        if not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise ValueError(f"topk density must be in (0, 1], got {density!r}")
        if not isinstance(sample, (int, float)) or not 0.0 < sample <= 1.0:
            raise ValueError(f"topk sample fraction must be in (0, 1], got {sample!r}")
        self.density = float(density)
        self.sample = float(sample)
        self._rng = np.random.default_rng(0x5EED)

    def k(self, n: int) -> int:
        """How many of ``n`` values are kept at most: ``ceil(density * n)``, at least one."""
        return max(1, math.ceil(self.density * n)) if n else 0

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """Sorted indices of (about) the ``k`` largest magnitudes, at most ``k`` of them."""
        n = values.numel()
        k = self.k(n)
        if k == 0:
            return torch.zeros(0, dtype=torch.int64)
        m = np.abs(values.numpy())  # numpy: single-threaded, no worse than torch's 2 threads on a busy machine
        if n < _EXACT_BELOW or k * 4 >= n:
            return torch.topk(torch.from_numpy(m), k, sorted=False).indices.sort().values
        # numpy's flatnonzero/argpartition are ~4x cheaper than torch.nonzero here
        s = max(1024, math.ceil(self.sample * n))
        sample = m[self._rng.integers(0, n, s)]
        keep = min(s, max(1, math.ceil(_OVERSHOOT * self.density * s)))
        threshold = np.partition(sample, s - keep)[s - keep]
        idx = np.flatnonzero(m >= threshold)
        if idx.size > k:
            idx = np.sort(idx[np.argpartition(m[idx], idx.size - k)[idx.size - k:]])
        elif idx.size == 0:
            idx = np.array([int(m.argmax())])
        return torch.from_numpy(idx.astype(np.int64, copy=False))

    def encode(self, values: torch.Tensor, inner: Codec | None) -> dict[str, Any]:
        return self.encode_sent(values, inner)[0]  # the kept values' decode costs next to nothing

    def encode_sent(self, values: torch.Tensor, inner: Codec | None) -> tuple[dict[str, Any], Sent]:
        idx = self.select(values).numpy()
        return self._message(values.numel(), idx, torch.from_numpy(values.numpy()[idx]), inner)

    def encode_sent_device(self, values: torch.Tensor, inner: Codec | None
                           ) -> tuple[dict[str, Any], Sent, torch.Tensor | None]:
        """Exact top-k where ``values`` live (on a GPU ``torch.topk`` costs less than the sampled
        estimate's round trips to the host); only the kept values and their indices cross."""
        k = self.k(values.numel())
        idx = torch.topk(values.abs(), k, sorted=False).indices.sort().values
        kept = values[idx]
        msg, sent = self._message(values.numel(), idx.to("cpu").numpy(), kept.to("cpu"), inner)
        return msg, sent, idx

    def _message(self, n: int, idx: np.ndarray, kept_values: torch.Tensor, inner: Codec | None
                 ) -> tuple[dict[str, Any], Sent]:
        """The message of the values ``kept_values`` (on the host) at sorted positions ``idx`` of ``n``."""
        inner = inner or NoneCodec()
        inner_msg, kept = inner.encode_sent(kept_values, None)
        if kept.indices is not None:
            raise TypeError(f"topk's inner codec {inner.info.name!r} must encode every value it gets")
        deltas = idx.copy()
        deltas[1:] -= idx[:-1]  # np.diff(idx, prepend=0) without its overhead
        msg = {"c": "topk", "n": n, "k": int(idx.size), "i": varint_encode(deltas), "v": inner_msg}
        return msg, Sent(kept.values, idx)

    def decode(self, msg: dict[str, Any], inner_decode: Any) -> Sent:
        n = _count(msg, "topk")
        k = msg.get("k")
        if not isinstance(k, int) or not 0 <= k <= n:
            raise PayloadError(f"codec topk: field 'k' missing or not in 0..{n}: {k!r}")
        gaps = varint_decode(field_bytes(msg, "i", "topk"))
        if gaps.size != k:
            raise PayloadError(f"codec topk: {gaps.size} indices for k={k}")
        idx = np.cumsum(gaps)
        if k and (idx[-1] >= n or not gaps[1:].all()):  # gaps are >= 0: increasing means none is 0
            raise PayloadError(f"codec topk: indices out of range 0..{n - 1} or not increasing")
        inner = msg.get("v")
        if not isinstance(inner, dict):
            raise PayloadError("codec topk: field 'v' (the kept values) missing")
        vals = inner_decode(inner)
        if vals.indices is not None or vals.values.size != k:
            raise PayloadError(f"codec topk: {vals.values.size} values for k={k}")
        return Sent(vals.values, idx)
