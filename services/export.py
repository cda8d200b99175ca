"""Exporting a job's model: a consistent snapshot at one version, as named tensors and as safetensors.

The one place that turns what Redis holds into a model file, used by
``GET /v1/model`` on the coordinator (``coordinator/model_route.py``) and by
``streamtrain export`` (``services/cli_export.py``).

Which versions can be exported: shard ``i`` at model version V is
``shard:<i>`` (its full bytes as of its base) plus its deltas in (base, V].
Deltas carry new values, not increments, so nothing goes back from a base:
V can be rebuilt only when every shard's base is at most V. The oldest
version available is therefore the largest base, and it moves with
compaction (every ``--compact-every`` versions at the latest; at every
version with a dense optimizer, whose applies rewrite whole shards).

Consistency (invariant 3): the meta, ``model_version``, ``bases``, every
shard and every shard's deltas are read in one MULTI/EXEC, as a first pull
reads them, so every tensor of an export is at the version it names.

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
import tempfile
from dataclasses import dataclass

import numpy as np
import redis
import torch
from safetensors.torch import save as _save_safetensors

from common.keys import JobKeys

from .deltas import apply_deltas
from .errors import LayoutError, ParameterPlaneError
from .layout import Layout
from .store import ModelMeta

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
    "VersionNotFoundError",
    "VersionGoneError",
]

_ATTEMPTS = 5


class ExportError(ParameterPlaneError):
    """Base of the errors of an export."""


class NoModelError(ExportError, LayoutError):
    """The job has no model in this Redis (an unknown job, or one whose trainers have not
    initialised it yet)."""


class VersionNotFoundError(ExportError):
    """The requested version is newer than the job's current model version."""

    def __init__(self, message: str, *, version: int, current: int) -> None:
        super().__init__(message)
        self.version = version
        """The version asked for."""
        self.current = current
        """The job's current model version."""


class VersionGoneError(ExportError):
    """The requested version is older than what Redis retains: compaction rewrote a shard
    past it. ``oldest`` is the oldest version that can still be exported."""

    def __init__(self, message: str, *, version: int, oldest: int, current: int) -> None:
        super().__init__(message)
        self.version = version
        """The version asked for."""
        self.oldest = oldest
        """The oldest version still available."""
        self.current = current
        """The job's current model version."""


@dataclass(frozen=True)
class Retained:
    """The model versions of a job that can be exported: ``oldest`` .. ``current``."""

    current: int
    """The current model version (what an export without a version returns)."""
    oldest: int
    """The oldest version still rebuildable (the largest shard base)."""


def _check_requested(version: int | None) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise ValueError(f"version must be a non-negative integer, got {version!r}")


def resolve_version(job: str, requested: int | None, kept: Retained) -> int:
    """The version an export of ``requested`` (None: the current one) returns.

    Raises:
        ValueError: ``requested`` is not a non-negative int.
        VersionNotFoundError: newer than the current version.
        VersionGoneError: older than the oldest retained version.
    """
    _check_requested(requested)
    if requested is None:
        return kept.current
    if requested > kept.current:
        raise VersionNotFoundError(f"job {job} has no model version {requested} yet: the current version is "
                                   f"{kept.current}", version=requested, current=kept.current)
    if requested < kept.oldest:
        raise VersionGoneError(f"job {job}: model version {requested} is no longer retained (compacted); the oldest "
                               f"version available is {kept.oldest}, the current {kept.current}",
                               version=requested, oldest=kept.oldest, current=kept.current)
    return requested


def _no_model(job: str) -> NoModelError:
    return NoModelError(f"job {job} has no model in this Redis (unknown job, or no trainer has initialised it yet)")


def _ints(raw: dict[bytes, bytes]) -> dict[int, int]:
    return {int(k): int(v) for k, v in raw.items()}


def retained(client: redis.Redis, job: str) -> Retained:
    """Which versions of ``job`` can be exported now (one MULTI/EXEC of three small keys).

    Raises:
        NoModelError: the job has no model.
    """
    keys = JobKeys(job)
    pipe = client.pipeline(transaction=True)
    pipe.exists(keys.meta)
    pipe.get(keys.model_version)
    pipe.hgetall(keys.bases)
    has_meta, raw_version, raw_bases = pipe.execute()
    if not has_meta:
        raise _no_model(job)
    return Retained(int(raw_version or 0), max(_ints(raw_bases).values(), default=0))


def _rebuild(job: str, layout: Layout, version: int, blobs: list[bytes | None], bases: dict[int, int],
             streams: list[list]) -> dict[str, torch.Tensor]:
    tensors = {t.name: torch.empty(t.shape, dtype=torch.float32) for t in layout.tensors}
    for s in layout.shards:
        blob = blobs[s.index]
        if s.index not in bases:
            raise LayoutError(f"job {job}: shard {s.index} ({s.name}) has no base version")
        if blob is None or len(blob) != 4 * s.numel:
            raise LayoutError(f"job {job}: shard {s.index} ({s.name}) is missing or has "
                              f"{0 if blob is None else len(blob)} bytes, expected {4 * s.numel}")
        seg = tensors[s.name].view(-1)[s.start:s.start + s.numel]
        seg.numpy()[:] = np.frombuffer(blob, dtype=np.float32)
        apply_deltas(seg, streams[s.index], after=bases[s.index], upto=version,
                     what=f"delta of shard {s.index} ({s.name})")
    return tensors


def snapshot(client: redis.Redis, job: str, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """``job``'s model at ``version`` (default: the current one), read in one MULTI/EXEC.

    Returns:
        ``(version, tensors)``: float32 CPU tensors by parameter name, in layout order, each
        its own storage (ready for ``safetensors`` or ``load_state_dict``).

    Raises:
        ValueError: ``version`` is not a non-negative int.
        NoModelError: the job has no model.
        VersionNotFoundError, VersionGoneError: ``version`` is newer than the current one,
            or older than what Redis retains (the message names the oldest available).
        LayoutError: a shard is missing (a damaged job).
    """
    _check_requested(version)
    keys = JobKeys(job)
    raw_meta = client.get(keys.meta)
    if raw_meta is None:
        raise _no_model(job)
    layout = ModelMeta.from_json(raw_meta).layout
    n = len(layout.shards)
    for _ in range(_ATTEMPTS):
        pipe = client.pipeline(transaction=True)
        pipe.get(keys.meta)
        pipe.get(keys.model_version)
        pipe.hgetall(keys.bases)
        pipe.mget([keys.shard(i) for i in range(n)])
        for i in range(n):
            pipe.xrange(keys.deltas(i))
        meta_now, raw_version, raw_bases, blobs, *streams = pipe.execute()
        if meta_now == raw_meta:
            break
        if meta_now is None:  # deleted (and maybe restored) in between: read it again
            raise NoModelError(f"job {job}: the model was removed while exporting it")
        raw_meta, layout = meta_now, ModelMeta.from_json(meta_now).layout
        n = len(layout.shards)
    else:
        raise ExportError(f"job {job}: the model's meta kept changing; no consistent export in {_ATTEMPTS} attempts")
    bases = _ints(raw_bases)
    kept = Retained(int(raw_version or 0), max(bases.values(), default=0))
    target = resolve_version(job, version, kept)
    tensors = _rebuild(job, layout, target, blobs, bases, streams)
    logger.debug("job %s: snapshot of version %d (current %d, oldest %d) for export", job, target,
                 kept.current, kept.oldest)
    return target, tensors


def to_safetensors_bytes(tensors: dict[str, torch.Tensor], *, job: str | None = None,
                         version: int | None = None) -> bytes:
    """``tensors`` as a safetensors file; its metadata says ``format: pt`` and, when given, the
    job (``streamtrain.job``) and model version (``streamtrain.version``).

    The same tensors and metadata always give the same bytes (the ETag of ``GET /v1/model``
    names them): safetensors writes its metadata map in hash order, so the header is written
    again with sorted keys.
    """
    metadata = {"format": "pt"}
    if job is not None:
        metadata["streamtrain.job"] = job
    if version is not None:
        metadata["streamtrain.version"] = str(version)
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


def export_model(client: redis.Redis, job: str, path: str, version: int | None = None) -> int:
    """Write ``job``'s model at ``version`` (default: the current one) to ``path`` as safetensors,
    atomically (a temporary file in the same folder, then a rename).

    Returns:
        The version written.

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
    logger.info("job %s: model version %d exported to %s (%d bytes)", job, target, path, len(data))
    return target
