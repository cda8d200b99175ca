"""Helpers shared by the parameter-plane tests (membership as the coordinator writes it, small models, and what
a job keeps in its shard groups' slots)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import redis as redis_lib
import torch

from common.fence import fence_token
from common.keys import JobKeys
from services.protocol import Update, group_of
from services.push.updates import push_update


def set_membership(client: redis_lib.Redis, job: str, owners: Mapping[str, list[int]], generation: int,
                   departed: tuple[str, ...] = ()) -> None:
    """Write generation, members and assignment atomically, like the coordinator does on a bump."""
    keys = JobKeys(job)
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.assignment)
    pipe.set(keys.generation, generation)
    for member, parts in owners.items():
        pipe.hset(keys.members, member, json.dumps({"member_id": member, "heartbeat_ms": 0}))
        for p in parts:
            pipe.hset(keys.assignment, str(p), fence_token(member, generation))
    for member in departed:
        pipe.hdel(keys.members, member)
    pipe.execute()


def push_offsets_only(client: redis_lib.Redis, job: str, member_id: str, generation: int,
                      partitions: list[int], clock: int) -> str:
    """Push an update without gradients for ``partitions`` (an empty offset range at each one's
    committed offset) through the real push script, fenced as a trainer's push is (no model needed).

    Raises:
        services.errors.FencedError: the generation is stale or a partition has another owner."""
    keys = JobKeys(job)
    offsets = {p: (int(client.hget(keys.offsets, str(p)) or 0),) * 2 for p in partitions}
    update = Update(member_id, generation=generation, clock=clock, gradients={}, offsets=offsets)
    return push_update(client, job, update, groups=1)


def small_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three tensors; with shard_elems=64 the weight splits into several shards."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(10, 20, generator=g), "b": torch.randn(20, generator=g),
            "v": torch.randn(5, generator=g)}


def stored_groups(client: redis_lib.Redis, job: str) -> int:
    """The job's number of shard groups, from its model's meta (1 while it has no model)."""
    raw = client.get(JobKeys(job).meta)
    return 1 if raw is None else int(json.loads(raw)["groups"])


def gradient_blobs(client: redis_lib.Redis, job: str) -> list[bytes]:
    """Every gradient blob key of ``job`` left in any of its groups' slots, sorted."""
    keys = JobKeys(job)
    return sorted(k for g in range(stored_groups(client, job))
                  for k in client.keys(keys.group(g).update_blob("*", "*")))


def staged_values(client: redis_lib.Redis, job: str) -> list[bytes]:
    """Every staging key of ``job`` left in any of its groups' slots (an apply's, not renamed or dropped)."""
    keys = JobKeys(job)
    return sorted(k for g in range(stored_groups(client, job))
                  for k in client.keys(keys.group(g).staging("*", "*")))


def optimizer_steps(client: redis_lib.Redis, job: str) -> dict[bytes, bytes]:
    """Shard -> optimizer steps persisted, over every group of ``job``."""
    keys = JobKeys(job)
    out: dict[bytes, bytes] = {}
    for g in range(stored_groups(client, job)):
        out.update(client.hgetall(keys.group(g).optimizer_steps))
    return out


def optimizer_state(client: redis_lib.Redis, job: str, shards: int, slots: int) -> list[bytes | None]:
    """Every persisted optimizer state value of ``job`` (shard by shard, slot by slot), each read from
    its shard's group."""
    keys, groups = JobKeys(job), stored_groups(client, job)
    return [client.get(keys.group(group_of(i, groups)).optimizer_state(i, s))
            for i in range(shards) for s in range(slots)]


def accounting_left(client: redis_lib.Redis, job: str) -> list[bytes]:
    """The ``applied_by`` hashes still open (an update some group has not reported yet)."""
    return sorted(client.keys(JobKeys(job).applied_by("*")))


class LosesPushReply(redis_lib.Redis):
    """A client of the real Redis whose push transaction (the MULTI/EXEC with the push script's
    EVALSHA) runs, and is committed, and then raises ``error`` as if the reply were lost on the way
    back (a dropped connection, a timeout, a Redis Cluster that answers CLUSTERDOWN)."""

    def __init__(self, error: type[Exception], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error = error

    def pipeline(self, transaction: bool = True, shard_hint: object = None) -> redis_lib.client.Pipeline:
        client = self

        class LosesReply(redis_lib.client.Pipeline):
            def execute(self, raise_on_error: bool = True) -> list:
                pushing = any(args[0] == "EVALSHA" for args, _ in self.command_stack)
                replies = super().execute(raise_on_error)
                if pushing:
                    raise client.error(f"reply of the push lost ({client.error.__name__})")
                return replies

        return LosesReply(self.connection_pool, self.response_callbacks, transaction, shard_hint)
