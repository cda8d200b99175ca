"""A server group's shards in memory and the dense part of an apply: optimizer steps, then what to
publish for each changed shard (a delta, and the full bytes when :class:`~services.server.core.ServerCore`
says compact). ``docs/parameter-plane.md`` ("Apply") says why it is laid out so."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from ..codecs import Sent
from ..deltas import encode_delta
from ..errors import LayoutError
from ..optim import OptimizerConfig, clip_factor, sparse_steps, step
from ..protocol import group_of
from .apply import ShardWrite
from .core import ServerCore

__all__ = ["Changes", "Shard", "GroupState", "tensor_from", "steps", "merge", "shard_write"]

Changes = dict[int, list[np.ndarray | None]]
"""Shard -> the indices each step changed (None: all of them)."""


@dataclass
class Shard:
    """One of the group's shards, in memory."""

    params: torch.Tensor
    """Its values (contiguous float32: a view of row 0 of :attr:`GroupState.values`)."""
    opt: list[torch.Tensor]
    """Its optimizer state tensors (views of the following rows)."""
    step: int
    """Optimizer steps applied."""
    version: int
    """The model version that last changed it (compare-and-set)."""
    base: int
    """The model version of its full bytes in Redis."""
    delta_bytes: int
    """Bytes of its deltas published after ``base``."""
    offset: int = 0
    """Where its values start in the rows of :attr:`GroupState.values`."""


@dataclass
class GroupState:
    """The group's shards and optimizer state (the server's own; Redis has what it published)."""

    cursor: str = ""
    """Last update applied."""
    persisted: str = ""
    """Last update the persisted optimizer state includes."""
    version: int = 0
    """Newest model version seen."""
    shards: dict[int, Shard] = field(default_factory=dict)
    values: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), dtype=np.float32))
    """The group's shards one after another (float32, ``1 + slots`` rows): row 0 their values, row
    ``1 + s`` their optimizer state slot ``s``. The shards' tensors are views of it, so a sparse
    optimizer gathers and scatters the coordinates an update touches in every shard, values and
    state together, at once (:func:`services.optim.sparse_steps`)."""
    unpersisted: list[tuple[str, list[str]]] = field(default_factory=list)
    """(update id, gradient blob keys) of the updates applied since the last persist."""
    unpersisted_bytes: int = 0
    """Gradient bytes of those updates."""
    table_steps: dict[str, int] = field(default_factory=dict)
    """Embedding table -> its step count (updates that carried its gradient rows), as written
    with the group's rows (``GroupKeys.table_stats``)."""


def tensor_from(blob: bytes | None, out: np.ndarray, what: str) -> torch.Tensor:
    """``blob``'s float32 values copied into ``out``, as a tensor viewing ``out``."""
    numel = out.size
    if blob is None or len(blob) != 4 * numel:
        raise LayoutError(f"{what}: missing or {0 if blob is None else len(blob)} bytes, expected {4 * numel}")
    out[:] = np.frombuffer(blob, dtype=np.float32)
    return torch.from_numpy(out)


def steps(cfg: OptimizerConfig, st: GroupState, updates: Sequence[Mapping[int, Sent]], *, group: int,
          groups: int) -> Changes:
    """One optimizer step per update, in order, on the group's shards. A sparse optimizer steps
    all the shards an update touches at once (:func:`services.optim.sparse_steps`); a dense one
    goes shard by shard, so a shard's values and state stay in the CPU cache across the
    updates (the same math as update by update: a shard's steps keep their order, and each
    update's clipping factor is its own). Returns shard -> the indices each step changed
    (None: all of them)."""
    mine = [{i: d for i, d in decoded.items() if group_of(i, groups) == group} for decoded in updates]
    factors = [clip_factor(cfg, list(m.values())) for m in mine]
    changed: Changes = {}
    if cfg.sparse:
        for m, factor in zip(mine, factors, strict=True):
            parts = []
            for i in sorted(m):
                sh = st.shards[i]
                sh.step += 1
                parts.append((sh.offset, sh.params.numel(), m[i], sh.step))
                changed.setdefault(i, []).append(m[i].indices)
            sparse_steps(cfg, st.values, parts, factor)
        return changed
    for i in sorted({i for m in mine for i in m}):
        sh = st.shards[i]
        for m, factor in zip(mine, factors, strict=True):
            if i in m:
                sh.step += 1
                changed.setdefault(i, []).append(step(cfg, sh.params, m[i], sh.opt, sh.step, factor))
    return changed


def merge(touched: Changes, changed: Mapping[int, list[np.ndarray | None]]) -> None:
    """Add ``changed`` (a chunk's :func:`steps`) to ``touched`` (the batch's)."""
    for i, changes in changed.items():
        touched.setdefault(i, []).extend(changes)


def shard_write(core: ServerCore, st: GroupState, i: int, changes: list[np.ndarray | None]) -> ShardWrite:
    """What to publish for shard ``i`` after a batch changed it: a delta, and the full bytes when
    it is due for compaction (or changed everywhere)."""
    sh = st.shards[i]
    if any(c is None for c in changes):
        return ShardWrite(i, sh.version, delta=None, full=sh.params)
    if len(changes) == 1:
        idx = changes[0]
    else:  # the union of sorted index sets: a mask is ~10x cheaper than np.unique here
        mask = np.zeros(sh.params.numel(), dtype=bool)
        for c in changes:
            mask[c] = True
        idx = np.flatnonzero(mask)
    delta = encode_delta(cast(np.ndarray, idx), sh.params.numpy()[idx])
    compact = core.compact(delta_bytes=sh.delta_bytes, new_delta=len(delta), numel=sh.params.numel(),
                           base=sh.base, version=st.version + 1)
    return ShardWrite(i, sh.version, delta=delta, full=sh.params if compact else None)
