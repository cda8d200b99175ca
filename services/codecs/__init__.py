"""Gradient codecs by name: ``none``, ``fp16``, ``bf16``, ``int8``, ``topk`` and chains like ``topk+fp16``."""

from .base import Codec, CodecInfo, Sent
from .registry import CODECS, CodecChain, Encoded, decode_gradient, decode_sent, get_codec, register

__all__ = [
    # registry
    "get_codec",
    "decode_gradient",
    "decode_sent",
    "register",
    "CODECS",
    # types
    "Codec",
    "CodecChain",
    "CodecInfo",
    "Encoded",
    "Sent",
]
