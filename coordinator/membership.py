"""Membership as a pure state machine: events in, new state and actions out.

Nothing here does I/O or reads a clock: every event carries the time it
happened (``now_ms``), :func:`handle` returns the next :class:`Membership` and
the :data:`Action` list that the I/O shell (:mod:`coordinator.state`, the HTTP
handlers) persists and logs. Every membership change bumps the generation and
reassigns partitions with :func:`coordinator.assign.assign`, so the new
generation fences members that lost partitions.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .assign import assign
from .errors import MemberGoneError, UnknownMemberError


class MemberState(str, enum.Enum):
    """Health of a member as the coordinator sees it."""

    ACTIVE = "active"
    """Holds a lease and owns its quota of partitions."""
    DRAINING = "draining"
    """Asked by an admin to go: owns no partitions; should call leave."""


@dataclass(frozen=True)
class Member:
    """One registered trainer, stored as JSON in ``JobKeys.members``."""

    member_id: str
    """Unique, never reused id (``<hostname>-<uuid8>``)."""
    capabilities: Mapping[str, Any]
    """What the trainer declared at registration (device, threads, memory_mb, ...)."""
    weight: float
    """Share weight in the assignment (see :func:`coordinator.assign.capability_weight`)."""
    registered_ms: int
    """Registration time, ms since the epoch."""
    lease_expires_ms: int
    """The member is dead once the clock passes this, unless it heartbeats."""
    last_seen_ms: int
    """Time of its last registration or heartbeat."""
    state: MemberState = MemberState.ACTIVE
    """Its health."""
    stats: Mapping[str, Any] = field(default_factory=dict)
    """Stats of its last heartbeat (records/s, loss, clock, lag, ...)."""

    def to_json(self) -> str:
        """The JSON stored in ``JobKeys.members``."""
        return json.dumps({
            "member_id": self.member_id, "capabilities": dict(self.capabilities),
            "weight": self.weight, "registered_ms": self.registered_ms,
            "lease_expires_ms": self.lease_expires_ms, "last_seen_ms": self.last_seen_ms,
            "state": self.state.value, "stats": dict(self.stats)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Member:
        """Parse what :meth:`to_json` wrote.

        Raises:
            ValueError: the text is not a member record.
        """
        try:
            d = json.loads(text)
            return cls(member_id=str(d["member_id"]), capabilities=d["capabilities"],
                       weight=float(d["weight"]), registered_ms=int(d["registered_ms"]),
                       lease_expires_ms=int(d["lease_expires_ms"]),
                       last_seen_ms=int(d["last_seen_ms"]), state=MemberState(d["state"]),
                       stats=d.get("stats") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad member record {text!r:.200}: {exc}") from None


@dataclass(frozen=True)
class Membership:
    """The whole membership state of a job at one generation."""

    generation: int
    """Membership generation; the fencing token."""
    members: Mapping[str, Member]
    """Live members by id."""
    assignment: Mapping[int, str]
    """Partition -> owning member id."""
    partitions: tuple[int, ...]
    """Every partition of the topic."""

    def partitions_of(self, member_id: str) -> list[int]:
        """Sorted partitions owned by ``member_id``."""
        return sorted(p for p, m in self.assignment.items() if m == member_id)


# -- events -------------------------------------------------------------------

@dataclass(frozen=True)
class Register:
    """A trainer registers under a fresh id."""

    member_id: str
    capabilities: Mapping[str, Any]
    weight: float
    now_ms: int
    lease_ms: int


@dataclass(frozen=True)
class Heartbeat:
    """A member renews its lease and reports stats."""

    member_id: str
    stats: Mapping[str, Any]
    now_ms: int
    lease_ms: int


@dataclass(frozen=True)
class Leave:
    """A member leaves gracefully (it has committed its last batch)."""

    member_id: str
    now_ms: int


@dataclass(frozen=True)
class Drain:
    """An admin asks a member to go: its partitions move now, it should leave."""

    member_id: str
    now_ms: int


@dataclass(frozen=True)
class Disconnected:
    """A member's presence channel closed: its process is gone (the kernel closed its socket).
    A no-op for a member that already left or expired."""

    member_id: str
    now_ms: int


@dataclass(frozen=True)
class CheckLeases:
    """The lease checker runs: members whose lease passed ``now_ms`` are dead."""

    now_ms: int


@dataclass(frozen=True)
class RenewLeases:
    """A (re)started coordinator gives every member a fresh lease from ``now_ms``,
    so trainers that could not heartbeat while it was down are not killed."""

    now_ms: int
    lease_ms: int


Event = Register | Heartbeat | Leave | Drain | Disconnected | CheckLeases | RenewLeases


# -- actions ------------------------------------------------------------------

@dataclass(frozen=True)
class MemberJoined:
    """A member registered."""

    member_id: str
    generation: int


@dataclass(frozen=True)
class MemberExpired:
    """A member's lease expired; it is removed."""

    member_id: str
    generation: int
    """The generation that removes it."""
    lease_expires_ms: int
    detected_ms: int


@dataclass(frozen=True)
class MemberLeft:
    """A member left gracefully."""

    member_id: str
    generation: int
    left_ms: int = 0
    """When it left, ms since the epoch."""


@dataclass(frozen=True)
class MemberDrained:
    """A member was drained by an admin."""

    member_id: str
    generation: int


@dataclass(frozen=True)
class Rebalanced:
    """The generation was bumped and partitions reassigned."""

    generation: int
    moved: tuple[tuple[int, str | None, str], ...]
    """(partition, previous owner or None, new owner) for each partition that moved."""


Action = MemberJoined | MemberExpired | MemberLeft | MemberDrained | Rebalanced


def empty(partitions: Sequence[int]) -> Membership:
    """The state of a job nobody has joined yet."""
    return Membership(generation=0, members=MappingProxyType({}), assignment=MappingProxyType({}),
                      partitions=tuple(sorted(set(partitions))))


def _rebalance(state: Membership, members: dict[str, Member]) -> tuple[Membership, Rebalanced]:
    generation = state.generation + 1
    weights = {m.member_id: m.weight for m in members.values() if m.state is MemberState.ACTIVE}
    new = assign(weights, state.partitions, state.assignment)
    moved = tuple((p, state.assignment.get(p), owner) for p, owner in sorted(new.items())
                  if state.assignment.get(p) != owner)
    nxt = Membership(generation=generation, members=MappingProxyType(members),
                     assignment=MappingProxyType(new), partitions=state.partitions)
    return nxt, Rebalanced(generation=generation, moved=moved)


def _known(state: Membership, member_id: str) -> Member:
    try:
        return state.members[member_id]
    except KeyError:
        raise UnknownMemberError(f"member {member_id!r} is not a live member") from None


def handle(state: Membership, event: Event) -> tuple[Membership, list[Action]]:
    """Apply ``event`` to ``state``.

    Returns:
        the next state (``state`` itself when nothing changed) and the actions
        to log, in order; a generation bump always ends with :class:`Rebalanced`.

    Raises:
        UnknownMemberError: a heartbeat, leave or drain names no live member.
        MemberGoneError: a heartbeat arrives after the member's lease expired
            (the checker has not removed it yet): it must register anew.
        ValueError: a register reuses a live member id.
    """
    members = dict(state.members)
    if isinstance(event, Register):
        if event.member_id in members:
            raise ValueError(f"member id {event.member_id!r} is already registered")
        members[event.member_id] = Member(
            member_id=event.member_id, capabilities=dict(event.capabilities), weight=event.weight,
            registered_ms=event.now_ms, lease_expires_ms=event.now_ms + event.lease_ms,
            last_seen_ms=event.now_ms)
        nxt, rebalanced = _rebalance(state, members)
        return nxt, [MemberJoined(event.member_id, nxt.generation), rebalanced]
    if isinstance(event, Heartbeat):
        member = _known(state, event.member_id)
        if member.lease_expires_ms <= event.now_ms:
            raise MemberGoneError(f"lease of member {event.member_id!r} expired; register anew")
        members[event.member_id] = replace(member, stats=dict(event.stats), last_seen_ms=event.now_ms,
                                           lease_expires_ms=event.now_ms + event.lease_ms)
        return replace(state, members=MappingProxyType(members)), []
    if isinstance(event, Leave):
        _known(state, event.member_id)
        del members[event.member_id]
        nxt, rebalanced = _rebalance(state, members)
        return nxt, [MemberLeft(event.member_id, nxt.generation, event.now_ms), rebalanced]
    if isinstance(event, Drain):
        member = _known(state, event.member_id)
        if member.state is MemberState.DRAINING:
            return state, []
        members[event.member_id] = replace(member, state=MemberState.DRAINING)
        nxt, rebalanced = _rebalance(state, members)
        return nxt, [MemberDrained(event.member_id, nxt.generation), rebalanced]
    if isinstance(event, Disconnected):
        gone = members.pop(event.member_id, None)
        if gone is None:
            return state, []
        nxt, rebalanced = _rebalance(state, members)  # dead before its lease ran out: expired now
        return nxt, [MemberExpired(gone.member_id, nxt.generation, gone.lease_expires_ms, event.now_ms), rebalanced]
    if isinstance(event, CheckLeases):
        dead = sorted((m for m in members.values() if m.lease_expires_ms <= event.now_ms),
                      key=lambda m: m.member_id)
        if not dead:
            return state, []
        for m in dead:
            del members[m.member_id]
        nxt, rebalanced = _rebalance(state, members)
        expired: list[Action] = [MemberExpired(m.member_id, nxt.generation, m.lease_expires_ms,
                                               event.now_ms) for m in dead]
        return nxt, [*expired, rebalanced]
    if isinstance(event, RenewLeases):
        renewed = {k: replace(m, lease_expires_ms=max(m.lease_expires_ms,
                                                      event.now_ms + event.lease_ms))
                   for k, m in members.items()}
        return replace(state, members=MappingProxyType(renewed)), []
    raise TypeError(f"not a membership event: {event!r}")


# -- departed members -------------------------------------------------------------

@dataclass(frozen=True)
class Departure:
    """A member that is gone, stored as JSON in ``JobKeys.departed`` under its id, so that its
    late heartbeat gets "gone, register anew" rather than "unknown member" (both make the
    trainer register anew under a fresh id; the record only says why)."""

    reason: str
    """``expired`` or ``left``."""
    generation: int
    """The generation that removed it."""
    at_ms: int
    """When it was removed, ms since the epoch (0 when a record written without it is read)."""

    def to_json(self) -> str:
        """The JSON stored in ``JobKeys.departed``."""
        return json.dumps({"reason": self.reason, "generation": self.generation, "at_ms": self.at_ms},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Departure:
        """Parse what :meth:`to_json` wrote (an ``at_ms`` of null reads as 0: the oldest).

        Raises:
            ValueError: the text is not a departure record.
        """
        try:
            d = json.loads(text)
            return cls(reason=str(d["reason"]), generation=int(d["generation"]), at_ms=int(d.get("at_ms") or 0))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"bad departure record {text!r:.200}: {exc}") from None


def departures(actions: Sequence[Action]) -> dict[str, Departure]:
    """Member id -> the :class:`Departure` to record, for each member the ``actions`` remove."""
    out: dict[str, Departure] = {}
    for a in actions:
        if isinstance(a, MemberExpired):
            out[a.member_id] = Departure("expired", a.generation, a.detected_ms)
        elif isinstance(a, MemberLeft):
            out[a.member_id] = Departure("left", a.generation, a.left_ms)
    return out


def forgotten(departed: Mapping[str, Departure], now_ms: int, retention_ms: int) -> list[str]:
    """Sorted ids of the ``departed`` records older than ``retention_ms`` at ``now_ms``: they are
    dropped, so the record of departures stays bounded (ids are never reused; a forgotten
    member's late heartbeat gets "unknown member", which also makes it register anew).

    Raises:
        ValueError: ``retention_ms`` is negative.
    """
    if retention_ms < 0:
        raise ValueError(f"retention_ms must be >= 0, got {retention_ms!r}")
    return sorted(m for m, d in departed.items() if d.at_ms + retention_ms <= now_ms)
