"""The parameter store: a model's shards in Redis, initialised once, pulled as consistent snapshots.

Data model. The job's slot (:class:`common.keys.JobKeys`) holds ``meta``, JSON
``{"layout": ..., "optimizer": ..., "groups": G}``, written once. Shard ``i``
belongs to group ``g = i % G``, whose slot (:class:`common.keys.GroupKeys`)
holds:

* ``shard:<i>`` — full float32 little-endian bytes of shard ``i`` as of its base version.
* ``bases`` — hash ``i -> the group version shard:<i> is as of`` (moved by compaction only).
* ``deltas:<i>`` — stream of shard ``i``'s deltas, entry ``<version>-0`` (``services.deltas``).
* ``delta_floors`` — hash ``i -> every delta above this version is kept`` (<= the base).
* ``versions`` — hash ``i -> group version that last changed shard i``.
* ``version`` — the group's version, bumped by every atomic apply that changes its shards.

**Versions.** Each group has its own version; a model version is the vector
of them (:attr:`Snapshot.group_versions`, named ``12.7`` by
:func:`services.snapshot.export.version_name`). Their sum (:attr:`Snapshot.version`)
grows with every apply of any group, so it orders a reader's successive
snapshots, but it names no model: ``12.7`` and ``11.8`` have the same sum
(``docs/serving.md``). Shard ``i`` at group
version V is ``shard:<i>`` plus its deltas in (base, V]. Invariant 3 holds per
group: every shard of group g in a snapshot is at the snapshot's version of g,
because each group's apply bumps its version in the same atomic step that
publishes its deltas, and a pull reads each group in one MULTI/EXEC. Groups
are read one after another (under Redis Cluster they live on different nodes),
so two groups of a snapshot may be a few applies apart, the same as two
trainers' pushes are: the SSP bound (invariant 2) is checked on the applied
clocks, which an update reaches only once every group has applied it.

A pull that already holds a snapshot reads, per group that moved, the versions
and the deltas after the group's version it holds (one MULTI/EXEC), and moves
only the changed coordinates; a shard whose deltas since then were compacted
away is read in full (a second MULTI/EXEC, which the deltas' versions let it
align on the group's version).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import redis
import torch
from redis.typing import FieldT

from common.keys import JobKeys

from .deltas import apply_deltas
from .errors import LayoutError
from .layout import DEFAULT_SHARD_ELEMS, Layout, ShardSpec, make_layout
from .optim import OptimizerConfig, slots
from .protocol import own_shards
from .tables.spec import TableSpec, tables_from_json, tables_to_json, validate_tables

logger = logging.getLogger(__name__)

__all__ = ["ParameterStore", "Snapshot", "ModelMeta", "connect"]

_PULL_RETRIES = 8
_INIT_LOCK_MS = 120_000
"""How long a model's creator holds the init lock (it writes every group's shards under it)."""
_INIT_WAIT_S = 180.0
"""How long another writer waits for the model to appear."""


def connect(url: str, **kwargs: object) -> redis.Redis:
    """A redis-py client for ``url`` (a server, or a ``redis+cluster://`` Redis Cluster: see
    :func:`common.redis_client.connect`) with the client path the parameter plane measured fastest.

    hiredis (a dependency) parses replies about 2x faster than redis-py's own
    parser (1.8-2.3x on an MGET of 40 x 1 MB values and on a pull of 40 x 1 MB
    shards), but its command packer copies every argument into one buffer,
    making a 4 MB SET 3-6x slower than redis-py's serializer, which sends large
    values as separate chunks. So this client keeps the default (hiredis)
    parser and uses redis-py's serializer for commands (through
    :class:`services.resp.Packer`, which also takes thousands of row IDs packed
    at once); see ``docs/parameter-plane.md`` and ``bench/paramserver.py``.
    """
    from redis._parsers import Encoder

    from common import redis_client

    from .resp import Packer, mark_bulk

    encoder = Encoder("utf-8", "strict", False)
    kwargs.setdefault("command_packer", Packer(6000, encoder.encode))
    client = redis_client.connect(url, **kwargs)
    if isinstance(kwargs["command_packer"], Packer):
        mark_bulk(client)
    return client


@dataclass(frozen=True)
class ModelMeta:
    """What ``meta`` holds: the layout, the optimizer and the number of server shard groups."""

    layout: Layout
    """Tensors and shards."""
    optimizer: OptimizerConfig
    """Server-side optimizer."""
    groups: int
    """Number of parameter-server shard groups (shard i belongs to group
    ``services.protocol.group_of(i, groups)``)."""
    tables: tuple[TableSpec, ...] = ()
    """The model's embedding tables (rows live only in Redis; row ``id`` of a table belongs to group
    ``services.tables.group_of_ids([id], groups)``)."""

    def to_json(self) -> str:
        """Stored form (``tables`` only when the model has some: a dense model's meta is as before)."""
        raw = {"layout": json.loads(self.layout.to_json()), "optimizer": json.loads(self.optimizer.to_json()),
               "groups": self.groups}
        if self.tables:
            raw["tables"] = tables_to_json(self.tables)
        return json.dumps(raw, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelMeta:
        """Inverse of :meth:`to_json`."""
        raw = json.loads(text)
        return cls(Layout.from_json(json.dumps(raw["layout"])),
                   OptimizerConfig(**raw["optimizer"]), int(raw["groups"]), tables_from_json(raw.get("tables", [])))

    def table(self, name: str) -> TableSpec:
        """The spec of embedding table ``name``.

        Raises:
            LayoutError: the model has no such table (names the ones it has).
        """
        for t in self.tables:
            if t.name == name:
                return t
        raise LayoutError(f"no embedding table {name!r} in the model (tables: {[t.name for t in self.tables]})")


@dataclass(frozen=True)
class Snapshot:
    """A consistent view of the model: every tensor as it was at the model version :attr:`group_versions`."""

    version: int
    """The sum of :attr:`group_versions`: it grows with every apply of any group (a reader's
    successive snapshots are ordered by it), but it names no model; the vector does."""
    versions: tuple[int, ...]
    """Version of each shard (the version of its group that last changed it)."""
    tensors: dict[str, torch.Tensor]
    """Tensors by name (float32). Treat as read-only: a later pull shares the tensors that did
    not change (or, pulled with ``out=``, writes into them)."""
    fetched: tuple[int, ...]
    """Shard indices this pull changed (all of them on a first pull)."""
    wire_bytes: int = 0
    """Shard and delta bytes this pull read from Redis."""
    group_versions: tuple[int, ...] = (0,)
    """Each group's version: every shard of group g is as it was at ``group_versions[g]``."""


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
                   optimizer: OptimizerConfig | None = None, groups: int | None = None,
                   tables: Sequence[TableSpec] = ()) -> ModelMeta:
        """Store the model's initial parameters unless the job already has a model.

        Idempotent: the first writer wins; a later caller gets the stored meta
        back after checking its tensors have the stored layout. ``groups`` (the
        number of parameter-server shard groups) defaults to the job config's
        ``ps_groups`` field, else 1. ``tables``: the model's embedding tables (they start
        empty: a row is born when its ID is admitted).

        Raises:
            LayoutError: the tensors or tables do not match the stored ones (names the difference),
                or a tensor is not floating point.
            ValueError: ``groups`` < 1 or a bad ``shard_elems``.
        """
        if groups is None:
            groups = int(self.client.hget(self.keys.config, "ps_groups") or 1)
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        layout = make_layout(tensors, shard_elems)
        meta = ModelMeta(layout, optimizer or OptimizerConfig(), groups, validate_tables(tables))
        flat = {name: t.detach().to("cpu", torch.float32).reshape(-1).contiguous()
                for name, t in tensors.items()}
        blobs = [flat[s.name][s.start:s.start + s.numel].numpy().tobytes() for s in layout.shards]
        stored = self._create(meta, blobs)
        diff = stored.layout.describe_difference(layout)
        if diff is None and stored.tables != meta.tables:
            diff = (f"embedding tables {[t.to_dict() for t in meta.tables]}, stored "
                    f"{[t.to_dict() for t in stored.tables]}")
        if diff is not None:
            raise LayoutError(f"job {self.keys.job}: model does not match the stored one: {diff}")
        if stored == meta:
            logger.info("job %s: model initialised with %d tensors, %d shards, %d values, %d group(s)",
                        self.keys.job, len(layout.tensors), len(layout.shards), layout.numel, groups)
        self._meta = stored
        return stored

    def _create(self, meta: ModelMeta, blobs: list[bytes]) -> ModelMeta:
        """The stored meta, after creating the model when the job has none: one writer takes the
        init lock, fills every group's slot with its shards at version 0, and writes ``meta`` last,
        so a reader that sees ``meta`` finds every group ready. The others wait for ``meta``."""
        token = uuid.uuid4().hex
        deadline = time.monotonic() + _INIT_WAIT_S
        while True:
            raw = self.client.get(self.keys.meta)
            if raw is not None:
                return ModelMeta.from_json(raw)
            if self.client.set(self.keys.init_lock, token, nx=True, px=_INIT_LOCK_MS):
                try:
                    for g in range(meta.groups):
                        self._create_group(meta, g, blobs)
                    self.client.set(self.keys.meta, meta.to_json(), nx=True)
                finally:
                    if self.client.get(self.keys.init_lock) == token.encode():
                        self.client.delete(self.keys.init_lock)
                continue
            if time.monotonic() >= deadline:
                raise LayoutError(f"job {self.keys.job}: another writer has been creating the model for "
                                  f"{_INIT_WAIT_S:.0f} s (init lock {self.keys.init_lock}); is it stuck?")
            time.sleep(0.05)

    def _create_group(self, meta: ModelMeta, group: int, blobs: list[bytes]) -> None:
        """Group ``group``'s shards at version 0 and nothing else (a writer that died before writing
        ``meta`` may have left a partial group: it is replaced), in one MULTI/EXEC."""
        gk = self.keys.group(group)
        own = own_shards(meta.layout, meta.groups, group)
        stale = [gk.version, gk.versions, gk.bases, gk.delta_floors, gk.cursor, gk.persisted, gk.unaccounted,
                 gk.optimizer_steps, gk.table_stats, gk.feed, gk.feed_head,
                 *(k for t in meta.tables for k in (gk.table_rows(t.name), gk.table_seen(t.name))),
                 *(gk.deltas(i) for i in own),
                 *(gk.optimizer_state(i, k) for i in own for k in range(slots(meta.optimizer)))]
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*stale)
        for i in own:
            pipe.set(gk.shard(i), blobs[i])
        if own:
            zeros: dict[FieldT, int] = {str(i): 0 for i in own}
            pipe.hset(gk.versions, mapping=zeros)
            pipe.hset(gk.bases, mapping=zeros)
            pipe.hset(gk.delta_floors, mapping=zeros)
        pipe.set(gk.version, 0)
        pipe.execute()

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

    def group_versions(self) -> tuple[int, ...]:
        """Each group's current version (one read per group: they live in different slots)."""
        pipe = self.client.pipeline(transaction=False)
        for g in range(self.meta().groups):
            pipe.get(self.keys.group(g).version)
        return tuple(int(v or 0) for v in pipe.execute())

    def version(self) -> int:
        """The sum of the groups' current versions (:attr:`Snapshot.version`: an order, not a name)."""
        return sum(self.group_versions())

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
            snap = self._pull_since(cast(Snapshot, since), out)
            if snap is not None:
                return snap
        return self._pull_full(out)

    def _pull_full(self, out: Mapping[str, torch.Tensor] | None) -> Snapshot:
        """Every shard: full bytes plus the deltas after its base, one MULTI/EXEC per group."""
        meta = self.meta()
        shards = meta.layout.shards
        tensors, flats = self._targets(None, out, [s.index for s in shards])
        versions = [0] * len(shards)
        group_versions = []
        moved = 0
        for g in range(meta.groups):
            gk, own = self.keys.group(g), own_shards(meta.layout, meta.groups, g)
            pipe = self.client.pipeline(transaction=True)
            pipe.get(gk.version)
            pipe.hgetall(gk.versions)
            pipe.hgetall(gk.bases)
            pipe.mget([gk.shard(i) for i in own] or [gk.version])
            for i in own:
                pipe.xrange(gk.deltas(i))
            raw_version, raw_versions, raw_bases, blobs, *streams = pipe.execute()
            version = int(raw_version or 0)
            group_versions.append(version)
            shard_versions, bases = self._versions(raw_versions, own), self._versions(raw_bases, own)
            for j, i in enumerate(own):
                s = shards[i]
                versions[i] = shard_versions[i]
                moved += self._rebuild(flats[s.name], s, blobs[j], bases[i], streams[j], version)
        return Snapshot(sum(group_versions), tuple(versions), tensors, tuple(range(len(shards))), moved,
                        tuple(group_versions))

    def _pull_since(self, since: Snapshot, out: Mapping[str, torch.Tensor] | None) -> Snapshot | None:
        """Per group: the deltas after ``since``'s version of it (one MULTI/EXEC), and the full bytes
        of shards whose deltas were compacted away (a second one); None when a compaction in between
        forces a retry."""
        meta = self.meta()
        shards = meta.layout.shards
        versions = list(since.versions)
        group_versions = list(since.group_versions)
        reads: list[tuple[int, list[int], dict[int, list], dict[int, tuple[bytes | None, int, list]]]] = []
        for g in range(meta.groups):
            gk, own, held = self.keys.group(g), own_shards(meta.layout, meta.groups, g), since.group_versions[g]
            pipe = self.client.pipeline(transaction=True)
            pipe.get(gk.version)
            pipe.hgetall(gk.versions)
            pipe.hgetall(gk.delta_floors)
            for i in own:
                pipe.xrange(gk.deltas(i), min=str(held + 1))
            raw_version, raw_versions, raw_floors, *streams = pipe.execute()
            version = int(raw_version or 0)
            if version == held:
                continue
            shard_versions, floors = self._versions(raw_versions, own), self._versions(raw_floors, own)
            changed = [i for i in own if shard_versions[i] != since.versions[i]]
            full = [i for i in changed if floors[i] > held]
            blobs: dict[int, tuple[bytes | None, int, list]] = {}
            if full:
                pipe = self.client.pipeline(transaction=True)
                pipe.hgetall(gk.bases)
                pipe.mget([gk.shard(i) for i in full])
                for i in full:
                    pipe.xrange(gk.deltas(i))
                raw_bases, full_blobs, *full_streams = pipe.execute()
                bases = self._versions(raw_bases, own)
                if any(bases[i] > version for i in full):
                    return None  # compacted after the first read: its deltas up to `version` may be gone
                blobs = {i: (b, bases[i], st) for i, b, st in zip(full, full_blobs, full_streams, strict=True)}
            group_versions[g] = version
            for i in own:
                versions[i] = shard_versions[i]
            reads.append((version, changed, dict(zip(own, streams, strict=True)), blobs))
        changed_all = [i for _, changed, _, _ in reads for i in changed]
        if not changed_all:
            return Snapshot(sum(group_versions), tuple(versions), since.tensors, (), 0, tuple(group_versions))
        tensors, flats = self._targets(since, out, changed_all)
        moved = 0
        for version, changed, streams, blobs in reads:  # type: ignore[assignment]  # streams: a list above, by shard here
            for i in changed:
                s = shards[i]
                if i in blobs:
                    blob, base, entries = blobs[i]
                    moved += self._rebuild(flats[s.name], s, blob, base, entries, version)
                else:
                    seg = flats[s.name][s.start:s.start + s.numel]
                    moved += apply_deltas(seg, streams[i], after=since.group_versions[s.index % len(group_versions)],
                                          upto=version, what=f"delta of shard {i} ({s.name})")
        return Snapshot(sum(group_versions), tuple(versions), tensors, tuple(sorted(changed_all)), moved,
                        tuple(group_versions))

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
                tensors[spec.name] = cast(Snapshot, since).tensors[spec.name]
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

    def _versions(self, raw: Mapping[bytes, bytes], own: list[int]) -> dict[int, int]:
        """Shard -> version from a group's hash, which must name exactly the group's shards ``own``."""
        out = {int(k): int(v) for k, v in raw.items()}
        if sorted(out) != own:
            raise LayoutError(f"job {self.keys.job}: {len(out)} shard versions stored in a group, its layout "
                              f"has {len(own)}")
        return out
