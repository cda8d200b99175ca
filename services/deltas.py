"""Versioned deltas: the coordinates one group version changed in one shard, and their new values.

One delta per shard an apply changed (``GroupKeys.deltas(i)``, entry ``<group version>-0``), msgpack
``{"i": indices, "v": values}`` with the indices delta + LEB128-varint encoded; a delta carries new
values, not increments, so applying one twice changes nothing. See docs/parameter-plane.md, *Redis data
model* and *Pulls and snapshots: one version per group (invariant 3)*.
"""

from __future__ import annotations

import numpy as np
import torch

from .codecs.sparse import varint_decode, varint_encode
from .errors import PayloadError
from .wire import pack, unpack

__all__ = ["encode_delta", "decode_delta", "apply_deltas", "delta_version"]


def encode_delta(indices: np.ndarray, values: np.ndarray) -> bytes:
    """The delta setting ``values`` (float32) at the sorted, unique ``indices``."""
    gaps = indices.astype(np.int64, copy=True)
    gaps[1:] -= indices[:-1]
    return pack({"i": varint_encode(gaps), "v": np.ascontiguousarray(values, dtype=np.float32).tobytes()})


def decode_delta(blob: bytes, numel: int, what: str = "delta") -> tuple[np.ndarray, np.ndarray]:
    """(indices, values) of a delta of a ``numel``-value shard.

    Raises:
        PayloadError: malformed, or indices outside the shard or not increasing.
    """
    msg = unpack(blob, what=what)
    if not isinstance(msg, dict) or not isinstance(msg.get("i"), bytes) or not isinstance(msg.get("v"), bytes):
        raise PayloadError(f"{what}: expected a map with bytes fields 'i' and 'v'")
    gaps = varint_decode(msg["i"], codec=what)
    if len(msg["v"]) != 4 * gaps.size:
        raise PayloadError(f"{what}: {gaps.size} indices but {len(msg['v'])} bytes of float32 values")
    idx = np.cumsum(gaps)
    if idx.size and (idx[-1] >= numel or not gaps[1:].all()):  # gaps are >= 0: increasing means none is 0
        raise PayloadError(f"{what}: indices outside 0..{numel - 1} or not increasing")
    return idx, np.frombuffer(msg["v"], dtype=np.float32)


def delta_version(entry_id: bytes | str) -> int:
    """The group version of a delta stream entry (its id is ``<group version>-0``)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def apply_deltas(flat: torch.Tensor, entries: list[tuple[bytes, dict[bytes, bytes]]], *, after: int,
                 upto: int, what: str = "delta") -> int:
    """Write the deltas of ``entries`` (a shard's stream, in order) with versions in
    (``after``, ``upto``] into ``flat`` (the shard's values, any device), in order.

    Returns:
        The bytes of the deltas applied.
    """
    moved = 0
    for entry_id, fields in entries:
        version = delta_version(entry_id)
        if version <= after or version > upto:
            continue
        blob = fields[b"d"]
        idx, values = decode_delta(blob, flat.numel(), what=f"{what} at version {version}")
        moved += len(blob)
        if flat.device.type == "cpu":
            flat.detach().numpy()[idx] = values
        else:
            flat[torch.from_numpy(idx).to(flat.device)] = torch.from_numpy(values.copy()).to(flat.device)
    return moved
