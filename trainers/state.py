"""What a trainer knows between steps, and the rules that change it: no I/O, no clock.

The service shell (:mod:`trainers.service`) does the I/O and tells a :class:`TrainerState` what
happened; the state says what to do next. Every rule that decides *which clock*, *whether to pull*,
*what an assignment means* and *where to resume after a refusal or an outage* lives here, so it is
read and tested on its own (``tests/test_trainers_state.py``). The rules, explained:
``docs/architecture.md``, *A trainer, step by step*.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from coordinator.assignment import Assignment
from services.clocks import ClockWait


class Move(enum.Enum):
    """What the shell must do before the next step (:meth:`TrainerState.follow`)."""

    TRAIN = "train"
    """Poll a batch and step."""
    IDLE = "idle"
    """Nothing to consume now (no assignment, not active, or no partitions): wait a little."""
    REASSIGN = "reassign"
    """Partitions changed: settle the push in flight, then restart the consumer from the committed
    offsets of :attr:`TrainerState.wanted` and call :meth:`TrainerState.assigned`."""
    LEAVE = "leave"
    """The coordinator drains this member: finish, commit what is in flight, leave the membership."""


class Outcome(enum.Enum):
    """How a push ended, as the shell saw it (:meth:`TrainerState.push_ended`)."""

    COMMITTED = "committed"
    """The parameter plane took it."""
    REFUSED = "refused"
    """The parameter plane refused it: fenced, or its offsets or clock out of line."""
    UNREACHABLE = "unreachable"
    """Redis went away during it (``common.outage.REDIS_DOWN``): the reply may be lost, and the push
    may or may not have been committed."""


@dataclass(frozen=True)
class Push:
    """A push not yet known committed or refused: the one record of it."""

    clock: int
    """Its clock."""
    member_id: str
    """The member id it was made under."""
    unsettled: bool = False
    """It ended :data:`Outcome.UNREACHABLE`: it waits for ``was_committed``
    (:meth:`TrainerState.outage_settled`)."""
    feedback: object = None
    """Once unsettled: the error-feedback state it left behind (``services.push.encoder.Feedback``; opaque
    here), adopted if it turns out committed."""


@dataclass(frozen=True)
class Adopt:
    """The push is committed: make the error-feedback state it left behind the ``Pusher``'s own
    (``Pusher.adopt``). A push not adopted leaves the residuals as they were before it."""

    feedback: object
    """What the shell reported with the outcome."""


@dataclass(frozen=True)
class Resync:
    """The push at ``clock`` was refused: resynchronise (:meth:`TrainerState.resync`, then restart
    the consumer from the committed offsets)."""

    clock: int
    """The refused push's clock."""


Instruction = Adopt | Resync
"""What the state tells the shell to do about a push that ended."""


class StateError(RuntimeError):
    """A rule was called out of order (a bug in the shell, not a fault of the cluster)."""


def needs_pull(covers: int | None, wait: ClockWait) -> bool:
    """Does a step after ``wait`` need a pull, when the replica covers clock ``covers``? Yes when the
    replica is not trusted (None), under ASP (no bound: always take the newest), and when the bound
    asks for updates the replica lacks. (A function of its arguments: the worker thread that pulls
    calls it with the values the event loop handed over.)"""
    return covers is None or wait.required is None or covers < wait.required


def low_covered(low: int | None) -> int:
    """The clock a snapshot covers when the lowest applied clock among participating live members,
    read before its pull, was ``low`` (None: nobody participated yet, so nothing is due: -1)."""
    return low if low is not None else -1


@dataclass
class TrainerState:
    """One trainer's clocks, push in flight, replica coverage and assignments (mutable, not shared
    across threads: the shell calls it from its event loop only)."""

    member_id: str | None = None
    """The id this trainer is registered under now (a new one after a lost lease)."""
    clock: int = 1
    """Clock of the next step."""
    last_pushed: int = 0
    """Last clock whose push is known committed."""
    pending: Push | None = None
    """The push in flight, or the unsettled one; None when every push is known committed or refused."""
    covers: int | None = None
    """The replica holds every live member's updates up to this clock; None: not trusted (never
    pulled, or after an outage): the next step pulls in full."""
    assignment: Assignment | None = None
    """The assignment the consumer follows now."""
    wanted: Assignment | None = None
    """The newest assignment heard from the coordinator, not yet followed."""
    last_wait: ClockWait | None = None
    """What the last clock wait observed (lets the next wait skip a read; see ``wait_for_clock``)."""
    staleness: int = 0
    """Staleness (clocks) of the parameters the last step computed on."""
    first_clock: int = 1
    """The first clock pushed under :attr:`member_id` (its own updates from there on are due under
    BSP and SSP)."""

    # -- membership ---------------------------------------------------------------------------

    def joined(self, member_id: str, start_clock: int, assignment: Assignment) -> None:
        """Registered (first time or anew) as ``member_id``, pushing from ``start_clock``
        (``services.starting_clock``). The consumer follows nothing until :meth:`follow` says.
        A push still in flight under an earlier id settles without moving this id's clocks."""
        if start_clock < 1:
            raise ValueError(f"start clock must be >= 1, got {start_clock}")
        self.member_id = member_id
        self.clock = start_clock
        self.first_clock = start_clock
        self.last_pushed = start_clock - 1
        self.last_wait = None  # a new member id: observe afresh
        self.assignment = None
        self.wanted = assignment

    def heard(self, assignment: Assignment) -> None:
        """A heartbeat (or the presence channel) answered with ``assignment``."""
        self.wanted = assignment

    def lease_lost(self) -> None:
        """The coordinator no longer knows this member: nothing is wanted until it registers anew."""
        self.wanted = None

    def follow(self) -> Move:
        """Follow the wanted assignment as far as needs no I/O, and say what the shell must do.

        The same partitions under a new generation are adopted at once (only the fencing token
        moves on); other partitions need :data:`Move.REASSIGN`.
        """
        wanted = self.wanted
        if wanted is not None and wanted.state == "draining":
            return Move.LEAVE
        if wanted is not None and wanted is not self.assignment:
            if self.assignment is None or self.assignment.partitions != wanted.partitions:
                return Move.REASSIGN
            self.assignment = wanted
        current = self.assignment
        if current is None or current.state != "active" or not current.partitions:
            return Move.IDLE
        return Move.TRAIN

    def assigned(self, assignment: Assignment) -> None:
        """The consumer now follows ``assignment`` (restarted from its committed offsets)."""
        self.assignment = assignment

    def step_allowed(self) -> bool:
        """A batch polled now may be stepped: False when the member re-registered while the batch
        was polled (a fenced member comes back under a new id with no assignment yet); the batch is
        then dropped, and the new assignment re-reads it from the committed offsets."""
        return self.assignment is not None

    # -- one step ---------------------------------------------------------------------------------

    def waited(self, wait: ClockWait) -> None:
        """The clock wait for this step returned ``wait``."""
        self.last_wait = wait
        self.staleness = wait.staleness

    def needs_pull(self, wait: ClockWait) -> bool:
        """Does the step after ``wait`` need a pull? Yes when the replica is not trusted, under ASP
        (no bound: always take the newest), and when the bound asks for updates the replica lacks."""
        return needs_pull(self.covers, wait)

    def pulled(self, covers: int) -> None:
        """The replica now holds a snapshot covering clock ``covers`` (:func:`low_covered` of the
        lowest applied clock read before its pull: by the step's wait, or by a pull ahead)."""
        self.covers = covers

    # -- the push in flight -------------------------------------------------------------------------

    @property
    def in_flight(self) -> Push | None:
        """The push being sent now (the shell awaits it before the next one), if any."""
        return self.pending if self.pending is not None and not self.pending.unsettled else None

    @property
    def unsettled(self) -> Push | None:
        """The push an outage cut off, waiting for ``was_committed(pending.member_id, pending.clock)``."""
        return self.pending if self.pending is not None and self.pending.unsettled else None

    def pushing(self) -> int:
        """A push of the step at :attr:`clock` is handed to the push thread; returns its clock.

        Raises:
            StateError: a push is still in flight or unsettled (the shell must settle it first), or
                this trainer has not joined.
        """
        if self.pending is not None:
            raise StateError(f"push at clock {self.pending.clock} still {self._phase(self.pending)}")
        if self.member_id is None:
            raise StateError("push before joining")
        clock, self.pending = self.clock, Push(self.clock, self.member_id)
        self.clock += 1
        return clock

    def push_ended(self, outcome: Outcome, feedback: object) -> list[Instruction]:
        """The push in flight ended with ``outcome``, leaving the error-feedback state ``feedback``
        behind; returns what the shell must do: :class:`Adopt` when committed, :class:`Resync` when
        refused; nothing yet when unreachable (it is kept, unsettled), nor for a push made under an
        earlier member id (moot).

        Raises:
            StateError: no push is in flight.
        """
        push = self.in_flight
        if push is None:
            raise StateError("no push in flight")
        mine = push.member_id == self.member_id
        if outcome is Outcome.UNREACHABLE and mine:
            self.pending = replace(push, unsettled=True, feedback=feedback)
            return []
        self.pending = None
        if not mine:
            return []
        if outcome is Outcome.COMMITTED:
            self.last_pushed = max(self.last_pushed, push.clock)
            return [Adopt(feedback)]
        return [Resync(push.clock)]

    @staticmethod
    def _phase(push: Push) -> str:
        return "unsettled" if push.unsettled else "in flight"

    # -- recovery ---------------------------------------------------------------------------------

    def resync(self) -> None:
        """After a refused push (or a clock-bound timeout): resume one past the last committed push,
        and observe the clocks afresh. The shell then restarts from the committed offsets.

        Raises:
            StateError: a push is in flight or unsettled (it must be settled first).
        """
        if self.pending is not None:
            raise StateError(f"settle the push at clock {self.pending.clock} ({self._phase(self.pending)}) "
                             "before resynchronising")
        self.clock = self.last_pushed + 1
        self.last_wait = None

    def outage_settled(self, committed: bool | None) -> list[Instruction]:
        """Redis answers again. ``committed``: what ``was_committed`` said of the :attr:`unsettled`
        push (None when there was none to ask about). The replica is no longer trusted. Returns
        :class:`Adopt` when the push is committed and was made under the current member id.

        Raises:
            StateError: a push is still in flight, or one is unsettled and ``committed`` is None.
        """
        if (push := self.in_flight) is not None:
            raise StateError(f"settle the push at clock {push.clock} before the outage")
        push = self.unsettled
        if push is not None and committed is None:
            raise StateError(f"ask was_committed about the unsettled push at clock {push.clock}")
        self.pending = None
        self.covers = None
        self.last_wait = None
        if push is None or not committed or push.member_id != self.member_id:
            return []
        self.last_pushed = max(self.last_pushed, push.clock)
        return [Adopt(push.feedback)]

    # -- idling -------------------------------------------------------------------------------------

    def should_tick(self, consistency: str, live: Iterable[str], clocks: Mapping[str, int]) -> bool:
        """With no data to step on, should this member push an empty update to advance its clock?

        Yes when another live member has pushed up to our clock or beyond: under BSP/SSP our
        lagging clock would hold it back. Never under ASP (nobody waits), and not before our first
        push (the clock bound does not count a member that never pushed).
        """
        me = self.member_id
        if consistency == "asp" or me is None or me not in clocks:
            return False
        return any(clocks[m] >= self.clock for m in live if m != me and m in clocks)
