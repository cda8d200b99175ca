"""Redis persistence of the control plane, with the generation as fencing token.

:class:`Store` keeps the membership, the assignment (each partition's owner as a fence token), the
departed members and the job config in the job's slot, and changes them by compare-and-set: WATCH, the
pure :func:`coordinator.membership.handle`, one MULTI/EXEC. The parameter plane's push script reads
the same keys to fence stale trainers. See docs/architecture.md, *The control plane: membership and
assignment* (*State in Redis*).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError
from redis.typing import FieldT

from common.fence import fence_token, parse_fence_token
from common.keys import JobKeys
from services.slot_types import MetaHead

from .assignment import FOLLOW_DENSE, LOCAL_STEPS, JobConfig
from .errors import ConflictError, MemberGoneError, UnknownMemberError
from .membership import Action, CheckLeases, Departure, Event, Member, Membership, departures, forgotten, handle
from .settings import CoordinatorSettings

logger = logging.getLogger(__name__)

MAX_CAS_ATTEMPTS = 50
"""Compare-and-set retries before :class:`ConflictError`."""

FORGET_EVERY_MS = 60_000
"""Longest time between two sweeps of the departed-member records (shorter when the retention is)."""

FIXED_CONFIG: Mapping[str, str] = MappingProxyType({
    "ps_groups": "the parameter-server shard groups are fixed when the job's model is created "
                 "(shard i belongs to group i mod ps_groups); start a new job to change it",
    **dict.fromkeys(LOCAL_STEPS, "local steps and the outer optimizer are fixed when the job's model is created "
                                 "(the parameter servers apply the outer optimizer the model was stored with); "
                                 "start a new job to change them"),
})
"""Job config fields that never change once the job exists, with the reason (for refusals)."""


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_assignment(raw: Mapping[bytes | str, bytes | str]) -> dict[int, tuple[str, int]]:
    """``JobKeys.assignment`` hash -> partition -> (member id, generation)."""
    return {int(_s(p)): parse_fence_token(v) for p, v in raw.items()}


class Store:
    """The membership state of one job in Redis (async client)."""

    def __init__(self, redis: aioredis.Redis, job: str,
                 departed_retention_s: float = CoordinatorSettings.departed_retention_s) -> None:
        if departed_retention_s < 0:
            raise ValueError(f"departed_retention_s must be >= 0, got {departed_retention_s!r}")
        self.redis = redis
        self.keys = JobKeys(job)
        self.departed_retention_ms = round(departed_retention_s * 1000)
        """How long a departed member's record is kept."""
        self._forget_at_ms = 0
        """Time from which the next :class:`CheckLeases` also sweeps the departed records."""

    # -- job configuration ----------------------------------------------------
    async def ensure_config(self, initial: JobConfig) -> JobConfig:
        """Write ``initial`` field by field where absent (HSETNX); return what is stored.

        A restarted coordinator therefore continues with the stored configuration. The fields of
        :data:`~coordinator.assignment.FOLLOW_DENSE` are written only when the job begins (no
        config is stored yet): for them absence is a value (follow the dense part), which a
        restart keeps. When the job's model already exists, ``ps_groups`` is the model's group
        count, whatever ``initial`` says (a job begun before the field was written gains the true
        value).

        Raises:
            ConflictError: the config changed under it :data:`MAX_CAS_ATTEMPTS` times.
        """
        groups = await self.model_groups()
        if groups is not None:
            initial = replace(initial, ps_groups=groups)
        async with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(MAX_CAS_ATTEMPTS):
                try:
                    await pipe.watch(self.keys.config)
                    # HLEN, not EXISTS: a cluster pipeline splits EXISTS by slot and drops its reply
                    begun = await pipe.hlen(self.keys.config) > 0
                    pipe.multi()
                    for k, v in initial.to_hash().items():
                        if not (begun and k in FOLLOW_DENSE):
                            pipe.hsetnx(self.keys.config, k, v)
                    await pipe.execute()
                    return await self.config()
                except WatchError:
                    continue
        raise ConflictError(f"config of job {self.keys.job!r} changed concurrently {MAX_CAS_ATTEMPTS} times")

    async def model_groups(self) -> int | None:
        """The shard-group count of the job's model (``services.slot_types.MetaHead`` of its meta,
        written by ``services.ParameterStore.init_model``): the job's one group count once the model
        exists; None while there is no model (or its meta is unreadable)."""
        raw = await self.redis.get(self.keys.meta)
        if raw is None:
            return None
        try:
            return MetaHead.parse(raw).groups
        except ValueError:
            return None

    async def groups(self, config: JobConfig) -> int:
        """The job's shard-group count: its model's (:meth:`model_groups`) once the model exists,
        else ``config``'s ``ps_groups``, which seeds the model's creation (``services.slots``: one
        source for the count)."""
        return await self.model_groups() or config.ps_groups

    async def config(self) -> JobConfig:
        """The stored job configuration.

        Raises:
            ValueError: it is missing or malformed.
        """
        return JobConfig.from_hash(await self.redis.hgetall(self.keys.config))

    async def update_config(self, **changes: Any) -> JobConfig:
        """Validate and store ``changes`` (fields of :class:`JobConfig`); return the result.

        A field of :data:`~coordinator.assignment.FOLLOW_DENSE` changed to None is removed from
        the hash (it follows the dense part again).

        Raises:
            ValueError: an unknown field, a bad value, or a field of :data:`FIXED_CONFIG`
                (the message names it and says why); nothing is written.
        """
        fixed = sorted(set(changes) & FIXED_CONFIG.keys())
        if fixed:
            raise ValueError(f"{fixed[0]} cannot change: {FIXED_CONFIG[fixed[0]]}")
        current = await self.config()
        new = replace(current, **changes)  # TypeError for unknown fields, ValueError for bad ones
        before, after = current.to_hash(), new.to_hash()
        diff: dict[FieldT, str] = {k: v for k, v in after.items() if before.get(k) != v}
        unset = sorted(set(before) - set(after))
        if diff or unset:
            async with self.redis.pipeline(transaction=True) as pipe:
                if diff:
                    pipe.hset(self.keys.config, mapping=diff)
                if unset:
                    pipe.hdel(self.keys.config, *unset)
                await pipe.execute()
            logger.info("job config of %s changed: %s%s", self.keys.job, diff,
                        f", unset (following the dense part): {', '.join(unset)}" if unset else "")
        return new

    # -- membership -------------------------------------------------------------
    async def _read(self, client: Any, partitions: int) -> Membership:
        gen = await client.get(self.keys.generation)
        raw_members = await client.hgetall(self.keys.members)
        raw_assign = await client.hgetall(self.keys.assignment)
        members = {_s(k): Member.from_json(v) for k, v in raw_members.items()}
        assignment = {p: m for p, (m, _) in parse_assignment(raw_assign).items()}
        return Membership(generation=int(gen or 0), members=MappingProxyType(members),
                          assignment=MappingProxyType(assignment),
                          partitions=tuple(range(partitions)))

    async def load(self) -> Membership:
        """The current membership (not atomic with later writes; for reads only)."""
        partitions = (await self.config()).partitions
        return await self._read(self.redis, partitions)

    async def departure(self, member_id: str) -> dict[str, Any] | None:
        """Why ``member_id`` is gone (``{"reason", "generation", "at_ms"}``), or None."""
        raw = await self.redis.hget(self.keys.departed, member_id)
        return json.loads(raw) if raw is not None else None

    async def forget_departed(self, now_ms: int) -> list[str]:
        """Drop the departed-member records older than the retention at ``now_ms`` (an
        unreadable one too); returns their ids. Records are written once per id (ids are never
        reused), so this needs no compare-and-set."""
        raw = await self.redis.hgetall(self.keys.departed)
        records = {}
        for k, v in raw.items():
            try:
                records[_s(k)] = Departure.from_json(v)
            except ValueError:
                records[_s(k)] = Departure("unreadable", 0, 0)
        gone = forgotten(records, now_ms, self.departed_retention_ms)
        if gone:
            await self.redis.hdel(self.keys.departed, *gone)
            logger.info("forgot %d departed member(s) of %s older than %.0fs", len(gone), self.keys.job,
                        self.departed_retention_ms / 1000)
        self._forget_at_ms = now_ms + max(1000, min(FORGET_EVERY_MS, self.departed_retention_ms))
        return gone

    async def apply(self, event: Event,
                    before_commit: Callable[[list[Action]], None] | None = None,
                    ) -> tuple[Membership, list[Action]]:
        """Apply ``event`` with compare-and-set; return the new state and its actions.

        ``before_commit`` is called with the actions right before the write (it
        logs them first; it may run again if the compare-and-set is retried).

        Raises:
            UnknownMemberError: the event names a member never registered.
            MemberGoneError: it names a member that left or expired.
            ValueError: the event is invalid for the state (e.g. a reused id).
            ConflictError: concurrent writers won :data:`MAX_CAS_ATTEMPTS` times.
        """
        if isinstance(event, CheckLeases) and event.now_ms >= self._forget_at_ms:
            await self.forget_departed(event.now_ms)
        partitions = (await self.config()).partitions
        watched = (self.keys.generation, self.keys.members, self.keys.assignment)
        async with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(MAX_CAS_ATTEMPTS):
                try:
                    await pipe.watch(*watched)
                    state = await self._read(pipe, partitions)
                    try:
                        nxt, actions = handle(state, event)
                    except UnknownMemberError:
                        await pipe.reset()
                        member_id = getattr(event, "member_id", "")
                        gone = await self.departure(member_id)
                        if gone is not None:
                            raise MemberGoneError(
                                f"member {member_id!r} is gone ({gone['reason']} at generation "
                                f"{gone['generation']}); register anew") from None
                        raise
                    if nxt is state:
                        await pipe.reset()
                        return state, actions
                    if before_commit is not None:
                        before_commit(actions)
                    pipe.multi()
                    self._write(pipe, state, nxt, actions)
                    await pipe.execute()
                    return nxt, actions
                except WatchError:
                    logger.debug("membership CAS of %s lost a race; retrying", self.keys.job)
                    continue
        raise ConflictError(f"membership of job {self.keys.job!r} changed concurrently "
                            f"{MAX_CAS_ATTEMPTS} times; giving up")

    def _write(self, pipe: Any, old: Membership, new: Membership, actions: Iterable[Action]) -> None:
        k = self.keys
        removed = [m for m in old.members if m not in new.members]
        if removed:
            pipe.hdel(k.members, *removed)
        changed = {m: v.to_json() for m, v in new.members.items() if old.members.get(m) != v}
        if changed:
            pipe.hset(k.members, mapping=changed)
        if new.generation != old.generation:
            pipe.set(k.generation, new.generation)
            pipe.delete(k.assignment)
            if new.assignment:
                pipe.hset(k.assignment, mapping={str(p): fence_token(m, new.generation)
                                                 for p, m in new.assignment.items()})
        gone = departures(list(actions))
        if gone:
            pipe.hset(k.departed, mapping={m: d.to_json() for m, d in gone.items()})

