"""Read-only views of a job for ``/v1/status``, ``/v1/members`` and ``/v1/partitions``, and the serving
replicas' last reports (:class:`ServingReports`, kept in memory, shown in ``/v1/status``'s ``serving``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from common.keys import JobKeys

from .membership import Member, Membership
from .state import JobConfig, parse_assignment

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from redis.asyncio.client import Pipeline

logger = logging.getLogger(__name__)


def _ints(raw: Mapping[bytes, bytes]) -> dict[str, int]:
    out = {}
    for k, v in raw.items():
        try:
            out[k.decode()] = int(v)
        except ValueError:
            logger.debug("ignoring non-integer entry %r=%r", k, v)
    return out


def member_view(member: Member, state: Membership, now_ms: int) -> dict[str, Any]:
    """JSON of one member with its partitions and remaining lease."""
    return {"member_id": member.member_id, "state": member.state.value,
            "capabilities": dict(member.capabilities), "weight": member.weight,
            "partitions": state.partitions_of(member.member_id),
            "registered_ms": member.registered_ms, "last_seen_ms": member.last_seen_ms,
            "lease_expires_ms": member.lease_expires_ms,
            "lease_left_ms": max(0, member.lease_expires_ms - now_ms), "stats": dict(member.stats)}


def members_view(state: Membership, now_ms: int) -> list[dict[str, Any]]:
    """JSON of every live member, by id."""
    return [member_view(state.members[m], state, now_ms) for m in sorted(state.members)]


def partitions_view(state: Membership, raw_assignment: Mapping[bytes | str, bytes | str],
                    committed: Mapping[str, int],
                    kafka: Mapping[int, tuple[int, int]] | None) -> list[dict[str, Any]]:
    """JSON of every partition: owner, generation, committed/beginning/end offsets and lag.

    ``kafka`` is partition -> (beginning, end) or None when Kafka is unreachable
    (offsets and lag are then null). Lag counts from the committed offset, or
    from the beginning when nothing is committed yet.
    """
    owners = parse_assignment(raw_assignment)
    out = []
    for p in state.partitions:
        owner, gen = owners.get(p, (None, None))
        begin, end = (kafka or {}).get(p, (None, None))
        done = committed.get(str(p))
        start = done if done is not None else begin
        lag = max(0, end - start) if end is not None and start is not None else None
        out.append({"partition": p, "owner": owner, "generation": gen, "committed": done,
                    "beginning": begin, "end": end, "lag": lag})
    return out


def queuegroup_versions(pipe: Pipeline, keys: JobKeys, groups: int) -> None:
    """Queue on ``pipe`` a read of the version of each of the job's ``groups`` shard groups (its
    model's count, ``coordinator.state.Store.groups``); :func:`model_version` and :func:`versions_view`
    read the replies. Each group's version lives in its own hash slot, so ``pipe`` must be a
    non-transactional pipeline (one round trip; under Redis Cluster, one per node)."""
    for g in range(groups):
        pipe.get(keys.group(g).version)


@dataclass(frozen=True)
class PlaneRead:
    """What :func:`read_plane` read, by name."""

    versions: list[bytes | None]
    """Each group's version as stored (the replies :func:`model_version` and :func:`versions_view` read)."""
    hashes: dict[str, dict[bytes, bytes]]
    """The job's hashes asked for, by their name in ``JobKeys``."""


async def read_plane(redis: aioredis.Redis, keys: JobKeys, groups: int, *hashes: str) -> PlaneRead:
    """Each of the ``groups`` groups' versions and the job's ``hashes`` (names in ``JobKeys``), in one
    non-transactional round trip (the groups' versions are in their own slots), returned by name."""
    pipe = redis.pipeline(transaction=False)
    queuegroup_versions(pipe, keys, groups)
    for name in hashes:
        pipe.hgetall(getattr(keys, name))
    replies = await pipe.execute()
    return PlaneRead(list(replies[:groups]), dict(zip(hashes, replies[groups:], strict=True)))


def group_versions(raw: Sequence[bytes | None]) -> list[int] | None:
    """Each group's version from the replies of :func:`queue_group_versions` (None while no group has
    one: the job has no model yet)."""
    if all(v is None for v in raw):
        return None
    return [int(v or 0) for v in raw]


def model_version(raw: Sequence[bytes | None]) -> int | None:
    """The model version (the sum of the groups' versions: it grows with every write of any group)
    from the replies of :func:`queue_group_versions`; None before the model exists."""
    versions = group_versions(raw)
    return None if versions is None else sum(versions)


def versions_view(raw: Sequence[bytes | None]) -> dict[str, Any]:
    """JSON of the parameter versions from the replies of :func:`queue_group_versions`: ``model``
    (the model version, the sum of the groups'), ``groups`` (group -> its version) and the ``min``
    and ``max`` of the groups' versions (how far apart the groups are; equal with one group). All
    null, and ``groups`` empty, before the model exists."""
    versions = group_versions(raw)
    if versions is None:
        return {"model": None, "groups": {}, "min": None, "max": None}
    return {"model": sum(versions), "groups": {str(g): v for g, v in enumerate(versions)},
            "min": min(versions), "max": max(versions)}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary(state: Membership, config: JobConfig, versions: Sequence[bytes | None],
            clocks: Mapping[bytes, bytes], applied: Mapping[bytes, bytes]) -> dict[str, Any]:
    """Parameter versions (``versions``: the replies of :func:`queue_group_versions`; see
    :func:`versions_view`), staleness, throughput, loss and accuracy of the job (and the held-out AUC
    and log loss of a binary model).

    Measured staleness is the spread between the furthest live member's pushed
    clock and the slowest live member's applied clock (absent while the
    parameter plane has written no clocks). ``tables`` is the embedding tables'
    consistency model and bound as resolved by :meth:`JobConfig.table_bound`
    (the dense part's where the job sets none of its own).
    """
    live = set(state.members)
    pushed = {m: c for m, c in _ints(clocks).items() if m in live}
    done = {m: c for m, c in _ints(applied).items() if m in live}
    stats = [m.stats for m in state.members.values()]
    reported = [s["staleness"] for s in stats if "staleness" in s]
    measured = max(pushed.values()) - min(done.values()) if pushed and done else None
    table_mode, table_bound = config.table_bound()
    return {
        "versions": versions_view(versions),
        "staleness": {"consistency": config.consistency, "bound": config.staleness,
                      "tables": {"consistency": table_mode, "bound": table_bound},
                      "clock_spread": measured, "reported_max": max(reported, default=None),
                      "clocks": pushed, "applied_clocks": done},
        "throughput_records_per_s": sum(s.get("records_per_s", 0.0) for s in stats),
        "loss": _mean([s["loss"] for s in stats if "loss" in s]),
        "accuracy": _mean([s["accuracy"] for s in stats if "accuracy" in s]),
        "auc": _mean([s["auc"] for s in stats if "auc" in s]),
        "log_loss": _mean([s["log_loss"] for s in stats if "log_loss" in s]),
    }


# -- serving replicas ---------------------------------------------------------------------------

FORGET_AFTER_S = 10.0
"""A replica not heard from for this long is forgotten (it reports every second)."""
MOST_REPLICAS = 1024
"""Replicas remembered at once: a report of a new one beyond them is refused (429), so what the
coordinator keeps is bounded however many names callers make up (each is forgotten after
:data:`FORGET_AFTER_S`)."""


class TooManyReplicas(Exception):
    """:data:`MOST_REPLICAS` replicas are known already and a report names another."""


@dataclass
class _Replica:
    report: dict[str, Any]
    at: float
    """``clock()`` when the report arrived."""
    requests_per_s: float | None = None
    """From this report's and the previous one's request counts (None after the first report, or when the
    count went down: the replica restarted under the same name)."""


@dataclass
class ServingReports:
    """The last report of each serving replica (``POST /v1/serving/replicas/<name>``), in memory only:
    a restarted coordinator knows the replicas again within a report interval."""

    clock: Callable[[], float] = time.monotonic
    replicas: dict[str, _Replica] = field(default_factory=dict)

    def _forget(self, now: float) -> None:
        for name in [n for n, r in self.replicas.items() if now - r.at > FORGET_AFTER_S]:
            del self.replicas[name]

    def observe(self, name: str, report: Mapping[str, Any]) -> None:
        """Keep ``report`` (validated) as ``name``'s last.

        Raises:
            TooManyReplicas: ``name`` is new and :data:`MOST_REPLICAS` replicas are known already.
        """
        now = self.clock()
        self._forget(now)
        before = self.replicas.get(name)
        if before is None and len(self.replicas) >= MOST_REPLICAS:
            raise TooManyReplicas(f"{MOST_REPLICAS} serving replicas report already; a replica is forgotten "
                                  f"{FORGET_AFTER_S:g} s after its last report")
        rate = None
        if before is not None and now > before.at and report["requests"] >= before.report["requests"]:
            rate = (report["requests"] - before.report["requests"]) / (now - before.at)
        self.replicas[name] = _Replica(dict(report), now, rate)

    def view(self) -> dict[str, Any]:
        """``/v1/status``'s ``serving``: each replica's last report with its ``name``, ``age_s`` (seconds since
        it arrived) and ``requests_per_s``; the replicas' summed ``requests_per_s`` (null while no replica
        has reported twice) and how many are ``ready``."""
        now = self.clock()
        self._forget(now)
        replicas = [{"name": name, **r.report, "requests_per_s": r.requests_per_s, "age_s": round(now - r.at, 3)}
                    for name, r in sorted(self.replicas.items())]
        rates = [r.requests_per_s for r in self.replicas.values() if r.requests_per_s is not None]
        return {"replicas": replicas, "requests_per_s": sum(rates) if rates else None,
                "ready": sum(1 for r in self.replicas.values() if r.report["ready"])}


SERVING = web.AppKey("serving_reports", ServingReports)
"""The app's :class:`ServingReports`."""
