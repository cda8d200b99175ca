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

    info = CodecInfo("none", lossy=False, sparsifier=False, description="float32, uncompressed")

    def encode(self, values: torch.Tensor, inner: Codec | None) -> dict[str, Any]:
        return {"c": "none", "n": values.numel(), "d": values.numpy().tobytes()}

    def encode_sent(self, values: torch.Tensor, inner: Codec | None) -> tuple[dict[str, Any], Sent]:
        return self.encode(values, inner), Sent(values.numpy())

    def decode(self, msg: dict[str, Any], inner_decode: Any) -> torch.Tensor:
        n = _count(msg, "none")
        arr = expect_len(field_bytes(msg, "d", "none"), n, np.float32, "none")
        return torch.from_numpy(arr.copy())


class Float16Codec(Codec):
    """IEEE half precision: 2 bytes per value; values beyond +-65504 become inf and are refused."""

    info = CodecInfo("fp16", lossy=True, sparsifier=False, description="float16, 2 bytes per value")

    def encode(self, values: torch.Tensor, inner: Codec | None) -> dict[str, Any]:
        return self._encode(values)[0]

    def encode_sent(self, values: torch.Tensor, inner: Codec | None) -> tuple[dict[str, Any], Sent]:
        msg, half = self._encode(values)
        return msg, Sent(half.to(torch.float32).numpy())

    @staticmethod
    def _encode(values: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        half = values.to(torch.float16)  # torch converts ~30x faster than numpy's astype
        return {"c": "fp16", "n": values.numel(), "d": half.numpy().tobytes()}, half

    def decode(self, msg: dict[str, Any], inner_decode: Any) -> torch.Tensor:
        n = _count(msg, "fp16")
        arr = expect_len(field_bytes(msg, "d", "fp16"), n, np.float16, "fp16")
        return torch.from_numpy(arr.copy()).to(torch.float32)  # copy: the bytes are read-only


class BFloat16Codec(Codec):
    """bfloat16: 2 bytes per value with float32's range, 8 bits of mantissa."""

    info = CodecInfo("bf16", lossy=True, sparsifier=False, description="bfloat16, 2 bytes per value")

    def encode(self, values: torch.Tensor, inner: Codec | None) -> dict[str, Any]:
        return self._encode(values)[0]

    def encode_sent(self, values: torch.Tensor, inner: Codec | None) -> tuple[dict[str, Any], Sent]:
        msg, half = self._encode(values)
        return msg, Sent(half.to(torch.float32).numpy())

    @staticmethod
    def _encode(values: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        half = values.to(torch.bfloat16)
        return {"c": "bf16", "n": values.numel(), "d": half.view(torch.int16).numpy().tobytes()}, half

    def decode(self, msg: dict[str, Any], inner_decode: Any) -> torch.Tensor:
        n = _count(msg, "bf16")
        arr = expect_len(field_bytes(msg, "d", "bf16"), n, np.int16, "bf16")
        return torch.from_numpy(arr.copy()).view(torch.bfloat16).to(torch.float32)
