"""The parameter store: a model's shards in Redis, initialised once, pulled as consistent snapshots.

Data model (all keys from :class:`streamtrain.keys.JobKeys`):

* ``meta`` — JSON ``{"layout": ..., "optimizer": ..., "groups": n}``, written once.
* ``shard:<i>`` — float32 little-endian bytes of shard ``i``.
* ``versions`` — hash ``i -> model version that last wrote shard i``.
* ``model_version`` — integer, bumped by every atomic apply that writes shards.

A snapshot at version V holds every shard as it was when ``model_version``
was V (invariant 3): every write of a shard bumps ``model_version`` in the same
atomic step, so reading ``model_version`` and the shards in one MULTI/EXEC is
consistent. A pull that already holds a snapshot first reads the versions, then
fetches only the changed shards together with ``model_version`` in one
MULTI/EXEC, and retries if the model moved in between.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import redis
import torch

from streamtrain.keys import JobKeys

from .errors import LayoutError
from .layout import DEFAULT_SHARD_ELEMS, Layout, make_layout
from .optim import OptimizerConfig
from .scripts import script

logger = logging.getLogger(__name__)

__all__ = ["ParameterStore", "Snapshot", "ModelMeta", "connect"]

_PULL_RETRIES = 8


def connect(url: str, **kwargs: object) -> redis.Redis:
    """A redis-py client for ``url`` with the client path the parameter plane measured fastest.

    hiredis (a dependency) parses replies 2-3x faster than redis-py's parser
    (an MGET of 40 x 1 MB shards), but its command packer copies every argument
    into one buffer, making a 4 MB SET ~5x slower than redis-py's serializer,
    which sends large values as separate chunks. So this client keeps the
    default (hiredis) parser and uses redis-py's serializer for commands; see
    ``bench/paramserver.py``.
    """
    from redis.connection import PythonRespSerializer
    from redis._parsers import Encoder

    encoder = Encoder("utf-8", "strict", False)
    kwargs.setdefault("command_packer", PythonRespSerializer(6000, encoder.encode))
    return redis.Redis.from_url(url, **kwargs)


@dataclass(frozen=True)
class ModelMeta:
    """What ``meta`` holds: the layout, the optimizer and the number of server shard groups."""

    layout: Layout
    """Tensors and shards."""
    optimizer: OptimizerConfig
    """Server-side optimizer."""
    groups: int
    """Number of parameter-server shard groups (shard i belongs to group i % groups)."""

    def to_json(self) -> str:
        """Stored form."""
        return json.dumps({"layout": json.loads(self.layout.to_json()),
                           "optimizer": json.loads(self.optimizer.to_json()), "groups": self.groups},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelMeta:
        """Inverse of :meth:`to_json`."""
        raw = json.loads(text)
        return cls(Layout.from_json(json.dumps(raw["layout"])),
                   OptimizerConfig(**raw["optimizer"]), int(raw["groups"]))


@dataclass(frozen=True)
class Snapshot:
    """A consistent view of the model: every tensor as it was at model version ``version``."""

    version: int
    """The model version it names."""
    versions: tuple[int, ...]
    """Version of each shard (the model version that last wrote it)."""
    tensors: dict[str, torch.Tensor]
    """Tensors by name (float32 unless pulled as fp16/bf16). Treat as read-only:
    a later pull shares the tensors that did not change."""
    fetched: tuple[int, ...]
    """Shard indices this pull fetched (all of them on a first pull)."""


class ParameterStore:
    """A job's parameters in Redis: ``init_model`` once, ``pull`` consistent snapshots.

    Args:
        client: a redis-py client (see :func:`connect`); not closed by the store.
        job: the job name (keys carry it, so several jobs share one Redis).
    """

    def __init__(self, client: redis.Redis, job: str) -> None:
        self.client = client
        self.keys = JobKeys(job)
        self._meta: ModelMeta | None = None

    # -- model ---------------------------------------------------------------
    def init_model(self, tensors: Mapping[str, torch.Tensor], *,
                   shard_elems: int = DEFAULT_SHARD_ELEMS,
                   optimizer: OptimizerConfig | None = None, groups: int | None = None) -> ModelMeta:
        """Store the model's initial parameters unless the job already has a model.

        Idempotent: the first writer wins; a later caller gets the stored meta
        back after checking its tensors have the stored layout. ``groups`` (the
        number of parameter-server shard groups) defaults to the job config's
        ``ps_groups`` field, else 1.

        Raises:
            LayoutError: the tensors do not match the stored layout (names the difference),
                or a tensor is not floating point.
            ValueError: ``groups`` < 1 or a bad ``shard_elems``.
        """
        if groups is None:
            groups = int(self.client.hget(self.keys.config, "ps_groups") or 1)
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        layout = make_layout(tensors, shard_elems)
        meta = ModelMeta(layout, optimizer or OptimizerConfig(), groups)
        flat = {name: t.detach().to("cpu", torch.float32).reshape(-1).contiguous()
                for name, t in tensors.items()}
        blobs = [flat[s.name][s.start:s.start + s.numel].numpy().tobytes() for s in layout.shards]
        keys = [self.keys.meta, self.keys.versions, self.keys.model_version,
                *(self.keys.shard(s.index) for s in layout.shards)]
        stored = ModelMeta.from_json(script(self.client, "init")(keys=keys, args=[meta.to_json(), *blobs]))
        diff = stored.layout.describe_difference(layout)
        if diff is not None:
            raise LayoutError(f"job {self.keys.job}: model does not match the stored one: {diff}")
        if stored == meta:
            logger.info("job %s: model initialised with %d tensors, %d shards, %d values",
                        self.keys.job, len(layout.tensors), len(layout.shards), layout.numel)
        self._meta = stored
        return stored

    def meta(self, *, refresh: bool = False) -> ModelMeta:
        """The job's stored model meta (cached).

        Raises:
            LayoutError: the job has no model yet.
        """
        if self._meta is None or refresh:
            raw = self.client.get(self.keys.meta)
            if raw is None:
                raise LayoutError(f"job {self.keys.job} has no model yet (init_model first)")
            self._meta = ModelMeta.from_json(raw)
        return self._meta

    @property
    def layout(self) -> Layout:
        """The stored layout."""
        return self.meta().layout

    def version(self) -> int:
        """The current model version."""
        return int(self.client.get(self.keys.model_version) or 0)

    # -- pull ----------------------------------------------------------------
    def pull(self, since: Snapshot | None = None, *, dtype: torch.dtype = torch.float32,
             out: Mapping[str, torch.Tensor] | None = None) -> Snapshot:
        """A consistent snapshot; with ``since``, only shards whose version changed are fetched.

        ``dtype`` (float32, float16 or bfloat16) converts the tensors after
        fetching; ``since`` must have been pulled with the same dtype.

        ``out`` (tensor name -> float32 contiguous CPU tensor of the model's
        shape, e.g. the trainer's own parameters) is filled in place instead of
        allocating: the snapshot then holds those tensors. With ``since``, ``out``
        must already hold ``since``'s values (it was pulled into the same ``out``).

        Raises:
            LayoutError: no model, or a shard is missing; ValueError: a bad ``out`` or ``dtype``.
        """
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"pull dtype must be float32, float16 or bfloat16, got {dtype}")
        layout = self.layout
        if out is not None:
            if dtype != torch.float32:
                raise ValueError("pull into out= tensors is float32 only")
            for spec in layout.tensors:
                t = out.get(spec.name)
                if (t is None or t.dtype != torch.float32 or tuple(t.shape) != spec.shape
                        or t.device.type != "cpu" or not t.is_contiguous()):
                    raise ValueError(f"out[{spec.name!r}] must be a contiguous float32 CPU tensor of shape "
                                     f"{list(spec.shape)}, got {None if t is None else (t.dtype, list(t.shape))}")
        n = len(layout.shards)
        for _ in range(_PULL_RETRIES if since is not None else 0):
            pipe = self.client.pipeline(transaction=True)
            pipe.get(self.keys.model_version)
            pipe.hgetall(self.keys.versions)
            raw_version, raw_versions = pipe.execute()
            versions = self._versions(raw_versions, n)
            changed = [i for i in range(n) if versions[i] != since.versions[i]]
            if not changed:
                return Snapshot(int(raw_version or 0), versions, since.tensors, ())
            pipe = self.client.pipeline(transaction=True)
            pipe.get(self.keys.model_version)
            pipe.mget([self.keys.shard(i) for i in changed])
            again, blobs = pipe.execute()
            if again == raw_version:
                return self._assemble(int(again or 0), versions, changed, blobs, since, dtype, out)
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.keys.model_version)
        pipe.hgetall(self.keys.versions)
        pipe.mget([self.keys.shard(i) for i in range(n)])
        raw_version, raw_versions, blobs = pipe.execute()
        return self._assemble(int(raw_version or 0), self._versions(raw_versions, n),
                              list(range(n)), blobs, None, dtype, out)

    def _versions(self, raw: Mapping[bytes, bytes], n: int) -> tuple[int, ...]:
        if len(raw) != n:
            raise LayoutError(f"job {self.keys.job}: {len(raw)} shard versions stored, layout has {n}")
        out = [0] * n
        for k, v in raw.items():
            out[int(k)] = int(v)
        return tuple(out)

    def _assemble(self, version: int, versions: tuple[int, ...], fetched: list[int],
                  blobs: list[bytes | None], since: Snapshot | None, dtype: torch.dtype,
                  out: Mapping[str, torch.Tensor] | None) -> Snapshot:
        layout = self.layout
        got = dict(zip(fetched, blobs, strict=True))
        tensors: dict[str, torch.Tensor] = {}
        for spec in layout.tensors:
            shards = layout.shards_of(spec.name)
            mine = [s for s in shards if s.index in got]
            if since is not None and not mine:
                tensors[spec.name] = out[spec.name] if out is not None else since.tensors[spec.name]
                continue
            if out is not None:
                flat = out[spec.name].view(-1).numpy()
            else:
                flat = np.empty(spec.numel, dtype=np.float32)
                if len(mine) < len(shards):
                    assert since is not None
                    flat[:] = since.tensors[spec.name].reshape(-1).float().numpy()
            for s in mine:
                blob = got[s.index]
                if blob is None or len(blob) != 4 * s.numel:
                    raise LayoutError(f"job {self.keys.job}: shard {s.index} ({s.name}) is missing or "
                                      f"has {0 if blob is None else len(blob)} bytes, expected {4 * s.numel}")
                flat[s.start:s.start + s.numel] = np.frombuffer(blob, dtype=np.float32)
            if out is not None:
                tensors[spec.name] = out[spec.name]
                continue
            t = torch.from_numpy(flat).view(spec.shape)
            tensors[spec.name] = t if dtype == torch.float32 else t.to(dtype)
        return Snapshot(version, versions, tensors, tuple(fetched))
