"""The parameter store: a model's shards in Redis, initialised once, pulled as consistent snapshots.

Data model (all keys from :class:`common.keys.JobKeys`):

* ``meta`` — JSON ``{"layout": ..., "optimizer": ..., "groups": n}``, written once.
* ``shard:<i>`` — full float32 little-endian bytes of shard ``i`` as of its base version.
* ``bases`` — hash ``i -> the model version shard:<i> is as of`` (moved by compaction only).
* ``deltas:<i>`` — stream of shard ``i``'s deltas, entry ``<version>-0`` (``services.deltas``).
* ``delta_floors`` — hash ``i -> every delta above this version is kept`` (<= the base).
* ``versions`` — hash ``i -> model version that last changed shard i``.
* ``model_version`` — integer, bumped by every atomic apply that changes shards.

Shard ``i`` at model version V is ``shard:<i>`` plus its deltas in (base, V].
A snapshot at version V holds every shard as it was when ``model_version``
was V (invariant 3): every apply bumps ``model_version`` in the same atomic
step that publishes its deltas, so one MULTI/EXEC reads a consistent state.
A pull that already holds a snapshot at S reads, in one MULTI/EXEC, the
versions and the deltas after S, and moves only the changed coordinates; a
shard whose deltas since S were compacted away is read in full (a second
MULTI/EXEC, which the deltas' versions let it align on V).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import redis
import torch

from common.keys import JobKeys

from .deltas import apply_deltas
from .errors import LayoutError
from .layout import DEFAULT_SHARD_ELEMS, Layout, ShardSpec, make_layout
from .optim import OptimizerConfig
from .scripts import script

logger = logging.getLogger(__name__)

__all__ = ["ParameterStore", "Snapshot", "ModelMeta", "connect"]

_PULL_RETRIES = 8


def connect(url: str, **kwargs: object) -> redis.Redis:
    """A redis-py client for ``url`` (a server, or a ``redis+cluster://`` Redis Cluster: see
    :func:`common.redis_client.connect`) with the client path the parameter plane measured fastest.

    hiredis (a dependency) parses replies about 2x faster than redis-py's own
    parser (1.8-2.3x on an MGET of 40 x 1 MB values and on a pull of 40 x 1 MB
    shards), but its command packer copies every argument into one buffer,
    making a 4 MB SET 3-6x slower than redis-py's serializer, which sends large
    values as separate chunks. So this client keeps the default (hiredis)
    parser and uses redis-py's serializer for commands; see
    ``docs/parameter-plane.md`` and ``bench/paramserver.py``.
    """
    from redis.connection import PythonRespSerializer
    from redis._parsers import Encoder

    from common import redis_client

    encoder = Encoder("utf-8", "strict", False)
    kwargs.setdefault("command_packer", PythonRespSerializer(6000, encoder.encode))
    return redis_client.connect(url, **kwargs)  # type: ignore[return-value]


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
    """Version of each shard (the model version that last changed it)."""
    tensors: dict[str, torch.Tensor]
    """Tensors by name (float32). Treat as read-only: a later pull shares the tensors that did
    not change (or, pulled with ``out=``, writes into them)."""
    fetched: tuple[int, ...]
    """Shard indices this pull changed (all of them on a first pull)."""
    wire_bytes: int = 0
    """Shard and delta bytes this pull read from Redis."""


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
        keys = [self.keys.meta, self.keys.versions, self.keys.bases, self.keys.delta_floors,
                self.keys.model_version, *(self.keys.shard(s.index) for s in layout.shards)]
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
    def pull(self, since: Snapshot | None = None, *,
             out: Mapping[str, torch.Tensor] | None = None) -> Snapshot:
        """A consistent snapshot; with ``since``, only the coordinates changed after it are moved.

        ``out`` (tensor name -> contiguous float32 tensor of the model's shape, on
        any device, e.g. the trainer's own parameters) is filled in place instead of
        allocating, so the snapshot holds those tensors. With ``since``, ``out`` must
        already hold ``since``'s values (it was pulled into the same ``out``).

        Raises:
            LayoutError: no model, or a shard is missing; ValueError: a bad ``out``.
        """
        layout = self.layout
        if out is not None:
            for spec in layout.tensors:
                t = out.get(spec.name)
                if t is None or t.dtype != torch.float32 or tuple(t.shape) != spec.shape or not t.is_contiguous():
                    raise ValueError(f"out[{spec.name!r}] must be a contiguous float32 tensor of shape "
                                     f"{list(spec.shape)}, got {None if t is None else (t.dtype, list(t.shape))}")
        for _ in range(_PULL_RETRIES if since is not None else 0):
            snap = self._pull_since(since, out)
            if snap is not None:
                return snap
        return self._pull_full(out)

    def _pull_full(self, out: Mapping[str, torch.Tensor] | None) -> Snapshot:
        """Every shard: full bytes plus the deltas after its base, in one MULTI/EXEC."""
        shards = self.layout.shards
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.keys.model_version)
        pipe.hgetall(self.keys.versions)
        pipe.hgetall(self.keys.bases)
        pipe.mget([self.keys.shard(s.index) for s in shards])
        for s in shards:
            pipe.xrange(self.keys.deltas(s.index))
        raw_version, raw_versions, raw_bases, blobs, *streams = pipe.execute()
        version = int(raw_version or 0)
        versions, bases = self._versions(raw_versions), self._versions(raw_bases)
        tensors, flats = self._targets(None, out, [s.index for s in shards])
        moved = 0
        for s in shards:
            moved += self._rebuild(flats[s.name], s, blobs[s.index], bases[s.index], streams[s.index], version)
        return Snapshot(version, versions, tensors, tuple(range(len(shards))), moved)

    def _pull_since(self, since: Snapshot, out: Mapping[str, torch.Tensor] | None) -> Snapshot | None:
        """The deltas after ``since`` (one MULTI/EXEC), and the full bytes of shards whose deltas
        were compacted away (a second one); None when a compaction in between forces a retry."""
        shards = self.layout.shards
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.keys.model_version)
        pipe.hgetall(self.keys.versions)
        pipe.hgetall(self.keys.delta_floors)
        for s in shards:
            pipe.xrange(self.keys.deltas(s.index), min=str(since.version + 1))
        raw_version, raw_versions, raw_floors, *streams = pipe.execute()
        version = int(raw_version or 0)
        versions, floors = self._versions(raw_versions), self._versions(raw_floors)
        changed = [i for i in range(len(shards)) if versions[i] != since.versions[i]]
        if not changed:
            return Snapshot(version, versions, since.tensors, ())
        full = [i for i in changed if floors[i] > since.version]
        blobs: dict[int, tuple[bytes | None, int, list]] = {}
        if full:
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(self.keys.bases)
            pipe.mget([self.keys.shard(i) for i in full])
            for i in full:
                pipe.xrange(self.keys.deltas(i))
            raw_bases, full_blobs, *full_streams = pipe.execute()
            bases = self._versions(raw_bases)
            if any(bases[i] > version for i in full):
                return None  # compacted after the first read: its deltas up to `version` may be gone
            blobs = {i: (b, bases[i], st) for i, b, st in zip(full, full_blobs, full_streams, strict=True)}
        tensors, flats = self._targets(since, out, changed)
        moved = 0
        for i in changed:
            s = shards[i]
            if i in blobs:
                blob, base, entries = blobs[i]
                moved += self._rebuild(flats[s.name], s, blob, base, entries, version)
            else:
                seg = flats[s.name][s.start:s.start + s.numel]
                moved += apply_deltas(seg, streams[i], after=since.version, upto=version,
                                      what=f"delta of shard {i} ({s.name})")
        return Snapshot(version, versions, tensors, tuple(changed), moved)

    def _targets(self, since: Snapshot | None, out: Mapping[str, torch.Tensor] | None,
                 changed: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The snapshot's tensors, and flat views of those the changed shards are written into
        (``out``'s own, or fresh copies: a snapshot's tensors are never modified)."""
        layout = self.layout
        names = {layout.shards[i].name for i in changed}
        tensors: dict[str, torch.Tensor] = {}
        flats: dict[str, torch.Tensor] = {}
        for spec in layout.tensors:
            if out is not None:
                tensors[spec.name] = out[spec.name]
            elif spec.name not in names:
                tensors[spec.name] = since.tensors[spec.name]
            elif since is not None:  # deltas apply to since's values
                tensors[spec.name] = since.tensors[spec.name].clone()
            else:
                tensors[spec.name] = torch.empty(spec.shape, dtype=torch.float32)
            if spec.name in names:
                flats[spec.name] = tensors[spec.name].detach().view(-1)
        return tensors, flats

    def _rebuild(self, flat: torch.Tensor, s: ShardSpec, blob: bytes | None, base: int,
                 entries: list, version: int) -> int:
        """Shard ``s`` at ``version`` into ``flat``: its full bytes (as of ``base``), then its
        deltas in (base, version]. Returns the bytes read."""
        if blob is None or len(blob) != 4 * s.numel:
            raise LayoutError(f"job {self.keys.job}: shard {s.index} ({s.name}) is missing or "
                              f"has {0 if blob is None else len(blob)} bytes, expected {4 * s.numel}")
        seg = flat[s.start:s.start + s.numel]
        values = np.frombuffer(blob, dtype=np.float32)
        if seg.device.type == "cpu":
            seg.numpy()[:] = values
        else:
            seg.copy_(torch.from_numpy(values.copy()))
        return len(blob) + apply_deltas(seg, entries, after=base, upto=version,
                                        what=f"delta of shard {s.index} ({s.name})")

    def _versions(self, raw: Mapping[bytes, bytes]) -> tuple[int, ...]:
        n = len(self.layout.shards)
        if len(raw) != n:
            raise LayoutError(f"job {self.keys.job}: {len(raw)} shard versions stored, layout has {n}")
        out = [0] * n
        for k, v in raw.items():
            out[int(k)] = int(v)
        return tuple(out)
