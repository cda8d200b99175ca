"""Dense floating-point codecs: ``none`` (fp32), ``fp16`` and ``bf16``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import Codec, CodecInfo, Sent, expect_len, field_bytes

__all__ = ["NoneCodec", "Float16Codec", "BFloat16Codec"]


def _count(msg: dict[str, Any], codec: str) -> int:
    from ..errors import PayloadError
    n = msg.get("n")
    if not isinstance(n, int) or n < 0:
        raise PayloadError(f"codec {codec}: field 'n' missing or not a count")
    return n


class NoneCodec(Codec):
    """Raw little-endian float32: the baseline every other codec is measured against."""

    info = CodecInfo("none", lossy=False, description="float32, uncompressed")

    def encode(self, values: torch.Tensor, inner: Codec | None) -> dict[str, Any]:
        return {"c": "none", "n": values.numel(), "d": values.numpy().tobytes()}

    def encode_sent(self, values: torch.Tensor, inner: Codec | None) -> tuple[dict[str, Any], Sent]:
        return self.encode(values, inner), Sent(values.numpy())

    def decode(self, msg: dict[str, Any], inner_decode: Any) -> Sent:
        n = _count(msg, "none")
        return Sent(expect_len(field_bytes(msg, "d", "none"), n, np.float32, "none").copy())


class _HalfCodec(Codec):
    """Two bytes per value: the values cast to ``dtype``, sent as the bytes of ``wire`` (numpy has
    no bfloat16, so bf16 travels as int16 bit patterns)."""

    dtype: torch.dtype
    wire_torch: torch.dtype
    wire_numpy: type

    def encode(self, values: torch.Tensor, inner: Codec | None) -> dict[str, Any]:
        return self._encode(values)[0]

    def encode_sent(self, values: torch.Tensor, inner: Codec | None) -> tuple[dict[str, Any], Sent]:
        msg, half = self._encode(values)
        return msg, Sent(half.to(torch.float32).numpy())

    def _encode(self, values: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        half = values.to(self.dtype)  # torch converts ~30x faster than numpy's astype
        data = half.view(self.wire_torch).numpy().tobytes()
        return {"c": self.info.name, "n": values.numel(), "d": data}, half

    def decode(self, msg: dict[str, Any], inner_decode: Any) -> Sent:
        name = self.info.name
        n = _count(msg, name)
        arr = expect_len(field_bytes(msg, "d", name), n, self.wire_numpy, name)
        # copy: the message bytes are read-only
        return Sent(torch.from_numpy(arr.copy()).view(self.dtype).to(torch.float32).numpy())


class Float16Codec(_HalfCodec):
    """IEEE half precision: 2 bytes per value; values beyond +-65504 become inf and are refused."""

    info = CodecInfo("fp16", lossy=True, description="float16, 2 bytes per value")
    dtype = wire_torch = torch.float16
    wire_numpy = np.float16


class BFloat16Codec(_HalfCodec):
    """bfloat16: 2 bytes per value with float32's range, 8 bits of mantissa."""

    info = CodecInfo("bf16", lossy=True, description="bfloat16, 2 bytes per value")
    dtype = torch.bfloat16
    wire_torch = torch.int16
    wire_numpy = np.int16
