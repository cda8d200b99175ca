"""Helpers shared by the parameter-plane tests (membership as the coordinator writes it, small models)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import redis as redis_lib
import torch

from common.keys import JobKeys


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
            pipe.hset(keys.assignment, str(p), f"{member}|{generation}")
    for member in departed:
        pipe.hdel(keys.members, member)
    pipe.execute()


def small_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three tensors; with shard_elems=64 the weight splits into several shards."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(10, 20, generator=g), "b": torch.randn(20, generator=g),
            "v": torch.randn(5, generator=g)}

