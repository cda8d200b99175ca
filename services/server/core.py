"""The parameter server's decisions, with no I/O and no clock: events in, instructions out.

The shell (:mod:`services.server.service`) reads and writes Redis, reads the clock and runs the
threads; it tells a :class:`ServerCore` what happened and does what it answers: whether to reload
or read, what a write carries (a persist, the housekeeping), which shard to compact, when to sweep,
which orphaned blobs to delete, when to start the automatic checkpoint. The rules and why are in
``docs/parameter-plane.md`` ("The server's decisions"); ``tests/test_services_server_core.py``
tests them on their own, like :mod:`trainers.state` for the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..settings import ServerSettings

__all__ = ["Policy", "ServerCore", "Reload", "Read", "Housekeep", "WritePlan", "SweepBlobs", "SweepTables",
           "DeleteOrphans", "Checkpoint", "Instruction"]


@dataclass(frozen=True)
class Policy:
    """The settings the decisions read (:meth:`of` takes them from a ``ServerSettings``)."""

    group: int
    batch: int
    persist_every: int
    compact_fraction: float
    compact_every: int
    audit_horizon_s: float
    housekeeping_s: float
    sweep_every_s: float
    table_sweep_every_s: float
    sweep_grace_s: float
    checkpoint_every: int

    @classmethod
    def of(cls, settings: ServerSettings) -> Policy:
        """The policy of a server with ``settings``."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class Reload:
    """Memory may be ahead of Redis (a batch computed and not written, a lost compare-and-set, an
    outage): load the group's state again before reading."""


@dataclass(frozen=True)
class Read:
    """Read up to ``count`` updates after the cursor and apply them in one write."""

    count: int


@dataclass(frozen=True)
class Housekeep:
    """The next write carries the housekeeping (``services.server.apply.Housekeeping``): trim
    ``applied_samples`` older than ``horizon_ms``, drop departed members' fields."""

    horizon_ms: int


@dataclass(frozen=True)
class WritePlan:
    """What the write of a batch carries besides its outcomes and shards."""

    persist: bool
    """Persist the optimizer state, step counts and persisted cursor with it."""
    housekeeping: Housekeep | None
    """The housekeeping, when it is due."""


@dataclass(frozen=True)
class SweepBlobs:
    """Scan the group's gradient blobs for orphans (then :meth:`ServerCore.blobs_found`)."""


@dataclass(frozen=True)
class SweepTables:
    """Take one step of each bounded embedding table's sweep."""


@dataclass(frozen=True)
class DeleteOrphans:
    """Delete the group's gradient blobs of these push tokens: no logged update named them for the
    grace period."""

    tokens: tuple[str, ...]


@dataclass(frozen=True)
class Checkpoint:
    """Start the automatic checkpoint of the job due at group-0 version ``version`` (on a thread
    of its own; report its end with :meth:`ServerCore.checkpoint_ended`)."""

    version: int


Instruction = Reload | Read | WritePlan | SweepBlobs | SweepTables | DeleteOrphans | Checkpoint
"""What the core tells the shell to do."""


class ServerCore:
    """One server's schedules and rules (mutable; the shell calls it from one thread at a time:
    the apply thread, or whoever drives ``step``/``apply_entries`` directly). ``now`` is the
    shell's ``time.monotonic()``."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.valid = False
        """Memory matches what Redis holds (False from a computed batch until its write, and after a
        lost compare-and-set or an outage)."""
        self.version = 0
        """Newest group version loaded or written."""
        self.housekeeping_at = -math.inf
        """When the next write carries the housekeeping (the first one does)."""
        self.sweep_at = -math.inf
        """When the next sweep for orphaned gradient blobs is due (the first round)."""
        self.table_sweep_at = -math.inf
        """When the next step of the tables' sweeps is due (the first round)."""
        self.orphans: dict[str, float] = {}
        """Push token -> when a sweep first found its blobs with no logged update naming it."""
        self.last_checkpoint = 0
        """Version of the last automatic checkpoint started."""
        self.checkpointing: int | None = None
        """Version of the automatic checkpoint running now, if any."""

    # -- memory and Redis -------------------------------------------------------------------------

    def loaded(self, version: int) -> None:
        """The group's state was (re)loaded from Redis, at group version ``version``."""
        self.valid = True
        self.version = version

    def next_round(self) -> Reload | Read:
        """What a round does first: reload when memory may be ahead of Redis, else read."""
        return Read(self.policy.batch) if self.valid else Reload()

    def computing(self) -> None:
        """The shell starts changing its shards in place for a batch: memory runs ahead of Redis."""
        self.valid = False

    def outage(self) -> None:
        """Redis went away: one restarted on its AOF may be a second behind memory."""
        self.valid = False

    def lost(self) -> Reload:
        """A write lost the compare-and-set (another server of the group moved the cursor): nothing
        was written; reload."""
        self.valid = False
        return Reload()

    # -- a write ----------------------------------------------------------------------------------

    def persist_due(self, *, updates: int, grad_bytes: int, state_bytes: int) -> bool:
        """Does a write persist the optimizer state, when ``updates`` updates holding ``grad_bytes``
        bytes of gradients (those since the last persist and the batch's together) would have to be
        replayed otherwise, and the state holds ``state_bytes`` bytes? Yes every ``persist_every``
        updates, once the gradients hold as many bytes as the state (replaying costs more than
        persisting), and always for an optimizer without state (``state_bytes`` 0)."""
        return updates >= self.policy.persist_every or grad_bytes >= state_bytes

    def write_plan(self, now: float, *, updates: int, grad_bytes: int, state_bytes: int) -> WritePlan:
        """What the write of a batch carries (arguments as :meth:`persist_due`)."""
        return WritePlan(self.persist_due(updates=updates, grad_bytes=grad_bytes, state_bytes=state_bytes),
                         self._housekeeping_due(now))

    def compact(self, *, delta_bytes: int, new_delta: int, numel: int, base: int, version: int) -> bool:
        """Is a shard of ``numel`` values rewritten in full by the write at group version
        ``version``, when its deltas since its base (at ``base``) hold ``delta_bytes`` bytes and the
        write's adds ``new_delta``? Yes when its deltas would outgrow ``compact_fraction`` of its
        bytes, or its base is ``compact_every`` versions old. (A shard changed everywhere is always
        written in full: it has no delta to weigh.)"""
        p = self.policy
        return delta_bytes + new_delta > p.compact_fraction * 4 * numel or version - base >= p.compact_every

    def written(self, version: int) -> list[Checkpoint]:
        """A batch was written: the group is at ``version`` (a write that carried the housekeeping
        is also :meth:`housekept`). Returns the automatic checkpoint to start, if one is due."""
        self.valid = True
        self.version = max(self.version, version)
        return self._checkpoint_due()

    # -- housekeeping -----------------------------------------------------------------------------

    def _housekeeping_due(self, now: float) -> Housekeep | None:
        if now < self.housekeeping_at:
            return None
        return Housekeep(horizon_ms=round(self.policy.audit_horizon_s * 1000))

    def idle(self, now: float) -> Housekeep | None:
        """A round found nothing to apply (memory is as loaded): the housekeeping to write on its
        own, when it is due."""
        self.valid = True
        return self._housekeeping_due(now)

    def housekept(self, now: float, more: bool) -> None:
        """A write carried the housekeeping: the next is due in ``housekeeping_s``, or at once when
        ``more`` entries past the horizon are left."""
        self.housekeeping_at = now + (0.0 if more else self.policy.housekeeping_s)

    def housekeeping_refused(self, now: float) -> None:
        """A housekeeping written on its own lost the compare-and-set: try again in
        ``housekeeping_s``, and reload before the next round."""
        self.housekeeping_at = now + self.policy.housekeeping_s
        self.valid = False

    # -- sweeps -----------------------------------------------------------------------------------

    def tick(self, now: float) -> list[SweepBlobs | SweepTables]:
        """The sweeps due after a round."""
        due: list[SweepBlobs | SweepTables] = []
        if now >= self.sweep_at:
            due.append(SweepBlobs())
        if now >= self.table_sweep_at:
            due.append(SweepTables())
        return due

    def blobs_swept(self, now: float) -> None:
        """A sweep for orphaned blobs ended: the next in ``sweep_every_s`` (a failed one is tried
        again next round)."""
        self.sweep_at = now + self.policy.sweep_every_s

    def tables_swept(self, now: float) -> None:
        """A step of the tables' sweeps ended: the next in ``table_sweep_every_s``."""
        self.table_sweep_at = now + self.policy.table_sweep_every_s

    def blobs_found(self, now: float, found: Iterable[str], logged: Container[str]) -> DeleteOrphans:
        """A sweep found gradient blobs of the push tokens ``found``; ``logged``: the tokens logged
        updates name. Returns the tokens whose blobs no logged update has named for
        ``sweep_grace_s`` (forgotten here: a token found again starts a new grace)."""
        self.orphans = {t: self.orphans.get(t, now) for t in found if t not in logged}
        due = tuple(t for t, first in self.orphans.items() if now - first >= self.policy.sweep_grace_s)
        for token in due:
            del self.orphans[token]
        return DeleteOrphans(due)

    # -- the automatic checkpoint ------------------------------------------------------------------

    def _checkpoint_due(self) -> list[Checkpoint]:
        every = self.policy.checkpoint_every
        if (not every or self.policy.group != 0 or self.checkpointing is not None
                or self.version // every <= self.last_checkpoint // every):
            return []
        self.last_checkpoint = self.checkpointing = self.version
        return [Checkpoint(self.version)]

    def checkpoint_ended(self) -> list[Checkpoint]:
        """The automatic checkpoint running ended (saved or failed: a failed one is not retried).
        Returns the next, at the version now, when writes crossed another multiple of
        ``checkpoint_every`` while it ran."""
        self.checkpointing = None
        return self._checkpoint_due()
