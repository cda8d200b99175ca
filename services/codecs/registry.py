"""Codecs by name, and chains of them (``topk+fp16``).

``get_codec(name)`` returns a :class:`CodecChain` that encodes a tensor to
msgpack bytes and reports their size; :func:`decode_gradient` decodes any
gradient by the codec names recorded inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import BadGradientError, PayloadError, UnknownCodecError
from ..wire import DEFAULT_MAX_BYTES, pack, unpack
from .base import Codec, Sent, check_input
from .floating import BFloat16Codec, Float16Codec, NoneCodec
from .quantization import Int8Codec
from .sparse import TopKCodec

__all__ = ["CODECS", "CodecChain", "Encoded", "get_codec", "decode_gradient", "decode_sent", "register"]

CODECS: dict[str, type[Codec]] = {}
"""Registered codec classes by name."""

_DECODERS: dict[str, Codec] = {}
"""One instance per registered codec for decoding (decode reads everything from the message;
building a codec per gradient cost more than decoding it)."""


def register(cls: type[Codec]) -> type[Codec]:
    """Register codec class ``cls`` under ``cls.info.name`` (usable as a decorator)."""
    name = cls.info.name
    if name in CODECS or "+" in name:
        raise ValueError(f"codec name {name!r} is taken or contains '+'")
    CODECS[name] = cls
    _DECODERS[name] = cls()
    return cls


for _cls in (NoneCodec, Float16Codec, BFloat16Codec, Int8Codec, TopKCodec):
    register(_cls)
_EXPECTED = ("none", "fp16", "bf16", "int8", "topk")
if set(CODECS) != set(_EXPECTED):  # the registry is checked at import
    raise ImportError(f"codec registry mismatch: {sorted(CODECS)} != {sorted(_EXPECTED)}")


@dataclass(frozen=True)
class Encoded:
    """One encoded gradient shard."""

    data: bytes
    """msgpack bytes as they go on the wire."""
    numel: int
    """Number of float32 values it decodes to."""

    @property
    def nbytes(self) -> int:
        """Bytes this shard puts on the wire."""
        return len(self.data)


class CodecChain:
    """One sparsifier (optional) followed by one value codec, built by :func:`get_codec`."""

    def __init__(self, name: str, parts: list[Codec]) -> None:
        self.name = name
        self.parts = parts

    def __repr__(self) -> str:
        return f"CodecChain({self.name!r})"

    @property
    def lossy(self) -> bool:
        """True when any part is lossy (the encoder then keeps an error-feedback residual)."""
        return any(p.info.lossy for p in self.parts)

    def encode_dict(self, values: torch.Tensor, *, check_finite: bool = True) -> dict[str, Any]:
        """Encode to the msgpack-ready dict (see :meth:`encode`)."""
        return self.parts[0].encode(check_input(values, finite=check_finite), self._inner)

    def encode(self, values: torch.Tensor, *, check_finite: bool = True) -> Encoded:
        """Encode a float32 tensor (any shape, flattened) to wire bytes.

        ``check_finite=False`` skips the NaN/inf check, for a caller that has made it already
        (:class:`~services.Pusher`) or a test that builds a bad payload on purpose.

        Raises:
            BadGradientError: not float32, or NaN/inf values (a receiver would refuse them).
        """
        return Encoded(pack(self.encode_dict(values, check_finite=check_finite)), values.numel())

    def encode_sent(self, values: torch.Tensor, *, check_finite: bool = True) -> tuple[Encoded, Sent]:
        """:meth:`encode`, plus what :func:`decode_gradient` will return for the bytes, in a
        cheap form (the trainer's error feedback subtracts it without decoding)."""
        msg, sent = self.parts[0].encode_sent(check_input(values, finite=check_finite), self._inner)
        return Encoded(pack(msg), values.numel()), sent

    def encode_sent_device(self, values: torch.Tensor) -> tuple[Encoded, Sent, torch.Tensor | None]:
        """:meth:`encode_sent` of a contiguous 1-D float32 tensor on an accelerator, checked finite
        by the caller: a sparsifier selects there and only the kept values and their indices cross
        to the host. Also returns the kept positions on the device (None: every position), for the
        caller's error feedback to stay there."""
        if values.dtype != torch.float32:
            raise BadGradientError(f"codec input must be float32, got {values.dtype}")
        msg, sent, idx = self.parts[0].encode_sent_device(values.reshape(-1).contiguous(), self._inner)
        return Encoded(pack(msg), values.numel()), sent, idx

    @property
    def _inner(self) -> Codec | None:
        return self.parts[1] if len(self.parts) > 1 else None


def get_codec(name: str, **options: Any) -> CodecChain:
    """The codec chain ``name`` (``none``, ``fp16``, ``bf16``, ``int8``, ``topk``,
    ``topk+fp16``, ``topk+bf16``, ``topk+int8``...), with codec options such as
    ``density=0.01`` (topk) or ``block=256`` (int8).

    Raises:
        UnknownCodecError: a part of ``name`` is not registered, or the chain is
            not *one optional sparsifier then one value codec*.
        ValueError: an option is unknown or out of range.
    """
    if not isinstance(name, str) or not name:
        raise UnknownCodecError(f"codec name must be a non-empty string, got {name!r}")
    names = name.split("+")
    unknown = [n for n in names if n not in CODECS]
    if unknown:
        raise UnknownCodecError(f"unknown codec {unknown[0]!r} in {name!r}; "
                                f"known: {', '.join(sorted(CODECS))}")
    classes = [CODECS[n] for n in names]
    ok = (len(classes) == 1) or (len(classes) == 2 and classes[0].info.sparsifier
                                  and not classes[1].info.sparsifier)
    if not ok:
        raise UnknownCodecError(f"codec chain {name!r} must be one optional sparsifier "
                                "followed by one value codec (e.g. topk+fp16)")
    known = {o for c in classes for o in c.options}
    extra = set(options) - known
    if extra:
        raise ValueError(f"unknown option(s) {sorted(extra)} for codec {name!r}; known: {sorted(known)}")
    parts = [c(**{k: v for k, v in options.items() if k in c.options}) for c in classes]
    if len(parts) == 1 and parts[0].info.sparsifier:
        parts.append(NoneCodec())
    return CodecChain(name, parts)


def _decode_dict(msg: Any) -> Sent:
    if not isinstance(msg, dict):
        raise PayloadError(f"gradient: expected a msgpack map, got {type(msg).__name__}")
    name = msg.get("c")
    codec = _DECODERS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise UnknownCodecError(f"gradient uses unknown codec {name!r}; known: {', '.join(sorted(CODECS))}")
    return codec.decode(msg, _decode_dict)


def decode_sent(data: bytes, *, numel: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                what: str = "gradient") -> Sent:
    """Decode one encoded gradient into the values it carries, sparse as it was sent
    (a top-k gradient stays its kept indices and values), and validate it.

    Raises:
        PayloadError: truncated/oversized/malformed bytes.
        UnknownCodecError: a codec named inside is not registered.
        BadGradientError: it has ``!= numel`` values or NaN/inf values (named by ``what``).
    """
    return _decode(data, numel, max_bytes, what)[0]


def decode_gradient(data: bytes, *, numel: int | None = None,
                    max_bytes: int = DEFAULT_MAX_BYTES, what: str = "gradient") -> torch.Tensor:
    """:func:`decode_sent` as one dense 1-D float32 tensor."""
    sent, count = _decode(data, numel, max_bytes, what)
    return torch.from_numpy(sent.dense(count))


def _decode(data: bytes, numel: int | None, max_bytes: int, what: str) -> tuple[Sent, int]:
    msg = unpack(data, max_bytes=max_bytes, what=what)
    sent = _decode_dict(msg)
    count = msg["n"]  # every codec checked its "n"
    if numel is not None and count != numel:
        raise BadGradientError(f"{what}: has {count} values, expected {numel}")
    finite = np.isfinite(sent.values)  # numpy's check is ~10x cheaper than torch.isfinite here
    if not finite.all():
        bad = int((~finite).sum())
        raise BadGradientError(f"{what}: {bad} NaN or infinite value(s)")
    return sent, count
