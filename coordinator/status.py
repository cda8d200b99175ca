"""Read-only views of a job for ``/v1/status``, ``/v1/members`` and ``/v1/partitions``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .membership import Member, Membership
from .state import JobConfig, parse_assignment

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


def partitions_view(state: Membership, raw_assignment: Mapping[bytes, bytes],
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


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary(state: Membership, config: JobConfig, versions: Mapping[bytes, bytes],
            clocks: Mapping[bytes, bytes], applied: Mapping[bytes, bytes]) -> dict[str, Any]:
    """Parameter versions, staleness, throughput, loss and accuracy of the job.

    Measured staleness is the spread between the furthest live member's pushed
    clock and the slowest live member's applied clock (absent while the
    parameter plane has written no clocks).
    """
    live = set(state.members)
    vers = _ints(versions)
    pushed = {m: c for m, c in _ints(clocks).items() if m in live}
    done = {m: c for m, c in _ints(applied).items() if m in live}
    stats = [m.stats for m in state.members.values()]
    reported = [s["staleness"] for s in stats if "staleness" in s]
    measured = max(pushed.values()) - min(done.values()) if pushed and done else None
    return {
        "versions": {"shards": vers, "min": min(vers.values(), default=None),
                     "max": max(vers.values(), default=None)},
        "staleness": {"consistency": config.consistency, "bound": config.staleness,
                      "clock_spread": measured, "reported_max": max(reported, default=None),
                      "clocks": pushed, "applied_clocks": done},
        "throughput_records_per_s": sum(s.get("records_per_s", 0.0) for s in stats),
        "loss": _mean([s["loss"] for s in stats if "loss" in s]),
        "accuracy": _mean([s["accuracy"] for s in stats if "accuracy" in s]),
    }
