"""Gradient codecs by name: ``none``, ``fp16``, ``bf16``, ``int8``, ``topk`` and chains like ``topk+fp16``."""

from .adaptive import DEFAULT_DENSE_BELOW, SizeAdaptive, warmup_density
from .base import Codec, CodecInfo, Sent
from .batch import decode_sents, is_topk
from .registry import CODECS, CodecChain, Encoded, decode_gradient, decode_sent, get_codec, register

__all__ = [
    # registry
    "get_codec",
    "decode_gradient",
    "decode_sent",
    "decode_sents",
    "is_topk",
    "register",
    "CODECS",
    # per-tensor choice
    "SizeAdaptive",
    "warmup_density",
    "DEFAULT_DENSE_BELOW",
    # types
    "Codec",
    "CodecChain",
    "CodecInfo",
    "Encoded",
    "Sent",
]
