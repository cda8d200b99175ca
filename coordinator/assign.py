"""Partition assignment as a pure function: balanced by weight, sticky, deterministic.

:func:`assign` gives each member its :func:`quotas` (weighted shares, rounded by largest remainder),
keeps what a member owned up to its quota and moves only the excess and departed members' partitions;
:func:`capability_weight` weighs a member by its device and threads.
See docs/architecture.md, *The control plane: membership and assignment*.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

DEVICE_FACTORS: Mapping[str, float] = {"cpu": 1.0, "cuda": 8.0}
"""Weight factor per device kind."""

MAX_THREADS = 256
"""Threads beyond this do not add weight."""


def capability_weight(device: str, threads: int) -> float:
    """Weight of a member with ``device`` ("cpu" or "cuda") and ``threads`` threads.

    Raises:
        ValueError: unknown device.
    """
    if device not in DEVICE_FACTORS:
        raise ValueError(f"unknown device {device!r}: expected one of {', '.join(DEVICE_FACTORS)}")
    return DEVICE_FACTORS[device] * math.sqrt(min(max(int(threads), 1), MAX_THREADS))


def quotas(members: Mapping[str, float], partitions: int,
           held: Mapping[str, int] | None = None) -> dict[str, int]:
    """Number of partitions each member should own (largest-remainder rounding).

    Ties of equal remainders go first to members that already hold more
    partitions (``held``, fewer moves), then by member id (determinism).

    Raises:
        ValueError: a weight is not a positive finite number.
    """
    for member, weight in members.items():
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight of member {member!r} must be a positive number, got {weight!r}")
    if not members:
        return {}
    held = held or {}
    total = math.fsum(members.values())
    shares = {m: partitions * w / total for m, w in members.items()}
    out = {m: math.floor(s) for m, s in shares.items()}
    spare = partitions - sum(out.values())
    order = sorted(members, key=lambda m: (-(shares[m] - out[m]), -held.get(m, 0), m))
    for m in order[:spare]:
        out[m] += 1
    return out


def assign(members: Mapping[str, float], partitions: Sequence[int],
           previous: Mapping[int, str]) -> dict[int, str]:
    """Assign every partition in ``partitions`` to exactly one of ``members``.

    Args:
        members: member id -> weight (positive; see :func:`capability_weight`).
        partitions: the partitions to assign (duplicates are ignored).
        previous: the current assignment, partition -> member id; entries for
            departed members or unknown partitions are ignored.

    Returns:
        partition -> member id, with each member owning its quota (see
        :func:`quotas`); empty when there are no members.

    Raises:
        ValueError: a weight is not a positive finite number.
    """
    parts = sorted(set(partitions))
    if not members:
        return {}
    wanted = set(parts)
    held = Counter(owner for p, owner in previous.items() if owner in members and p in wanted)
    quota = quotas(members, len(parts), held)
    result: dict[int, str] = {}
    count: Counter[str] = Counter()
    orphans: list[int] = []
    for p in parts:
        owner = previous.get(p)
        if owner is not None and owner in members and count[owner] < quota[owner]:
            result[p] = owner
            count[owner] += 1
        else:
            orphans.append(p)
    for p in orphans:
        # the member furthest below its quota; ties by id
        owner = min(members, key=lambda m: (count[m] - quota[m], m))
        result[p] = owner
        count[owner] += 1
    return result
