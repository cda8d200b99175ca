"""BSP / SSP / ASP: when may a trainer compute its next step, and how stale was it.

A trainer about to compute at clock ``c`` waits until every *participating*
live member's applied clock is at least ``c - s - 1`` (BSP: ``s = 0``; ASP: no
wait). Live members are the keys of ``members``; a member takes part from its
first push (it has an entry in ``clocks``), so one that has not pushed yet, or
has left the membership, holds nobody back. A participating member whose
updates are not applied yet counts as applied clock 0. The rules and why:
``docs/parameter-plane.md``, *Consistency models (invariant 2)*.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import cast

import redis
from prometheus_client import Histogram

from common.keys import JobKeys

from .clocks import ClockView, ClockWait, JobClocks
from .errors import ParameterPlaneError
from .slots import JobSlot

logger = logging.getLogger(__name__)

__all__ = ["Consistency", "ClockWait", "ClockView", "JobClocks", "StalenessTimeout", "required_clock",
           "wait_for_clock", "read_clocks", "read_job_clocks", "starting_clock"]

STALENESS = Histogram("streamtrain_ssp_staleness_clocks",
                      "Clocks between a trainer's step and the oldest live member's applied clock",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
WAIT_SECONDS = Histogram("streamtrain_ssp_wait_seconds", "Time trainers spent waiting for the clock bound")


class StalenessTimeout(ParameterPlaneError):
    """The clock bound was not met before the deadline (a slow or stuck member)."""

    retriable = True


@dataclass(frozen=True)
class Consistency:
    """A job's consistency model."""

    mode: str = "ssp"
    """``bsp``, ``ssp`` or ``asp``."""
    staleness: int = 2
    """SSP bound ``s`` (ignored by BSP, which is s = 0, and ASP)."""

    def __post_init__(self) -> None:
        if self.mode not in ("bsp", "ssp", "asp"):
            raise ValueError(f"consistency must be bsp, ssp or asp, got {self.mode!r}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {self.staleness!r}")

    @classmethod
    def from_job(cls, client: redis.Redis, job: str) -> Consistency:
        """Read ``consistency`` and ``staleness`` from the job's config hash (defaults when absent)."""
        mode, s = cast("list[bytes | None]", client.hmget(JobKeys(job).config, ["consistency", "staleness"]))
        return cls(mode=(mode or b"ssp").decode(), staleness=int(s or 2))


def required_clock(cons: Consistency, clock: int) -> int | None:
    """Applied clock every live member needs before a step at ``clock``; None under ASP."""
    if cons.mode == "asp":
        return None
    s = 0 if cons.mode == "bsp" else cons.staleness
    return clock - s - 1


def read_job_clocks(client: redis.Redis, job: str) -> JobClocks:
    """The live members and their pushed and applied clocks, in one MULTI."""
    read = JobSlot(client, job).read("members", "clocks", "applied_clocks")
    return JobClocks(read.members, {k: int(v) for k, v in read.clocks.items()},
                     {k: int(v) for k, v in read.applied_clocks.items()})


def read_clocks(client: redis.Redis, job: str, member_id: str = "") -> ClockView:
    """The job's clocks as ``member_id`` sees them (:meth:`JobClocks.view` of one read)."""
    return read_job_clocks(client, job).view(member_id)


def starting_clock(client: redis.Redis, job: str, member_id: str) -> int:
    """The clock a (re)joining member should push first (:meth:`JobClocks.starting_clock`)."""
    return read_job_clocks(client, job).starting_clock(member_id)


MAX_POLL_S = 0.05
"""The longest pause between two reads of the clocks while :func:`wait_for_clock` waits, by default."""


def wait_for_clock(client: redis.Redis, job: str, member_id: str, clock: int, *,
                   consistency: Consistency | None = None, timeout_s: float = 60.0,
                   poll_s: float = 0.0005, max_unapplied: int | None = None,
                   known: ClockWait | None = None, own_from: int | None = None,
                   own_through: int | None = None, max_poll_s: float = MAX_POLL_S) -> ClockWait:
    """Block until a step at ``clock`` is allowed by the job's consistency model.

    Under ASP nobody waits for others; with ``max_unapplied`` a member still waits
    until at most that many of its own pushed updates are unapplied, which bounds
    the update log and the staleness it causes. Polls with a backoff from
    ``poll_s`` up to ``max_poll_s``; records the measured staleness in ``JobKeys.staleness``
    and the Prometheus histograms.

    ``own_from``: the first clock this member pushes under its id. Under BSP and SSP the bound covers
    the member's own updates too: those from ``own_from`` up to the required clock must be applied,
    even before the member counts as participating (its first push may still be on its way: a
    member that has not pushed is not among the participants whose lowest applied clock is read).
    Only while the member is live: a fenced member's pushes are refused, so its applied clock stops
    growing; it must not wait on it but go on to push, be refused and resynchronise.

    ``own_through``: this member's own updates up to this clock must be applied too, whatever the
    mode (local steps: a window starts on its own previous windows, :func:`services.local_steps.own_through`).

    ``max_poll_s``: the longest pause between two reads (the backoff's cap; :data:`MAX_POLL_S` by
    default). A window of local steps waits with :data:`services.local_steps.WINDOW_POLL_S`.

    ``known`` is what this member's previous wait read. Applied clocks only grow
    and a member that leaves only lowers the bar. When every live member took part
    at that read, a member that starts pushing after it is one that registered
    after it, and starts above the clock this member had pushed by then
    (``known.pushed``, :func:`starting_clock`), so none of its updates is due before
    clock ``known.pushed + s + 2``. Up to that clock, when ``known`` already meets
    the bound, the step goes without a read (its staleness is then counted from
    ``known``'s older view: an upper bound).

    Raises:
        StalenessTimeout: the bound was not met within ``timeout_s`` (names the slowest member).
    """
    cons = consistency or Consistency.from_job(client, job)
    need = required_clock(cons, clock)
    own_need = clock - 1 - max_unapplied if need is None and max_unapplied is not None else None

    # this member's own updates due (BSP, SSP): from its first clock up to the required one
    own_due = need if need is not None and own_from is not None and need >= own_from else None
    if own_through is not None:
        own_due = own_through if own_due is None else max(own_due, own_through)

    def met(low: int | None, own: int, live: bool = True) -> bool:
        return ((own_need is None or own >= own_need) and (own_due is None or not live or own >= own_due)
                and (need is None or low is None or low >= need))

    s = 0 if cons.mode == "bsp" else cons.staleness
    if (known is not None and known.complete and (need is None or clock <= known.pushed + s + 1)
            and met(known.min_applied, known.own_applied)):
        staleness = max(0, clock - 1 - known.min_applied) if known.min_applied is not None else 0
        STALENESS.observe(staleness)
        WAIT_SECONDS.observe(0.0)
        return ClockWait(clock, need, known.min_applied, staleness, 0.0, known.own_applied, known.pushed, True)
    keys = JobKeys(job)
    start = time.monotonic()
    delay = poll_s
    while True:
        view = read_clocks(client, job, member_id)
        low, who, own = view.low, view.slowest, view.own_applied
        if met(low, own, view.own_live):
            break
        if time.monotonic() - start >= timeout_s:
            if own_need is not None and own < own_need:
                raise StalenessTimeout(f"member {member_id} at clock {clock} waited {timeout_s:.1f}s for "
                                       f"its own updates up to clock {own_need} to be applied; at {own}")
            if own_due is not None and view.own_live and own < own_due:
                raise StalenessTimeout(f"member {member_id} at clock {clock} waited {timeout_s:.1f}s for "
                                       f"its own updates up to clock {own_due} to be applied; at {own}")
            raise StalenessTimeout(f"member {member_id} at clock {clock} waited {timeout_s:.1f}s for "
                                   f"applied clock {need}; slowest live member {who} is at {low}")
        time.sleep(delay)
        delay = min(delay * 1.5, max_poll_s)
    waited = time.monotonic() - start
    staleness = max(0, clock - 1 - low) if low is not None else 0
    client.hset(keys.staleness, member_id, staleness)
    STALENESS.observe(staleness)
    WAIT_SECONDS.observe(waited)
    return ClockWait(clock, need, low, staleness, waited, own, view.own_pushed, view.complete)
