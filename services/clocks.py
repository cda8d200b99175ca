"""What the job's clocks say, as values: one read of them, and what one wait for the clock bound observed.

No Redis here: :mod:`services.consistency` reads the clocks and waits (and re-exports these
names), and the trainer's pure core (``trainers.state``) reasons about what a wait observed
without importing a client.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClockView", "ClockWait", "JobClocks"]


@dataclass(frozen=True)
class ClockWait:
    """What one wait observed."""

    clock: int
    """The clock about to be computed."""
    required: int | None
    """Applied clock every participating member needed (None under ASP)."""
    min_applied: int | None
    """Lowest applied clock among participating live members (None when there are none)."""
    staleness: int
    """Measured staleness: ``clock - 1 - min_applied`` (0 when nobody participates)."""
    waited_s: float
    """Seconds spent waiting."""
    own_applied: int = 0
    """The waiting member's own applied clock (its updates applied up to it)."""
    pushed: int = 0
    """The waiting member's own last pushed clock when the clocks were read."""
    complete: bool = False
    """Every live member had pushed when the clocks were read."""


@dataclass(frozen=True)
class ClockView:
    """One read of the job's clocks, as one member sees them."""

    low: int | None
    """Lowest applied clock among participating live members (None when none participates)."""
    slowest: str | None
    """The member at ``low``."""
    own_applied: int
    """The member's own applied clock."""
    own_pushed: int
    """The member's own last pushed clock."""
    complete: bool
    """Every live member participates (has pushed)."""
    own_live: bool = True
    """The member is in the live membership (a fenced one is not: its pushes are refused)."""


@dataclass(frozen=True)
class JobClocks:
    """One consistent read (one MULTI) of the live members and their pushed and applied clocks."""

    live: frozenset[str]
    """Member ids of the live membership (``JobKeys.members``)."""
    pushed: dict[str, int]
    """Member id -> last clock it pushed (``JobKeys.clocks``; departed members may linger)."""
    applied: dict[str, int]
    """Member id -> last clock of its applied by the servers (``JobKeys.applied_clocks``)."""

    def view(self, member_id: str = "") -> ClockView:
        """The clocks as ``member_id`` sees them: a live member takes part from its first push, and
        one whose updates are not applied yet counts as applied clock 0."""
        low: tuple[int | None, str | None] = (None, None)
        for m in sorted(self.live):
            if m not in self.pushed:
                continue
            value = self.applied.get(m, 0)
            if low[0] is None or value < low[0]:
                low = (value, m)
        return ClockView(low[0], low[1], self.applied.get(member_id, 0), self.pushed.get(member_id, 0),
                         all(m in self.pushed for m in self.live), member_id in self.live)

    def starting_clock(self, member_id: str) -> int:
        """The clock a (re)joining ``member_id`` should push first: one past its own last pushed
        clock, and not behind the highest clock of the live members."""
        live = [self.pushed[m] for m in self.live if m in self.pushed]
        return max([self.pushed.get(member_id, 0), *live]) + 1
