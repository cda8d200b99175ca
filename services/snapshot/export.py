"""Exporting a job's model: a consistent snapshot at one version, as named tensors and as safetensors.

The one place that turns what Redis holds into a model file, used by
``GET /v1/model`` on the coordinator (``coordinator/model_route.py``) and by
``streamtrain export`` (``services/snapshot/cli_export.py``).

**Naming a version.** Each parameter-server shard group has its own version
(``services.store``), so a model version is the vector of the groups'
versions, group 0's first: ``(12, 7)``, written ``"12.7"``
(:func:`version_name`, :func:`parse_version`). A job with one group has
plain integer versions, as before (``"1200"``). The sum of the groups'
versions (``Snapshot.version``) is not used to name an export: two different
models can have the same sum (``12.7`` and ``11.8``), and an ETag or a
file's metadata must name one model. The name is what ``X-Model-Version``,
the ETag ``"<job>-v<name>"``, the safetensors metadata ``streamtrain.version``
and ``?version=`` / ``--version`` carry.

**Which versions can be exported.** Shard ``i`` at group version V is
``shard:<i>`` (its full bytes as of its base) plus its deltas in (base, V].
Deltas carry new values, not increments, so nothing goes back from a base:
group g can be rebuilt at V only when every one of its shards' bases is at
most V. Each group retains the versions from the largest base among its
shards to its current version (:class:`Retained`), and any vector of
retained group versions can be exported: groups are independent (each owns
its shards). The oldest retained version moves with compaction (every
``--compact-every`` versions at the latest; at every version with a dense
optimizer, whose applies rewrite whole shards).

**Consistency** (invariant 3, per group): each group's version, bases,
shards and deltas are read in one MULTI/EXEC of its hash slot, as
:meth:`ParameterStore.pull` reads them, so every tensor of an export is at
the version of its group that the export names. The groups are read one after
another (under Redis Cluster they live on different nodes).

Tensor names are the layout's, i.e. the names the trainers gave
``init_model`` (their module's ``named_parameters()``), so
``module.load_state_dict(safetensors.torch.load_file(path))`` loads an export
into the model spec's module. Only parameters live in Redis: a module with
buffers (BatchNorm statistics) loads with ``strict=False``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import redis
import torch
from safetensors.torch import save as _save_safetensors

from common.keys import JobKeys

from ..deltas import apply_deltas
from ..errors import LayoutError, ParameterPlaneError
from ..protocol import own_shards
from ..store import ModelMeta

logger = logging.getLogger(__name__)

__all__ = [
    "Retained",
    "retained",
    "version_name",
    "parse_version",
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
_COMPONENT_RE = re.compile(r"[0-9]{1,18}")

GroupVersions = tuple[int, ...]
"""A model version: the version of each shard group, group 0's first."""


class ExportError(ParameterPlaneError):
    """Base of the errors of an export."""


class NoModelError(ExportError, LayoutError):
    """The job has no model in this Redis (an unknown job, or one whose trainers have not
    initialised it yet)."""


class BadVersionError(ExportError, ValueError):
    """A requested version does not have the job's form (one non-negative integer per shard group,
    joined by '.'); the message names the form expected."""


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


def version_name(version: Sequence[int]) -> str:
    """How a model version is written: ``"1200"`` with one shard group, ``"12.7"`` (group 0's
    version first) with several."""
    return ".".join(str(v) for v in version)


def _form(groups: int) -> str:
    """The form of a version of a job with ``groups`` groups, for error messages."""
    if groups == 1:
        return "one non-negative integer (a model version)"
    example = version_name([12, 7, 9, 4, 15][:groups] + [3] * max(0, groups - 5))
    return (f"{groups} non-negative integers joined by '.', one per shard group, group 0's first "
            f"(a model version, e.g. {example!r})")


def parse_version(text: str, groups: int, *, job: str | None = None) -> GroupVersions:
    """The version named ``text`` (:func:`version_name`'s form) of a job with ``groups`` groups.

    Raises:
        BadVersionError: ``text`` is not ``groups`` non-negative integers (of at most 18 digits)
            joined by '.'; the message names the form expected.
    """
    parts = text.split(".") if isinstance(text, str) else []
    if len(parts) != groups or not all(_COMPONENT_RE.fullmatch(p) for p in parts):
        whose = f"job {job} has {groups} shard groups: " if job is not None and groups > 1 else ""
        raise BadVersionError(f"{whose}version must be {_form(groups)}, got {text!r}")
    return tuple(int(p) for p in parts)


def _check_requested(version: Sequence[int] | None, groups: int) -> GroupVersions | None:
    if version is None:
        return None
    if (isinstance(version, (str, bytes)) or not isinstance(version, Sequence) or len(version) != groups
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in version)):
        raise ValueError(f"version must be {groups} non-negative integer(s), one per shard group, "
                         f"got {version!r}")
    return tuple(version)


def resolve_version(job: str, requested: Sequence[int] | None, kept: Retained) -> GroupVersions:
    """The version an export of ``requested`` (None: the current one) returns.

    A version some group can no longer rebuild is gone (410), even if another group has not
    reached its version yet: it will never be available.

    Raises:
        ValueError: ``requested`` is not one non-negative int per group.
        VersionGoneError: some group's version is older than that group's oldest retained one.
        VersionNotFoundError: some group's version is newer than its current one.
    """
    want = _check_requested(requested, len(kept.current))
    if want is None:
        return kept.current
    name, current, oldest = version_name(want), version_name(kept.current), version_name(kept.oldest)
    if any(w < o for w, o in zip(want, kept.oldest, strict=True)):
        raise VersionGoneError(f"job {job}: model version {name} is no longer retained (compacted); the oldest "
                               f"version available is {oldest}, the current {current}",
                               version=want, oldest=kept.oldest, current=kept.current)
    if any(w > c for w, c in zip(want, kept.current, strict=True)):
        raise VersionNotFoundError(f"job {job} has no model version {name} yet: the current version is "
                                   f"{current}", version=want, current=kept.current)
    return want


def _no_model(job: str) -> NoModelError:
    return NoModelError(f"job {job} has no model in this Redis (unknown job, or no trainer has initialised it yet)")


def _meta(client: redis.Redis, job: str) -> tuple[bytes, ModelMeta]:
    raw = cast("bytes | None", client.get(JobKeys(job).meta))
    if raw is None:
        raise _no_model(job)
    return raw, ModelMeta.from_json(raw)


def _requested(version: str | Sequence[int] | None, groups: int, job: str) -> GroupVersions | None:
    """``version`` as group versions: a name is parsed (:func:`parse_version`)."""
    if isinstance(version, str):
        return parse_version(version, groups, job=job)
    return _check_requested(version, groups)


def retained(client: redis.Redis, job: str) -> Retained:
    """Which versions of ``job`` can be exported now: the meta, then each group's version and
    bases (one MULTI/EXEC per group: two small keys).

    Raises:
        NoModelError: the job has no model.
    """
    _, meta = _meta(client, job)
    current, oldest = [], []
    for g in range(meta.groups):
        gk = JobKeys(job).group(g)
        pipe = client.pipeline(transaction=True)
        pipe.get(gk.version)
        pipe.hvals(gk.bases)
        raw_version, bases = pipe.execute()
        current.append(int(raw_version or 0))
        oldest.append(max((int(b) for b in bases), default=0))
    return Retained(tuple(current), tuple(oldest))


@dataclass(frozen=True)
class _GroupRead:
    """What one MULTI/EXEC read of a group's slot returned."""

    version: int
    bases: dict[int, int]
    blobs: list[bytes | None]
    streams: list[list]


def snapshot(client: redis.Redis, job: str, version: str | Sequence[int] | None = None
             ) -> tuple[GroupVersions, dict[str, torch.Tensor]]:
    """``job``'s model at ``version`` (a name such as ``"12.7"``, or the group versions; default:
    the current one), each group read in one MULTI/EXEC.

    Returns:
        ``(version, tensors)``: the group versions, and float32 CPU tensors by parameter name, in
        layout order, each its own storage (ready for ``safetensors`` or ``load_state_dict``).

    Raises:
        NoModelError: the job has no model.
        BadVersionError: a name of another form than the job's (``parse_version``);
            ValueError: group versions that are not one non-negative int per group.
        VersionNotFoundError, VersionGoneError: ``version`` is newer than the current one, or
            older than what Redis retains (the message names the oldest available).
        LayoutError: a shard is missing (a damaged job).
    """
    raw_meta, meta = _meta(client, job)
    for _ in range(_ATTEMPTS):
        want = _requested(version, meta.groups, job)
        reads = [_read(client, job, meta, g, None if want is None else want[g]) for g in range(meta.groups)]
        meta_now = cast("bytes | None", client.get(JobKeys(job).meta))
        if meta_now == raw_meta:
            break
        if meta_now is None:  # deleted (and maybe restored) in between: read it again
            raise NoModelError(f"job {job}: the model was removed while exporting it")
        raw_meta, meta = meta_now, ModelMeta.from_json(meta_now)
    else:
        raise ExportError(f"job {job}: the model's meta kept changing; no consistent export in {_ATTEMPTS} attempts")
    kept = Retained(tuple(r.version for r in reads),
                    tuple(max(r.bases.values(), default=0) for r in reads))
    target = resolve_version(job, want, kept)
    tensors = {t.name: torch.empty(t.shape, dtype=torch.float32) for t in meta.layout.tensors}
    for g, read in enumerate(reads):
        _rebuild(job, meta, g, read, target[g], tensors)
    logger.debug("job %s: snapshot of version %s (current %s, oldest %s) for export", job, version_name(target),
                 version_name(kept.current), version_name(kept.oldest))
    return target, tensors


def _read(client: redis.Redis, job: str, meta: ModelMeta, group: int, upto: int | None) -> _GroupRead:
    """Group ``group``'s version, bases, shards and deltas (those up to version ``upto`` when
    given: later ones are not needed), in one MULTI/EXEC of its slot."""
    gk, own = JobKeys(job).group(group), own_shards(meta.layout, meta.groups, group)
    pipe = client.pipeline(transaction=True)
    pipe.get(gk.version)
    pipe.hgetall(gk.bases)
    pipe.mget([gk.shard(i) for i in own] or [gk.version])
    for i in own:
        pipe.xrange(gk.deltas(i), max="+" if upto is None else str(upto))
    raw_version, raw_bases, blobs, *streams = pipe.execute()
    return _GroupRead(int(raw_version or 0), {int(k): int(v) for k, v in raw_bases.items()},
                      list(blobs[:len(own)]), streams)


def _rebuild(job: str, meta: ModelMeta, group: int, read: _GroupRead, version: int,
             tensors: dict[str, torch.Tensor]) -> None:
    """Write group ``group``'s shards at ``version`` into ``tensors``."""
    for j, i in enumerate(own_shards(meta.layout, meta.groups, group)):
        s = meta.layout.shards[i]
        blob = read.blobs[j]
        if i not in read.bases:
            raise LayoutError(f"job {job}: shard {i} ({s.name}) has no base version")
        if blob is None or len(blob) != 4 * s.numel:
            raise LayoutError(f"job {job}: shard {i} ({s.name}) is missing or has "
                              f"{0 if blob is None else len(blob)} bytes, expected {4 * s.numel}")
        seg = tensors[s.name].view(-1)[s.start:s.start + s.numel]
        seg.numpy()[:] = np.frombuffer(blob, dtype=np.float32)
        apply_deltas(seg, read.streams[j], after=read.bases[i], upto=version,
                     what=f"delta of shard {i} ({s.name})")


def to_safetensors_bytes(tensors: dict[str, torch.Tensor], *, job: str | None = None,
                         version: Sequence[int] | None = None) -> bytes:
    """``tensors`` as a safetensors file; its metadata says ``format: pt`` and, when given, the
    job (``streamtrain.job``) and model version (``streamtrain.version``, :func:`version_name`).

    The same tensors and metadata always give the same bytes (the ETag of ``GET /v1/model``
    names them): safetensors writes its metadata map in hash order, so the header is written
    again with sorted keys.
    """
    metadata = {"format": "pt"}
    if job is not None:
        metadata["streamtrain.job"] = job
    if version is not None:
        metadata["streamtrain.version"] = version_name(version)
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
        The version written (the group versions; :func:`version_name` writes it).

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
    logger.info("job %s: model version %s exported to %s (%d bytes)", job, version_name(target), path, len(data))
    return target
