"""The parameter store: a model's shards in Redis, initialised once, pulled as consistent snapshots.

What the job's and each group's slots hold, and how a group is read in one MULTI/EXEC, is
:mod:`services.slots`; this module creates the model (:meth:`ParameterStore.init_model`) and rebuilds
its tensors from what a pull reads. A model version is the vector of the groups' versions
(:attr:`Snapshot.group_versions`, ``services.slot_types.VersionVector``); their sum orders one reader's
snapshots but names no model. Why a pull is consistent per group (invariant 3), and how a pull since a
snapshot moves only the changed coordinates: ``docs/parameter-plane.md`` (*Redis data model*, *Pulls and
snapshots*).
"""

from __future__ import annotations

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
from .optim import OptimizerConfig
from .slots import GroupRead, GroupSlot, ModelMeta, read_meta
from .tables.spec import TableSpec, validate_tables

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
        ``ps_groups`` field, else 1: the config only seeds the count, which from then on is the
        stored meta's (``services.slots``). ``tables``: the model's embedding tables (they start
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
        slot = GroupSlot.of(self.client, self.keys.job, meta, group)
        gk = slot.keys
        pipe = self.client.pipeline(transaction=True)
        slot.clear(pipe, restored=False)
        for i in slot.own:
            pipe.set(gk.shard(i), blobs[i])
        if slot.own:
            zeros: dict[FieldT, int] = {str(i): 0 for i in slot.own}
            pipe.hset(gk.versions, mapping=zeros)
            pipe.hset(gk.bases, mapping=zeros)
            pipe.hset(gk.delta_floors, mapping=zeros)
        pipe.set(gk.version, 0)
        pipe.execute()

    def meta(self, *, refresh: bool = False) -> ModelMeta:
        """The job's stored model meta (cached).

        Raises:
            NoModelError: the job has no model yet (a LayoutError).
        """
        if self._meta is None or refresh:
            self._meta = read_meta(self.client, self.keys.job)
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
            slot = GroupSlot.of(self.client, self.keys.job, meta, g)
            read = slot.read("version", "versions", "bases", "shards", "deltas")
            group_versions.append(read.version)
            shard_versions, bases = self._versions(read.versions, slot.own), self._versions(read.bases, slot.own)
            for i in slot.own:
                s = shards[i]
                versions[i] = shard_versions[i]
                moved += self._rebuild(flats[s.name], s, read.shards[i], bases[i], read.deltas[i], read.version)
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
        reads: list[tuple[int, list[int], GroupRead, GroupRead | None]] = []
        for g in range(meta.groups):
            slot, held = GroupSlot.of(self.client, self.keys.job, meta, g), since.group_versions[g]
            read = slot.read("version", "versions", "delta_floors", "deltas", after=held)
            if read.version == held:
                continue
            shard_versions = self._versions(read.versions, slot.own)
            floors = self._versions(read.delta_floors, slot.own)
            changed = [i for i in slot.own if shard_versions[i] != since.versions[i]]
            full = [i for i in changed if floors[i] > held]
            whole = None
            if full:
                whole = slot.read("bases", shards=full, deltas=full)
                bases = self._versions(whole.bases, slot.own)
                if any(bases[i] > read.version for i in full):
                    return None  # compacted after the first read: its deltas up to `version` may be gone
            group_versions[g] = read.version
            for i in slot.own:
                versions[i] = shard_versions[i]
            reads.append((held, changed, read, whole))
        changed_all = [i for _, changed, _, _ in reads for i in changed]
        if not changed_all:
            return Snapshot(sum(group_versions), tuple(versions), since.tensors, (), 0, tuple(group_versions))
        tensors, flats = self._targets(since, out, changed_all)
        moved = 0
        for held, changed, read, whole in reads:
            for i in changed:
                s = shards[i]
                if whole is not None and i in whole.shards:
                    moved += self._rebuild(flats[s.name], s, whole.shards[i], whole.bases[i], whole.deltas[i],
                                           read.version)
                else:
                    seg = flats[s.name][s.start:s.start + s.numel]
                    moved += apply_deltas(seg, read.deltas[i], after=held, upto=read.version,
                                          what=f"delta of shard {i} ({s.name})")
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

    def _versions(self, out: Mapping[int, int], own: Sequence[int]) -> Mapping[int, int]:
        """Shard -> version of a group's hash (:class:`services.slots.GroupRead`), which must name
        exactly the group's shards ``own``."""
        if sorted(out) != list(own):
            raise LayoutError(f"job {self.keys.job}: {len(out)} shard versions stored in a group, its layout "
                              f"has {len(own)}")
        return out
