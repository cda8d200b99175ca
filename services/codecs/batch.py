"""Decoding the top-k gradients of one update at once, in a few array operations for all its shards.

:func:`decode_sents` joins the shards' index and value bytes and decodes each once: the same arrays bit
for bit and the same checks as one by one (``topk+none``, ``topk+fp16``, ``topk+bf16``; otherwise it
answers None, and the caller decodes one by one, which names the shard at fault).
See docs/parameter-plane.md, *Apply: exactly once, with deltas, in two halves*.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import PayloadError
from ..wire import DEFAULT_MAX_BYTES, unpack
from .base import Sent
from .sparse import varint_decode

__all__ = ["decode_sents", "is_topk"]

_INNER: dict[str, tuple[type, torch.dtype | None]] = {
    "none": (np.float32, None),
    "fp16": (np.float16, torch.float16),
    "bf16": (np.int16, torch.bfloat16),
}
"""Value codec -> (numpy wire dtype, torch dtype its bits are; None: float32 as sent)."""


_TOPK_HEAD = b"\xa1c\xa4topk"
"""How a top-k message starts after its map header: its first key, ``"c": "topk"`` (as
:meth:`TopKCodec.encode_sent` builds it). Only a shortcut: a top-k message in another key order
is decoded one by one, as before."""


def is_topk(blob: bytes) -> bool:
    """Whether ``blob`` starts like a top-k message (what :func:`decode_sents` takes); a cheap
    look at its first bytes, nothing unpacked."""
    return blob[1:8] == _TOPK_HEAD


def decode_sents(blobs: Sequence[bytes], numels: Sequence[int], *,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> list[Sent] | None:
    """:func:`~services.codecs.registry.decode_sent` of each of ``blobs`` (``numels[j]`` values
    expected of blob ``j``), decoded together: bit-for-bit the same indices and values (each
    :class:`Sent`'s arrays are writable views of arrays shared by the batch).

    Returns:
        The decoded gradients, or None when one is not a ``topk`` gradient of one of the value
        codecs ``none``/``fp16``/``bf16`` (all of the same one), or ``decode_sent`` would refuse
        one: decode them one by one then (that raises the error, naming the shard).
    """
    if not blobs or len(blobs) != len(numels) or not all(is_topk(b) for b in blobs):
        return None  # not top-k: decoded one by one, without unpacking them twice
    msgs = []
    for blob in blobs:
        try:
            msgs.append(unpack(blob, max_bytes=max_bytes))
        except PayloadError:
            return None
    counts = _counts(msgs, numels)
    if counts is None:
        return None
    ks, ns, inner = counts
    idx = _indices([m["i"] for m in msgs], ks, ns)
    values = _values([m["v"]["d"] for m in msgs], inner)
    if idx is None or values.size != idx.size or not np.isfinite(values).all():
        return None
    ends = np.cumsum(ks)
    starts = ends - ks
    return [Sent(values[a:b], idx[a:b]) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


def _counts(msgs: list[Any], numels: Sequence[int]) -> tuple[np.ndarray, np.ndarray, str] | None:
    """(kept values, values) of each message, and their value codec; None when a message is not
    a well-formed ``topk`` message of ``numels[j]`` values, or the value codecs differ."""
    ks, inners = [], set()
    for msg, numel in zip(msgs, numels, strict=True):
        if not isinstance(msg, dict) or msg.get("c") != "topk":
            return None
        n, k, i, v = msg.get("n"), msg.get("k"), msg.get("i"), msg.get("v")
        if (not isinstance(n, int) or n != numel or n < 0 or not isinstance(k, int) or not 0 <= k <= n
                or not isinstance(i, bytes) or not isinstance(v, dict)):
            return None
        name, count, data = v.get("c"), v.get("n"), v.get("d")
        if (name not in _INNER or not isinstance(count, int) or count != k or not isinstance(data, bytes)
                or len(data) != k * np.dtype(_INNER[name][0]).itemsize):
            return None
        ks.append(k)
        inners.add(name)
    if len(inners) != 1:
        return None
    return np.array(ks, dtype=np.int64), np.array(numels, dtype=np.int64), inners.pop()


def _indices(streams: list[bytes], ks: np.ndarray, ns: np.ndarray) -> np.ndarray | None:
    """Every message's sorted positions, concatenated (each its own, from 0), or None when
    ``TopKCodec.decode`` would refuse one: a truncated varint, a count other than ``k``,
    positions out of range or not increasing."""
    lengths = np.array([len(s) for s in streams], dtype=np.int64)
    stops = np.cumsum(lengths)
    data = b"".join(streams)
    if not data:
        return np.zeros(0, dtype=np.int64) if not ks.any() else None
    raw = np.frombuffer(data, dtype=np.uint8)
    nonempty = lengths > 0
    if (raw[stops[nonempty] - 1] & 0x80).any():
        return None  # a stream ends inside a varint: its last value would run into the next stream
    try:
        gaps = varint_decode(data)
    except PayloadError:
        return None
    # each stream ends on a value's last byte, so the values split at the streams' ends
    per_stream = np.diff(np.searchsorted(np.flatnonzero(raw < 0x80), stops), prepend=0)
    if gaps.size != int(ks.sum()) or not np.array_equal(per_stream, ks):
        return None
    total = np.cumsum(gaps)
    firsts = np.cumsum(ks) - ks  # each message's first value in the concatenation
    kept = ks > 0
    before = np.zeros(ks.size, dtype=np.int64)  # the running sum before each message's first gap
    before[kept] = total[firsts[kept]] - gaps[firsts[kept]]
    idx = total - np.repeat(before, ks)
    lasts = firsts[kept] + ks[kept] - 1
    zero = gaps == 0  # only a message's first gap may be 0: otherwise not increasing
    zero[firsts[kept]] = False
    if (idx[lasts] >= ns[kept]).any() or zero.any():
        return None
    return idx


def _values(parts: list[bytes], inner: str) -> np.ndarray:
    """Every message's kept values as float32, concatenated, converted as its value codec does
    (each message's byte count is checked by :func:`_counts`)."""
    wire, dtype = _INNER[inner]
    data = b"".join(parts)
    arr: np.ndarray = np.frombuffer(data, dtype=wire)
    if dtype is None:
        return arr.copy()  # the message bytes are read-only
    return torch.from_numpy(arr.copy()).view(dtype).to(torch.float32).numpy()
