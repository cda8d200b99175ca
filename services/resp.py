"""Many command arguments of one size packed at once (numpy, not one Python call per argument).

A server's load of its rows is one ``HMGET`` per table with thousands of 8-byte
fields. redis-py's serializer packs each argument in Python (about 1 µs each:
85 ms for 77,000 fields, longer than Redis takes to answer), so the parameter
plane's client (``services.store.connect``) uses :class:`Packer`, which splices
a :class:`PackedArgs` argument, packed by numpy in one pass, into the command
as it is. Every other argument is packed as redis-py packs it, and the bytes
on the wire are the same either way (``tests/test_services_tables_rows.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from redis.connection import PythonRespSerializer

__all__ = ["PackedArgs", "Packer", "mark_bulk", "id_args", "pair_args", "arg_count"]

_MARK = "_streamtrain_packs_bulk"


class PackedArgs:
    """``count`` command arguments already in the Redis protocol (``$<len>\\r\\n<bytes>\\r\\n`` each)."""

    def __init__(self, count: int, resp: bytes) -> None:
        self.count = count
        self.resp = resp

    @classmethod
    def ids(cls, ids: np.ndarray) -> PackedArgs:
        """Each of ``ids`` as an argument of its 8 little-endian bytes (hash fields of rows)."""
        out = np.empty(len(ids), dtype=[("head", "S4"), ("id", "<i8"), ("end", "S2")])
        out["head"] = b"$8\r\n"
        out["id"] = ids
        out["end"] = b"\r\n"
        return cls(len(ids), out.tobytes())

    @classmethod
    def pairs(cls, ids: np.ndarray, records: bytes, size: int) -> PackedArgs:
        """Field/value arguments of a hash: each of ``ids`` (8 little-endian bytes), then its record of
        ``size`` bytes (``records``: the records concatenated in ``ids`` order)."""
        n = len(ids)
        if len(records) != n * size:
            raise ValueError(f"{len(records)} bytes of records for {n} IDs of {size} bytes each")
        head = b"$%d\r\n" % size
        out = np.empty(n, dtype=[("head", "S4"), ("id", "<i8"), ("end", "S2"), ("size", f"S{len(head)}"),
                                 ("record", f"V{size}"), ("record_end", "S2")])
        out["head"] = b"$8\r\n"
        out["id"] = ids
        out["end"] = b"\r\n"
        out["size"] = head
        out["record"] = np.frombuffer(records, dtype=f"V{size}")
        out["record_end"] = b"\r\n"
        return cls(2 * n, out.tobytes())

    def __repr__(self) -> str:  # redis-py names a failed command's arguments: not megabytes of them
        return f"<{self.count} packed arguments>"


class Packer(PythonRespSerializer):
    """redis-py's serializer, splicing :class:`PackedArgs` arguments in as they are."""

    def pack(self, *args: Any) -> list[bytes]:
        if not any(isinstance(a, PackedArgs) for a in args):
            return super().pack(*args)
        count = sum(a.count if isinstance(a, PackedArgs) else 1 for a in args)
        out = [b"*%d\r\n" % count]
        for a in args:
            if isinstance(a, PackedArgs):
                out.append(a.resp)
            else:
                arg = self.encode(a)
                out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        return out


def mark_bulk(client: Any) -> None:
    """Note that ``client`` packs its commands with a :class:`Packer` (``services.store.connect``)."""
    setattr(client, _MARK, True)


def id_args(client: Any, ids: np.ndarray) -> PackedArgs | list[bytes]:
    """``ids`` as command arguments (8 little-endian bytes each) for ``client``: packed at once when its
    packer takes them (:func:`mark_bulk`), else one bytes object each (any other redis-py client)."""
    if getattr(client, _MARK, False):
        return PackedArgs.ids(ids)
    return list(np.ascontiguousarray(ids, dtype="<i8").view("V8").tolist())


def pair_args(client: Any, ids: np.ndarray, records: bytes, size: int) -> PackedArgs | list[bytes]:
    """Field/value arguments of a hash (each of ``ids``, then its ``size``-byte record of ``records``) for
    ``client``: packed at once when its packer takes them (:func:`mark_bulk`), else one bytes object each."""
    if getattr(client, _MARK, False):
        return PackedArgs.pairs(ids, records, size)
    fields = list(np.ascontiguousarray(ids, dtype="<i8").view("V8").tolist())
    values = [records[size * k:size * (k + 1)] for k in range(len(fields))]
    return [x for kv in zip(fields, values, strict=True) for x in kv]


def arg_count(args: PackedArgs | list[bytes]) -> int:
    """How many command arguments ``args`` are."""
    return args.count if isinstance(args, PackedArgs) else len(args)
