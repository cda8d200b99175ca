"""How a model's tensors are split into parameter shards (pure; no Redis)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .errors import LayoutError

__all__ = ["TensorSpec", "ShardSpec", "Layout", "make_layout", "DEFAULT_SHARD_ELEMS"]

DEFAULT_SHARD_ELEMS = 1 << 18
"""Default shard size: 262144 float32 values (1 MiB)."""


@dataclass(frozen=True)
class TensorSpec:
    """One named model tensor."""

    name: str
    """Parameter name, e.g. ``fc1.weight``."""
    shape: tuple[int, ...]
    """Its shape."""

    @property
    def numel(self) -> int:
        """Number of values."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardSpec:
    """One parameter shard: a contiguous run of one tensor's flattened values."""

    index: int
    """Shard index, 0..n-1 in layout order."""
    name: str
    """The tensor it belongs to."""
    start: int
    """First flat element of the tensor it holds."""
    numel: int
    """Number of float32 values it holds."""


@dataclass(frozen=True)
class Layout:
    """All tensors of a model and their shards. Parameters are stored as float32."""

    tensors: tuple[TensorSpec, ...]
    """The model's tensors, in the order given at init."""
    shards: tuple[ShardSpec, ...]
    """Every shard, by index."""
    shard_elems: int
    """Largest shard size in values."""

    def tensor(self, name: str) -> TensorSpec:
        """The spec of tensor ``name`` (KeyError naming it when absent)."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor {name!r} in the model layout")

    def shards_of(self, name: str) -> list[ShardSpec]:
        """The shards of tensor ``name`` in order."""
        return [s for s in self.shards if s.name == name]

    @property
    def numel(self) -> int:
        """Total number of parameters."""
        return sum(t.numel for t in self.tensors)

    def to_json(self) -> str:
        """Canonical JSON (what is stored in the job's meta key)."""
        return json.dumps({"tensors": [[t.name, list(t.shape)] for t in self.tensors],
                           "shard_elems": self.shard_elems}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        """Inverse of :meth:`to_json`."""
        raw = json.loads(text)
        return make_layout([(n, tuple(s)) for n, s in raw["tensors"]], raw["shard_elems"])

    def describe_difference(self, other: Layout) -> str | None:
        """None when equal, else a sentence naming the first difference."""
        if self.shard_elems != other.shard_elems:
            return f"shard size {other.shard_elems} != stored {self.shard_elems}"
        mine = {t.name: t.shape for t in self.tensors}
        theirs = {t.name: t.shape for t in other.tensors}
        for name in sorted(set(mine) | set(theirs)):
            if name not in mine:
                return f"tensor {name!r} is not in the stored model"
            if name not in theirs:
                return f"tensor {name!r} of the stored model is missing"
            if mine[name] != theirs[name]:
                return f"tensor {name!r} has shape {list(theirs[name])}, stored {list(mine[name])}"
        if [t.name for t in self.tensors] != [t.name for t in other.tensors]:
            return "tensor order differs from the stored model"
        return None


def make_layout(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, tuple[int, ...]]],
                shard_elems: int = DEFAULT_SHARD_ELEMS) -> Layout:
    """Split named tensors (or ``(name, shape)`` pairs) into shards of at most ``shard_elems`` values.

    Raises:
        LayoutError: no tensors, a duplicate or empty name, or a non-floating tensor.
        ValueError: ``shard_elems`` is not a positive int.
    """
    if not isinstance(shard_elems, int) or shard_elems < 1:
        raise ValueError(f"shard_elems must be a positive int, got {shard_elems!r}")
    pairs: list[tuple[str, tuple[int, ...]]] = []
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, value in items:
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point():
                raise LayoutError(f"tensor {name!r} has dtype {value.dtype}; parameters must be floating point")
            shape = tuple(value.shape)
        else:
            shape = tuple(int(d) for d in value)
        if not isinstance(name, str) or not name:
            raise LayoutError(f"tensor names must be non-empty strings, got {name!r}")
        pairs.append((name, shape))
    if not pairs:
        raise LayoutError("a model needs at least one tensor")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise LayoutError(f"duplicate tensor names in {names}")
    specs = tuple(TensorSpec(n, s) for n, s in pairs)
    shards: list[ShardSpec] = []
    for t in specs:
        n = t.numel
        for start in range(0, max(n, 1), shard_elems):
            shards.append(ShardSpec(len(shards), t.name, start, min(shard_elems, n - start)))
    return Layout(specs, tuple(shards), shard_elems)
