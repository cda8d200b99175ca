"""Exporting a job's model: a consistent snapshot at one version, as named tensors and as safetensors.

The one place that turns what Redis holds into a model file, used by ``GET /v1/model``
(``coordinator/model_route.py``) and ``streamtrain export`` (``cli_export.py``). Each group is read in one
MULTI/EXEC of its slot (``services.slots.GroupSlot``) and rebuilt at its version in the model version
the export names (``services.slot_types.VersionVector``). Version names, which versions Redis retains and
why: ``docs/serving.md`` (*Version names*, *Which versions can be exported*).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import redis
import torch
from safetensors.torch import save as _save_safetensors

from ..deltas import apply_deltas
from ..errors import LayoutError, NoModelError, ParameterPlaneError
from ..slot_types import BadVersionError, VersionVector
from ..slots import GroupRead, GroupSlot, ModelMeta, read_meta

logger = logging.getLogger(__name__)

__all__ = [
    "Retained",
    "retained",
    "resolve_version",
    "snapshot",
    "to_safetensors_bytes",
    "export_model",
    "ExportError",
    "NoModelError",
    "BadVersionError",
    "VersionNotFoundError",
    "VersionGoneError",
]

_ATTEMPTS = 5

GroupVersions = tuple[int, ...]
"""A model version: the version of each shard group, group 0's first (a :class:`VersionVector`)."""


class ExportError(ParameterPlaneError):
    """Base of the errors of an export."""


class VersionNotFoundError(ExportError):
    """The requested version is newer than the job's current model version (some group has not
    reached its version yet)."""

    def __init__(self, message: str, *, version: GroupVersions, current: GroupVersions) -> None:
        super().__init__(message)
        self.version = version
        """The version asked for."""
        self.current = current
        """The job's current model version."""


class VersionGoneError(ExportError):
    """The requested version is older than what Redis retains: compaction rewrote a shard of some
    group past it. ``oldest`` is the oldest version that can still be exported."""

    def __init__(self, message: str, *, version: GroupVersions, oldest: GroupVersions,
                 current: GroupVersions) -> None:
        super().__init__(message)
        self.version = version
        """The version asked for."""
        self.oldest = oldest
        """The oldest version still available (each group's oldest)."""
        self.current = current
        """The job's current model version."""


@dataclass(frozen=True)
class Retained:
    """The model versions of a job that can be exported: every vector between ``oldest`` and
    ``current``, group by group."""

    current: GroupVersions
    """Each group's current version (what an export without a version returns)."""
    oldest: GroupVersions
    """Each group's oldest version still rebuildable (the largest base among its shards)."""


def resolve_version(job: str, requested: Sequence[int] | None, kept: Retained) -> GroupVersions:
    """The version an export of ``requested`` (None: the current one) returns.

    A version some group can no longer rebuild is gone (410), even if another group has not
    reached its version yet: it will never be available.

    Raises:
        ValueError: ``requested`` is not one non-negative int per group.
        VersionGoneError: some group's version is older than that group's oldest retained one.
        VersionNotFoundError: some group's version is newer than its current one.
    """
    if requested is None:
        return kept.current
    want = VersionVector.check(requested, len(kept.current))
    name, current, oldest = want.name(), VersionVector(kept.current).name(), VersionVector(kept.oldest).name()
    if not want.covers(kept.oldest):
        raise VersionGoneError(f"job {job}: model version {name} is no longer retained (compacted); the oldest "
                               f"version available is {oldest}, the current {current}",
                               version=want, oldest=kept.oldest, current=kept.current)
    if not VersionVector(kept.current).covers(want):
        raise VersionNotFoundError(f"job {job} has no model version {name} yet: the current version is "
                                   f"{current}", version=want, current=kept.current)
    return want


def _requested(version: str | Sequence[int] | None, groups: int, job: str) -> GroupVersions | None:
    """``version`` as group versions: a name is parsed (``VersionVector.parse``)."""
    if version is None:
        return None
    if isinstance(version, str):
        return VersionVector.parse(version, groups, job=job)
    return VersionVector.check(version, groups)


def retained(client: redis.Redis, job: str) -> Retained:
    """Which versions of ``job`` can be exported now: the meta, then each group's version and
    bases (one MULTI/EXEC per group: two small keys).

    Raises:
        NoModelError: the job has no model.
    """
    meta = read_meta(client, job)
    reads = [GroupSlot.of(client, job, meta, g).read("version", "bases") for g in range(meta.groups)]
    return Retained(VersionVector(r.version for r in reads), VersionVector(max(r.bases.values(), default=0)
                                                                           for r in reads))


def snapshot(client: redis.Redis, job: str, version: str | Sequence[int] | None = None
             ) -> tuple[GroupVersions, dict[str, torch.Tensor]]:
    """``job``'s model at ``version`` (a name such as ``"12.7"``, or the group versions; default:
    the current one), each group read in one MULTI/EXEC.

    Returns:
        ``(version, tensors)``: the group versions, and float32 CPU tensors by parameter name, in
        layout order, each its own storage (ready for ``safetensors`` or ``load_state_dict``).

    Raises:
        NoModelError: the job has no model.
        BadVersionError: a name of another form than the job's (``VersionVector.parse``);
            ValueError: group versions that are not one non-negative int per group.
        VersionNotFoundError, VersionGoneError: ``version`` is newer than the current one, or
            older than what Redis retains (the message names the oldest available).
        LayoutError: a shard is missing (a damaged job).
    """
    meta = read_meta(client, job)
    for _ in range(_ATTEMPTS):
        want = _requested(version, meta.groups, job)
        reads = [_read(client, job, meta, g, None if want is None else want[g]) for g in range(meta.groups)]
        try:
            meta_now = read_meta(client, job)
        except NoModelError:  # deleted (and maybe restored) in between
            raise NoModelError(job, "the model was removed while exporting it") from None
        if meta_now == meta:
            break
        meta = meta_now
    else:
        raise ExportError(f"job {job}: the model's meta kept changing; no consistent export in {_ATTEMPTS} attempts")
    kept = Retained(VersionVector(r.version for r in reads),
                    VersionVector(max(r.bases.values(), default=0) for r in reads))
    target = resolve_version(job, want, kept)
    tensors = {t.name: torch.empty(t.shape, dtype=torch.float32) for t in meta.layout.tensors}
    for g, read in enumerate(reads):
        _rebuild(job, meta, g, read, target[g], tensors)
    logger.debug("job %s: snapshot of version %s (current %s, oldest %s) for export", job, VersionVector(target).name(),
                 VersionVector(kept.current).name(), VersionVector(kept.oldest).name())
    return target, tensors


def _read(client: redis.Redis, job: str, meta: ModelMeta, group: int, upto: int | None) -> GroupRead:
    """Group ``group``'s version, bases, shards and deltas (those up to version ``upto`` when
    given: later ones are not needed), in one MULTI/EXEC of its slot."""
    return GroupSlot.of(client, job, meta, group).read("version", "bases", "shards", "deltas", upto=upto)


def _rebuild(job: str, meta: ModelMeta, group: int, read: GroupRead, version: int,
             tensors: dict[str, torch.Tensor]) -> None:
    """Write group ``group``'s shards at ``version`` into ``tensors``."""
    for i, blob in read.shards.items():
        s = meta.layout.shards[i]
        if i not in read.bases:
            raise LayoutError(f"job {job}: shard {i} ({s.name}) has no base version")
        if blob is None or len(blob) != 4 * s.numel:
            raise LayoutError(f"job {job}: shard {i} ({s.name}) is missing or has "
                              f"{0 if blob is None else len(blob)} bytes, expected {4 * s.numel}")
        seg = tensors[s.name].view(-1)[s.start:s.start + s.numel]
        seg.numpy()[:] = np.frombuffer(blob, dtype=np.float32)
        apply_deltas(seg, read.deltas[i], after=read.bases[i], upto=version,
                     what=f"delta of shard {i} ({s.name})")


def to_safetensors_bytes(tensors: dict[str, torch.Tensor], *, job: str | None = None,
                         version: Sequence[int] | None = None) -> bytes:
    """``tensors`` as a safetensors file; its metadata says ``format: pt`` and, when given, the
    job (``streamtrain.job``) and model version (``streamtrain.version``, ``VersionVector.name``).

    The same tensors and metadata always give the same bytes (the ETag of ``GET /v1/model``
    names them): safetensors writes its metadata map in hash order, so the header is written
    again with sorted keys.
    """
    metadata = {"format": "pt"}
    if job is not None:
        metadata["streamtrain.job"] = job
    if version is not None:
        metadata["streamtrain.version"] = VersionVector(version).name()
    return _sorted_header(_save_safetensors(tensors, metadata=metadata))


def _sorted_header(data: bytes) -> bytes:
    """A safetensors file with its JSON header's keys sorted (the data offsets in it are
    relative to the end of the header, so its order and length are free); padded with spaces
    to a multiple of 8 bytes, as safetensors pads it."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":"),
                        ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


def export_model(client: redis.Redis, job: str, path: str, version: str | Sequence[int] | None = None
                 ) -> GroupVersions:
    """Write ``job``'s model at ``version`` (default: the current one) to ``path`` as safetensors,
    atomically (a temporary file in the same folder, then a rename).

    Returns:
        The version written (the group versions; ``VersionVector.name`` writes it).

    Raises:
        the errors of :func:`snapshot`; OSError: ``path`` cannot be written.
    """
    target, tensors = snapshot(client, job, version)
    data = to_safetensors_bytes(tensors, job=job, version=target)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".export-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the model from a server running as another user
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    logger.info("job %s: model version %s exported to %s (%d bytes)", job, VersionVector(target).name(), path,
                len(data))
    return target
