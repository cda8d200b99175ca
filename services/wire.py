"""msgpack on the wire, with strict limits on everything read from the network."""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import PayloadError

__all__ = ["pack", "unpack", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
"""Largest payload :func:`unpack` accepts unless told otherwise (256 MiB)."""

_MAX_ITEMS = 1 << 20


def pack(obj: Any) -> bytes:
    """Serialize ``obj`` (dicts, lists, ints, floats, str, bytes) to msgpack bytes."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, what: str = "payload") -> Any:
    """Deserialize one msgpack object from ``data`` with strict limits.

    Raises:
        PayloadError: ``data`` is larger than ``max_bytes``, truncated, has
            trailing bytes, or is not valid msgpack; the message names ``what``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"{what}: expected bytes, got {type(data).__name__}")
    size = len(data)
    if size > max_bytes:
        raise PayloadError(f"{what}: oversized, {size} bytes > limit {max_bytes}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True,
                               max_bin_len=size, max_str_len=min(size, 1 << 20),
                               max_array_len=min(size, _MAX_ITEMS), max_map_len=min(size, _MAX_ITEMS),
                               max_ext_len=0)
    except msgpack.ExtraData:
        raise PayloadError(f"{what}: trailing bytes after the msgpack object ({size} bytes)") from None
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        kind = "truncated" if "incomplete" in str(exc).lower() else "invalid"
        raise PayloadError(f"{what}: {kind} msgpack ({size} bytes): {exc}") from None
