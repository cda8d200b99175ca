"""The abstract gradient codec and its frozen description.

A :class:`Codec` turns a 1-D float32 tensor into a msgpack-ready dict naming its codec (``"c"``) and
value count (``"n"``), so receivers decode by the names inside; ``encode_sent`` also returns what a
receiver will decode (:class:`Sent`), for the trainer's error feedback. Input is checked first by
:func:`check_input` (float32, finite). See docs/parameter-plane.md, *Codecs*.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from ..errors import BadGradientError, PayloadError
from ..names import SPARSIFIERS

__all__ = ["Codec", "CodecInfo", "Sent", "check_input", "field_bytes", "expect_len"]


@dataclass(frozen=True)
class CodecInfo:
    """What a codec is."""

    name: str
    """Registry name, one part of a chain like ``topk+fp16``."""
    lossy: bool
    """True when decode(encode(x)) may differ from x."""
    description: str
    """One line for ``--help`` and the docs."""

    @property
    def sparsifier(self) -> bool:
        """True when it keeps a subset of values and wraps an inner value codec (its name is one of
        :data:`services.names.SPARSIFIERS`, which the coordinator reads without importing codecs)."""
        return self.name in SPARSIFIERS


@dataclass(frozen=True)
class Sent:
    """What a receiver decodes from one encoded gradient, without decoding it."""

    values: np.ndarray
    """float32 values exactly as the receiver will decode them (one per index); may share
    memory with the encoder's input, so read, do not modify."""
    indices: np.ndarray | None = None
    """Sorted int64 positions of ``values``, zero everywhere else; None: every position."""

    def dense(self, numel: int) -> np.ndarray:
        """All ``numel`` values as one float32 array (a new array when sparse)."""
        if self.indices is None:
            return self.values
        out = np.zeros(numel, dtype=np.float32)
        out[self.indices] = self.values
        return out


class Codec(ABC):
    """A gradient codec. Subclasses set ``info`` and accept their options as keywords."""

    info: ClassVar[CodecInfo]
    options: ClassVar[tuple[str, ...]] = ()
    """Keyword options the constructor accepts (e.g. ``density``)."""

    @abstractmethod
    def encode(self, values: torch.Tensor, inner: Codec | None) -> dict[str, Any]:
        """Encode a contiguous 1-D float32 tensor into a msgpack-ready dict."""

    def encode_sent(self, values: torch.Tensor, inner: Codec | None) -> tuple[dict[str, Any], Sent]:
        """:meth:`encode`, plus what the receiver will decode from the result (for error feedback).

        This default decodes the message; codecs override it with something cheaper
        that gives bit-for-bit the same values.
        """
        if inner is not None:
            raise TypeError(f"{type(self).__name__} must override encode_sent to wrap an inner codec")
        msg = self.encode(values, None)
        return msg, self.decode(msg, None)

    def encode_sent_device(self, values: torch.Tensor, inner: Codec | None
                           ) -> tuple[dict[str, Any], Sent, torch.Tensor | None]:
        """:meth:`encode_sent` of a contiguous 1-D float32 tensor on an accelerator, and the positions
        kept as a tensor on that device (None: every position). This default copies every value to
        the host and encodes there (a dense codec sends every value anyway); a sparsifier selects on
        the device, so that only the kept values and their indices cross."""
        msg, sent = self.encode_sent(values.to("cpu"), inner)
        return msg, sent, None

    @abstractmethod
    def decode(self, msg: dict[str, Any], inner_decode: Any) -> Sent:
        """Decode ``msg`` (already size-checked) into the values it carries: every value
        (``indices`` None), or a sparsifier's kept values and their positions. The arrays
        are new (writable) float32 and int64 arrays.

        ``inner_decode(dict) -> Sent`` decodes a nested message (sparsifiers).

        Raises:
            PayloadError: a field is missing or has the wrong length.
        """


def field_bytes(msg: dict[str, Any], key: str, codec: str) -> bytes:
    """``msg[key]`` as bytes, or PayloadError naming the codec and field."""
    value = msg.get(key)
    if not isinstance(value, bytes):
        raise PayloadError(f"codec {codec}: field {key!r} missing or not bytes")
    return value


def expect_len(data: bytes, count: int, dtype: npt.DTypeLike, codec: str, key: str = "d") -> np.ndarray:
    """``data`` viewed as ``count`` values of ``dtype``, or PayloadError on a length mismatch."""
    want = count * np.dtype(dtype).itemsize
    if len(data) != want:
        raise PayloadError(f"codec {codec}: field {key!r} has {len(data)} bytes, expected {want} "
                           f"for {count} values of {np.dtype(dtype).name}")
    return np.frombuffer(data, dtype=dtype)


def check_input(values: torch.Tensor, *, finite: bool = True) -> torch.Tensor:
    """What an encoder gets, flattened to a contiguous 1-D CPU float32 tensor, after checking it is
    float32 and (unless ``finite`` is False: the caller has checked) holds no NaN or infinity.

    Raises:
        BadGradientError: another dtype, or NaN/inf values (the message counts them).
    """
    if values.dtype != torch.float32:
        raise BadGradientError(f"codec input must be float32, got {values.dtype}")
    flat = values.detach().to("cpu").reshape(-1).contiguous()
    if finite:
        ok = np.isfinite(flat.numpy())  # numpy's check is ~10x cheaper than torch.isfinite here
        if not ok.all():
            raise BadGradientError(f"codec input has {int((~ok).sum())} NaN or infinite value(s)")
    return flat
