"""How a trainer takes a step, chosen once when it joins (:func:`choose_steps`).

:class:`PlainSteps` pushes every step: each step waits for the clock bound, pulls what the bound
asks for (or takes the pull made ahead, :mod:`trainers.prefetch`), and computes its gradient.
:class:`WindowSteps` takes a window of local steps (``local_steps`` H > 1, :mod:`trainers.local`):
the step that opens a window waits and pulls, and every step is a step of the inner optimizer.
Either holds the parts a model may add: the rows of its embedding tables (:class:`TableRows`) and
progressive validation of a binary model (:mod:`trainers.progressive`).

They run on the worker thread the service (:mod:`trainers.service`) hands a step to, and read the
state only through :class:`StepInputs`; the service does what follows on its event loop (the state
learns of the wait and the pull; the push goes out). Why the waits and pulls are what they are:
``docs/parameter-plane.md``, *Consistency models*, *Overlapped pulls* and *Local steps*.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import redis

from coordinator.assignment import JobConfig
from datastream import Batch
from services.clocks import ClockWait
from services.consistency import MAX_POLL_S, Consistency, wait_for_clock
from services.local_steps import WINDOW_POLL_S, own_through
from services.store import ParameterStore, Snapshot
from services.tables import TableSpec

from .local import LocalSteps, inner_optimizer
from .prefetch import PullAhead, overlaps
from .progressive import ClosedWindow, ProgressiveWindow
from .rowahead import RowsAhead
from .rowcache import TableBound
from .settings import TrainerSettings
from .state import low_covered, needs_pull
from .step import Replica, StepResult
from .tables import RowFetcher, TableLookup, plan_lookups, table_required, wait_consistency

logger = logging.getLogger(__name__)

__all__ = ["Computed", "PlainSteps", "StepInputs", "Steps", "TableRows", "WindowSteps", "choose_steps"]


@dataclass(frozen=True)
class StepInputs:
    """What one hand-off to the worker thread reads of the state, read together on the event loop: a
    registration anew while a step waits must not make it wait on the new id's clocks with the old
    id's clock."""

    member_id: str
    clock: int
    """The clock of the step (``TrainerState.clock``)."""
    own_from: int
    """The first clock pushed under :attr:`member_id` (``TrainerState.first_clock``)."""
    known: ClockWait | None
    """What the last wait read (``TrainerState.last_wait``)."""
    covers: int | None
    """The clock the replica covers (``TrainerState.covers``; None: not trusted)."""
    base: Snapshot | None
    """The snapshot the replica holds, the base of a delta pull (None when it is not trusted: pull in full)."""
    dense: Consistency
    """The dense part's consistency model."""
    bound: TableBound | None
    """The embedding tables' bound (None: the model has none)."""
    upcoming: tuple[Batch, ...] = ()
    """Batches decoded after this hand-off's, in the order they will be stepped on: their rows may be
    fetched ahead (``--row-prefetch``, :mod:`trainers.rowahead`)."""


@dataclass(frozen=True)
class Computed:
    """What one step did on the worker thread: the wait, the pull if any, the step."""

    wait: ClockWait | None
    """None for a local step inside a window (the window's first step waited)."""
    snapshot: Snapshot | None
    """The new snapshot when it pulled, else None."""
    result: StepResult | None
    """None for an empty batch (a clock tick)."""
    seconds: dict[str, float]
    """Seconds of each phase: wait, pull, compute (and rows, with embedding tables)."""
    windows: list[ClosedWindow] = field(default_factory=list)
    """Progressive-validation windows the step's logits closed (to be scored)."""
    covers: int | None = None
    """With :attr:`snapshot`: the clock it covers (``TrainerState.covers``)."""
    in_window: bool = False
    """A step of the window of local steps in hand: it joins the window, whose push follows its last
    step; else the step (or tick) is pushed on its own."""


class TableRows:
    """The embedding-table part of a step: the batch's lookups, and their rows from the row cache or
    pulled (:mod:`trainers.tables`); with ``ahead``, the rows of the next batches fetched while the
    step computes (:mod:`trainers.rowahead`)."""

    def __init__(self, tables: Mapping[str, TableSpec], fetcher: RowFetcher, ahead: RowsAhead | None = None) -> None:
        self.tables = dict(tables)
        self.fetcher = fetcher
        self.ahead = ahead
        """Fetches the rows of the next batches (None: ``--row-prefetch 0``)."""

    def fetch(self, batch: Batch, clock: int, bound: TableBound, wait: ClockWait | None, *,
              upcoming: Sequence[Batch] = (), member_id: str = ""
              ) -> tuple[dict[str, TableLookup], dict[str, np.ndarray]]:
        """The lookups of ``batch`` at ``clock`` and their rows: cached ones while ``bound`` allows (rows
        fetched ahead merged into the cache first), the others pulled and cached as covering what
        ``wait`` observed; then the fetch of ``upcoming``'s rows begins (read as ``member_id``)."""
        covered = wait.min_applied if wait is not None and wait.min_applied is not None else -1
        if self.ahead is not None and (ahead := self.ahead.take()) is not None:
            self.ahead.merge(ahead, clock)
            self.fetcher.pulled_bytes += ahead.wire_bytes
        lookups = plan_lookups(self.tables, batch.ids, len(batch), groups=self.fetcher.groups)
        fetched = self.fetcher.fetch(lookups, clock=clock, bound=bound, required=table_required(bound, clock),
                                     covers=covered)
        if self.ahead is not None and upcoming:
            self.ahead.start(upcoming, clock=clock, bound=bound, covers=covered, member_id=member_id)
        return lookups, fetched.rows

    def close(self) -> None:
        """Stop fetching ahead."""
        if self.ahead is not None:
            self.ahead.close()
            logger.info("rows fetched ahead: %d rows in %d of %d fetches merged", self.ahead.rows,
                        self.ahead.merged, self.ahead.started)


class Steps(abc.ABC):
    """What every step does, whichever way the trainer steps: the clock wait, then forward and backward
    on the batch with the model's parts. Used from the worker thread, one step at a time; changes
    nothing but the replica's parameters, the row cache and the progressive-validation window."""

    window: LocalSteps | None = None
    """The window of local steps (:class:`WindowSteps`); None: a push per step."""

    def __init__(self, client: redis.Redis, settings: TrainerSettings, store: ParameterStore, replica: Replica, *,
                 rows: TableRows | None = None, progressive: ProgressiveWindow | None = None) -> None:
        self.client = client
        self.settings = settings
        self.store = store
        self.replica = replica
        self.rows = rows
        """The rows of the model's embedding tables (None: it has none)."""
        self.progressive = progressive
        """Progressive validation of a binary model (None: not a binary model, or off)."""

    @abc.abstractmethod
    def compute(self, batches: Sequence[Batch], given: StepInputs) -> list[Computed]:
        """Wait, pull and compute each of ``batches`` in order (one hand-off to the worker thread)."""

    @abc.abstractmethod
    def tick(self, batch: Batch, given: StepInputs) -> Computed:
        """An empty ``batch`` that only advances the clock (pushed on its own): wait for the bound."""

    def room(self) -> int:
        """Batches decoded already that the next hand-off may take beyond the one polled."""
        return 0

    def close(self) -> None:
        """Stop what the steps started (a thread); nothing by default."""
        return None

    def _wait(self, given: StepInputs, known: ClockWait | None, *, own: int | None = None,
              max_poll_s: float = MAX_POLL_S) -> ClockWait:
        """Wait until the consistency model allows the step at ``given.clock`` (the stricter of the dense
        part's bound and the tables'); ``own``: this member's own updates due up to that clock too."""
        s = self.settings
        return wait_for_clock(self.client, s.job, given.member_id, given.clock,
                              consistency=wait_consistency(given.dense, given.bound),
                              timeout_s=s.staleness_timeout_s, max_unapplied=s.max_unapplied, known=known,
                              own_from=given.own_from, own_through=own, max_poll_s=max_poll_s)

    def _forward(self, batch: Batch, given: StepInputs, wait: ClockWait | None, snapshot: Snapshot | None,
                 covers: int | None, phases: dict[str, float], *, inner: bool = False) -> Computed:
        """Forward and backward on ``batch`` after its wait and pull (``phases``: their seconds), with
        the rows of its tables; its logits go to progressive validation. ``inner``: a local step (the
        window's inner optimizer steps the replica)."""
        window = self.window if inner else None
        if not len(batch):
            return Computed(wait, snapshot, None, phases, covers=covers, in_window=inner)
        t2 = time.monotonic()
        lookups: dict[str, TableLookup] | None = None
        rows: dict[str, np.ndarray] | None = None
        if self.rows is not None and given.bound is not None:
            lookups, rows = self.rows.fetch(batch, given.clock, given.bound, wait, upcoming=given.upcoming,
                                            member_id=given.member_id)
        t3 = time.monotonic()
        result = self.replica.step(batch.x, batch.y, lookups, rows, inner=window.inner if window is not None else None,
                                   w=batch.w)
        seconds = {**phases, "compute": time.monotonic() - t3}
        if lookups is not None:
            seconds["rows"] = t3 - t2
        windows = []
        if self.progressive is not None and result.logits is not None:  # scored on the scoring thread
            windows = self.progressive.add(result.logits, batch.y.numpy())
        return Computed(wait, snapshot, result, seconds, windows, covers, in_window=inner)


class PlainSteps(Steps):
    """One push per step: each step waits for the clock bound, pulls what the bound asks for (always
    under ASP), and computes its gradient; with ``--overlap-pulls`` the next step's pull runs while
    this one computes, and the next step takes it when it extends what the replica holds."""

    def __init__(self, client: redis.Redis, settings: TrainerSettings, store: ParameterStore, replica: Replica, *,
                 rows: TableRows | None = None, progressive: ProgressiveWindow | None = None) -> None:
        super().__init__(client, settings, store, replica, rows=rows, progressive=progressive)
        self.ahead: PullAhead | None = None
        """The pull for the next step while this one computes (made on the first step that can use one)."""

    def compute(self, batches: Sequence[Batch], given: StepInputs) -> list[Computed]:
        assert len(batches) == 1, "several batches in one hand-off are local steps"
        return [self._step(batches[0], given)]

    def tick(self, batch: Batch, given: StepInputs) -> Computed:
        return self._step(batch, given)  # an empty batch pulls nothing

    def _step(self, batch: Batch, given: StepInputs) -> Computed:
        t0 = time.monotonic()
        snapshot, base, covers = None, given.base, given.covers
        pulling = self.ahead
        ahead = pulling.take(base, given.member_id) if pulling is not None else None  # pulled as the last step computed
        t_take = time.monotonic() - t0
        wait = self._wait(given, ahead.known(given.clock) if ahead is not None else given.known)
        t1 = time.monotonic()
        if pulling is not None and ahead is not None:
            pulling.swap(self.replica.params, ahead)
            snapshot, base, covers = ahead.snapshot, ahead.snapshot, low_covered(ahead.low)
        newest = ahead is not None and wait.required is None  # ASP: take the newest ready
        if len(batch) and not newest and needs_pull(covers, wait):
            snapshot = self.store.pull(base, out=self.replica.tensors)
            covers = low_covered(wait.min_applied)
        if self.settings.overlap_pulls and overlaps(given.dense, 1):
            held = snapshot if snapshot is not None else base
            if held is not None:  # the pull for the next step, while this one computes
                if self.ahead is None:
                    self.ahead = PullAhead(self.client, self.settings.job, self.replica.tensors)
                self.ahead.start(held, given.member_id, self.replica.tensors)
        t2 = time.monotonic()
        phases = {"wait": t1 - t0 - t_take, "pull": t2 - t1 + t_take}  # waiting for the pull ahead is pulling
        return self._forward(batch, given, wait, snapshot, covers, phases)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
            logger.info("%d of %d pulls ahead were taken by the next step", self.ahead.taken, self.ahead.started)
        if self.rows is not None:
            self.rows.close()


class WindowSteps(Steps):
    """A window of local steps: the step that opens a window waits for the clock bound and for this
    member's own previous windows to be applied, pulls (always: the pseudo-gradient is taken from
    the pull), and begins the window; every step, that one too, is a step of the inner optimizer on
    the replica. The service pushes the window after its H steps (``LocalSteps.close``)."""

    def __init__(self, client: redis.Redis, settings: TrainerSettings, store: ParameterStore, replica: Replica,
                 window: LocalSteps, *, progressive: ProgressiveWindow | None = None) -> None:
        super().__init__(client, settings, store, replica, progressive=progressive)
        self.window: LocalSteps = window

    def room(self) -> int:
        return self.window.steps - len(self.window.batches) - 1

    def compute(self, batches: Sequence[Batch], given: StepInputs) -> list[Computed]:
        opens = not self.window.open  # the first batch opens a window when none is in hand
        return [self._step(batch, given, opens=opens and j == 0) for j, batch in enumerate(batches)]

    def tick(self, batch: Batch, given: StepInputs) -> Computed:
        """The service ticks only with no window open: the tick waits as a window's first step does, and
        is pushed on its own; no window follows it, so it pulls nothing and begins none."""
        t0 = time.monotonic()
        wait = self._wait_to_open(given)
        return Computed(wait, None, None, {"wait": time.monotonic() - t0, "pull": 0.0}, covers=given.covers)

    def _wait_to_open(self, given: StepInputs) -> ClockWait:
        return self._wait(given, given.known, own=own_through(given.clock, given.own_from), max_poll_s=WINDOW_POLL_S)

    def _step(self, batch: Batch, given: StepInputs, *, opens: bool) -> Computed:
        t0 = time.monotonic()
        wait: ClockWait | None = None
        snapshot: Snapshot | None = None
        covers = given.covers
        if opens:  # an empty batch too: the window's later steps compute on what it pulled
            wait = self._wait_to_open(given)
        t1 = time.monotonic()
        if wait is not None:
            snapshot = self.store.pull(given.base, out=self.replica.tensors)
            covers = low_covered(wait.min_applied)
            self.window.begin()
        phases = {"wait": t1 - t0, "pull": time.monotonic() - t1}
        return self._forward(batch, given, wait, snapshot, covers, phases, inner=True)


def choose_steps(config: JobConfig, client: redis.Redis, settings: TrainerSettings, store: ParameterStore,
                 replica: Replica, *, rows: TableRows | None, progressive: ProgressiveWindow | None) -> Steps:
    """How a trainer of ``config``'s job steps: :class:`WindowSteps` with ``local_steps`` > 1 (the model
    is dense: ``trainers.local.check_model``), else :class:`PlainSteps`."""
    if config.local_steps > 1:
        assert rows is None, "local steps run dense models only"
        window = LocalSteps(replica.params, inner_optimizer(config, replica.params.values()), config.local_steps)
        return WindowSteps(client, settings, store, replica, window, progressive=progressive)
    return PlainSteps(client, settings, store, replica, rows=rows, progressive=progressive)
