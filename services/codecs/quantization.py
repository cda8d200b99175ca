"""``int8``: symmetric 8-bit quantization with one float32 scale per block of values."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import PayloadError
from .base import Codec, CodecInfo, Sent, expect_len, field_bytes
from .floating import _count

__all__ = ["Int8Codec"]


def _dequantize(q: np.ndarray, scales: np.ndarray, n: int, block: int) -> np.ndarray:
    """``n`` int8 values times their block's scale, as a new float32 array (what the receiver decodes)."""
    blocks = -(-n // block)
    if n == blocks * block:  # whole blocks (the usual shard): no padding, no copies
        return (q.reshape(blocks, block) * scales[:, None]).reshape(-1)
    out = np.zeros(blocks * block, dtype=np.float32)
    out[:n] = q
    out = out.reshape(blocks, block) * scales[:, None]
    return out.reshape(-1)[:n].copy()


class Int8Codec(Codec):
    """Each block of ``block`` values is scaled by its max |value| / 127 and rounded to int8."""

    info = CodecInfo("int8", lossy=True,
                     description="int8 with a float32 scale per block (default 256 values)")
    options = ("block",)

    def __init__(self, block: int = 256) -> None:
        if not isinstance(block, int) or block < 1 or block > 1 << 20:
            raise ValueError(f"int8 block must be an int in 1..{1 << 20}, got {block!r}")
        self.block = block

    def encode(self, values: torch.Tensor, inner: Codec | None) -> dict[str, Any]:
        return self._encode(values)[0]

    def encode_sent(self, values: torch.Tensor, inner: Codec | None) -> tuple[dict[str, Any], Sent]:
        msg, q, scales = self._encode(values)
        return msg, Sent(_dequantize(q, scales, values.numel(), self.block))

    def _encode(self, values: torch.Tensor) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        n = values.numel()
        blocks = -(-n // self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32)
        padded[:n] = values
        padded = padded.view(blocks, self.block)
        scales = padded.abs().amax(dim=1) / 127.0
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(padded / scales[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        q_np, scales_np = q.numpy(), scales.numpy()
        msg = {"c": "int8", "n": n, "b": self.block, "s": scales_np.tobytes(), "d": q_np.tobytes()}
        return msg, q_np, scales_np

    def decode(self, msg: dict[str, Any], inner_decode: Any) -> Sent:
        n = _count(msg, "int8")
        block = msg.get("b")
        if not isinstance(block, int) or block < 1 or block > 1 << 20:
            raise PayloadError(f"codec int8: field 'b' (block) missing or out of range: {block!r}")
        blocks = -(-n // block)
        scales = expect_len(field_bytes(msg, "s", "int8"), blocks, np.float32, "int8", "s")
        q = expect_len(field_bytes(msg, "d", "int8"), n, np.int8, "int8")
        return Sent(_dequantize(q, scales, n, block))
