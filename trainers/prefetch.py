"""Overlapped pulls: the pull for the next step runs while this step computes.

:class:`PullAhead` brings a second buffer of the dense parameters up to date on a thread of its own; the
next step takes it, by swapping the buffers, when it still extends what the replica holds, and pulls
itself only when the clock bound asks for more. Under BSP, under SSP with staleness 0 and with local
steps no pull ahead could serve the next step (:func:`overlaps`). See docs/parameter-plane.md, *Overlapped pulls: the
next step's pull while this one computes*.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import redis
import torch

from services.clocks import ClockView, ClockWait
from services.consistency import Consistency, read_clocks
from services.store import ParameterStore, Snapshot

logger = logging.getLogger(__name__)

__all__ = ["Ahead", "PullAhead", "overlaps"]


def overlaps(consistency: Consistency, local_steps: int) -> bool:
    """Can a pull ahead serve the next step? Under ASP and under SSP with staleness >= 1, with one
    step per push (docs/parameter-plane.md, *Overlapped pulls: the next step's pull while this one computes*)."""
    if local_steps > 1 or consistency.mode == "bsp":
        return False
    return consistency.mode == "asp" or consistency.staleness >= 1


@dataclass(frozen=True)
class Ahead:
    """A finished pull ahead."""

    base: Snapshot
    """The snapshot it was pulled from (the one the replica held when it started)."""
    snapshot: Snapshot
    """The snapshot it pulled; its tensors are the staging buffer's."""
    view: ClockView
    """The job's clocks as :attr:`member_id` saw them, read before the pull."""
    member_id: str
    """The member id it read the clocks as."""

    @property
    def low(self) -> int | None:
        """Lowest applied clock among participating live members, read before the pull (None: nobody
        participates): every live member's updates up to it are in :attr:`snapshot`."""
        return self.view.low

    def known(self, clock: int) -> ClockWait:
        """The clocks it read, as the ``known`` of the next step's wait (at ``clock``): a read newer
        than that step's previous wait, so the wait goes without a read of its own when this one
        already meets the bound (``services.consistency.wait_for_clock``)."""
        v = self.view
        staleness = max(0, clock - 1 - v.low) if v.low is not None else 0
        return ClockWait(clock, None, v.low, staleness, 0.0, v.own_applied, v.own_pushed, v.complete)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src``. On the CPU with numpy, one thread: torch's copy of a large tensor opens a
    parallel region of its own, and threads of a second region beside the step's spin on the cores the
    step computes on."""
    if dst.device.type == "cpu":
        np.copyto(dst.numpy(), src.detach().numpy())
    else:
        dst.copy_(src, non_blocking=True)


class PullAhead:
    """One pull ahead at a time on its own thread, into a staging buffer shaped like ``tensors``."""

    def __init__(self, client: redis.Redis, job: str, tensors: Mapping[str, torch.Tensor]) -> None:
        self._client = client
        self._job = job
        self._store = ParameterStore(client, job)  # its own: a store's meta cache is not shared across threads
        self._staging = {name: torch.empty_like(t) for name, t in tensors.items()}
        self._held: Snapshot | None = None
        """The snapshot whose values the staging buffer holds (None: unknown), the base of the next
        pull ahead: a delta pull since it needs no copy of the replica."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pull-ahead")
        self._running: concurrent.futures.Future[Ahead] | None = None
        self.started = 0
        """Pulls ahead started."""
        self.taken = 0
        """Pulls ahead a step trained on."""

    def start(self, base: Snapshot, member_id: str, params: Mapping[str, torch.Tensor]) -> bool:
        """Begin pulling ahead from ``base``, the snapshot ``params`` (the replica's parameters) hold
        now; the caller must not write ``params`` before :meth:`take` (reading them is fine). False
        when one is still running (it is left to finish)."""
        if self._running is not None:
            return False
        self._running = self._pool.submit(self._pull, base, member_id, dict(params))
        self.started += 1
        return True

    def _pull(self, base: Snapshot, member_id: str, params: Mapping[str, torch.Tensor]) -> Ahead:
        view = read_clocks(self._client, self._job, member_id)
        since, self._held = self._held, None  # until the pull has ended, the buffer holds no known snapshot
        if since is None:  # the first, or after a failure or an untrusted replica: from the replica's values
            for name, t in params.items():
                _copy(self._staging[name], t)
            since = base
        snapshot = self._store.pull(since, out=self._staging)
        self._held = snapshot
        return Ahead(base, snapshot, view, member_id)

    def take(self, base: Snapshot | None, member_id: str) -> Ahead | None:
        """Wait for the pull ahead in flight, if any, and return it when it extends ``base`` (the
        snapshot the replica holds now; None: the replica is not trusted) under ``member_id``; else
        drop it (as when it failed: the step then waits and pulls by itself) and return None."""
        if base is None:  # after an outage Redis may be behind what the buffer holds: start afresh
            self._held = None
        running, self._running = self._running, None
        if running is None:
            return None
        try:
            ahead = running.result()
        except Exception as exc:  # noqa: BLE001 - the step's own wait and pull meet the same fault and handle it
            logger.debug("pull ahead dropped: %r", exc)
            return None
        if base is None:
            self._held = None
            return None
        if ahead.base is not base or ahead.member_id != member_id:
            return None
        return ahead

    def swap(self, params: Mapping[str, torch.nn.Parameter], ahead: Ahead) -> None:
        """Make ``ahead``'s tensors the parameters' storage, and the parameters' old storage the
        staging buffer of the next pull ahead. (A pull ahead that found nothing changed holds the
        base's tensors, the parameters themselves: nothing to swap.)"""
        if ahead.snapshot.tensors is not ahead.base.tensors:
            self._swap(params, ahead)
            self._held = ahead.base  # the parameters' old storage holds what they held
        self.taken += 1

    def _swap(self, params: Mapping[str, torch.nn.Parameter], ahead: Ahead) -> None:
        for name, p in params.items():
            old = p.data
            p.data = ahead.snapshot.tensors[name]
            self._staging[name] = old

    def close(self) -> None:
        """Let the pull ahead in flight finish (it never waits on the clocks: a read, a copy and a
        pull) and stop the thread."""
        self._running = None
        self._pool.shutdown(wait=True)
