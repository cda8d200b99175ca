"""Row gradients on the wire: what one update carries for one shard group's rows (pure).

:func:`encode_row_grads` and :func:`decode_row_grads` are the blob a push writes into each group's slot
that owns rows of the batch (``GroupKeys.rows_blob``); :func:`split_by_group` splits a table's rows by
owning group. See docs/parameter-plane.md, *Push: the blobs, then one atomic step*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from ..errors import BadGradientError, PayloadError
from ..wire import DEFAULT_MAX_BYTES, pack, unpack
from .rows import group_of_ids
from .spec import TableSpec

__all__ = ["RowGrads", "WIRE_DTYPES", "encode_row_grads", "decode_row_grads", "split_by_group"]

WIRE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
"""How gradient rows may travel."""
_TORCH = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class RowGrads:
    """The gradient rows of one table in one update (of one group's rows, on the wire)."""

    table: str
    """Table name."""
    ids: np.ndarray
    """Unique IDs, int64, strictly increasing."""
    grads: np.ndarray
    """``[len(ids), dim]`` gradient rows: float32, or already float16 (cast where they were computed)."""
    owners: np.ndarray | None = None
    """The shard group of each ID, when the caller has it (else :func:`split_by_group` computes it)."""


def split_by_group(part: RowGrads, groups: int) -> dict[int, RowGrads]:
    """``part`` split into the rows each group owns (each group's IDs stay increasing)."""
    if groups == 1:
        return {0: part}
    owner = part.owners if part.owners is not None else group_of_ids(part.ids, groups)
    order = np.argsort(owner, kind="stable")  # each group's IDs stay increasing
    cuts = np.searchsorted(owner[order], np.arange(groups + 1))
    out = {}
    for g in range(groups):
        at = order[cuts[g]:cuts[g + 1]]
        if at.size:
            out[g] = RowGrads(part.table, part.ids[at], part.grads[at])
    return out


def encode_row_grads(parts: Sequence[RowGrads], *, wire_dtype: str = "float32") -> bytes:
    """One group's blob of ``parts``.

    Raises:
        BadGradientError: a gradient is not finite, or overflows ``wire_dtype`` (names the table).
        ValueError: an unknown ``wire_dtype``, or shapes that disagree.
    """
    dt = WIRE_DTYPES.get(wire_dtype)
    if dt is None:
        raise ValueError(f"row gradients travel as {' or '.join(WIRE_DTYPES)}, not {wire_dtype!r}")
    out = []
    for p in parts:
        if p.grads.ndim != 2 or p.grads.shape[0] != p.ids.shape[0]:
            raise ValueError(f"table {p.table}: {p.ids.shape[0]} IDs but gradient rows of shape {p.grads.shape}")
        grads = torch.from_numpy(np.ascontiguousarray(p.grads))  # torch casts float16 ~10x faster than numpy
        wire = grads.to(_TORCH[wire_dtype])
        finite = torch.isfinite(wire)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            what = "NaN or infinite" if not bool(torch.isfinite(grads).all()) else f"overflowing {wire_dtype}"
            raise BadGradientError(f"gradient rows of table {p.table!r}: {bad} value(s) {what}")
        out.append([p.table, np.ascontiguousarray(p.ids, dtype="<i8").tobytes(), wire.numpy().tobytes(), wire_dtype])
    return pack({"t": out})


def decode_row_grads(blob: bytes, tables: Mapping[str, TableSpec], *, max_bytes: int = DEFAULT_MAX_BYTES,
                     what: str = "row gradients") -> list[RowGrads]:
    """The parts of one group's blob, checked against the model's ``tables``.

    Raises:
        PayloadError: not the documented form (malformed, truncated, sizes that disagree).
        BadGradientError: an unknown table, IDs not strictly increasing, or a value not finite.
    """
    msg = unpack(blob, max_bytes=max_bytes, what=what)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), list):
        raise PayloadError(f"{what}: expected a map with a list 't'")
    out = []
    seen = set()
    for entry in msg["t"]:
        if (not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], str)
                or not isinstance(entry[1], bytes) or not isinstance(entry[2], bytes) or entry[3] not in WIRE_DTYPES):
            raise PayloadError(f"{what}: each entry must be [table, ids bytes, grads bytes, "
                               f"{' or '.join(WIRE_DTYPES)}]")
        name, raw_ids, raw_grads, dtype = cast("tuple[str, bytes, bytes, str]", tuple(entry))
        spec = tables.get(name)
        if spec is None:
            raise BadGradientError(f"{what}: table {name!r} is not in the model (tables: {sorted(tables)})")
        if name in seen:
            raise PayloadError(f"{what}: table {name!r} appears twice")
        seen.add(name)
        if len(raw_ids) % 8:
            raise PayloadError(f"{what}: table {name!r}: {len(raw_ids)} bytes of IDs is not a multiple of 8")
        ids = np.frombuffer(raw_ids, dtype="<i8")
        dt = WIRE_DTYPES[dtype]
        if len(raw_grads) != ids.size * spec.dim * dt.itemsize:
            raise PayloadError(f"{what}: table {name!r}: {ids.size} IDs of dim {spec.dim} need "
                               f"{ids.size * spec.dim * dt.itemsize} bytes of {dtype}, got {len(raw_grads)}")
        if ids.size > 1 and not (ids[1:] > ids[:-1]).all():
            raise BadGradientError(f"{what}: table {name!r}: IDs must be unique and increasing")
        wire = torch.from_numpy(np.frombuffer(raw_grads, dtype=dt).reshape(ids.size, spec.dim).copy())
        finite = torch.isfinite(wire)
        if not bool(finite.all()):
            raise BadGradientError(f"{what}: table {name!r}: {int((~finite).sum())} NaN or infinite value(s)")
        grads = wire.float().numpy()
        out.append(RowGrads(name, ids, grads))
    return out
