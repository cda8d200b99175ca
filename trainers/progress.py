"""What a trainer reports: heartbeat stats, the loss average, freshness and where a step's time goes.

Pure bookkeeping, no I/O: the service records steps, pushes and clock waits
here, and its heartbeat sends :meth:`Progress.heartbeat_stats`. Times are
passed in (``now`` from ``time.monotonic()``, ``now_ms`` from the wall clock),
so the rules are tested without sleeping (``tests/test_trainers_state.py``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .progressive import WindowScore

LOSS_EMA_WEIGHT = 0.1
"""Weight of the newest step in the training-loss moving average."""
PHASE_REPORT_STEPS = 50
"""Steps between two reports of where a step's time went (a log line, and a ``step_phases`` record of
:mod:`trainers.events` for programs to read)."""
MAX_FRESHNESS_SAMPLES = 1000
"""Most freshness samples one heartbeat carries (the coordinator keeps percentiles)."""
MAX_PROGRESSIVE_WINDOWS = 64
"""Most progressive-validation windows one heartbeat carries (the newest; more closing between two
heartbeats means windows far smaller than a heartbeat's worth of records)."""


@dataclass
class _Window:
    """Counters between two heartbeats."""

    started: float
    records: int = 0
    steps: int = 0
    step_time_s: float = 0.0
    wire_bytes: int = 0


@dataclass
class Progress:
    """A trainer's running figures. Not thread-safe: the shell calls it from its event loop."""

    started: float
    """``time.monotonic()`` when the first window opened."""
    steps: int = 0
    """Steps computed (empty clock ticks excluded)."""
    loss_ema: float | None = None
    """Moving average of the training loss (:data:`LOSS_EMA_WEIGHT`)."""
    _window: _Window = field(init=False)
    _sent: collections.deque[tuple[int, int]] = field(default_factory=collections.deque, init=False)
    _freshness: list[float] = field(default_factory=list, init=False)
    _phases: collections.defaultdict[str, float] = field(default_factory=lambda: collections.defaultdict(float),
                                                         init=False)
    _phase_steps: int = field(default=0, init=False)
    _row_lookups: tuple[int, int] = field(default=(0, 0), init=False)
    """The row cache's cumulative (hits, misses) at the last heartbeat."""
    last_window: WindowScore | None = None
    """The newest closed progressive-validation window (None before the first, or for a model that
    does not score them)."""
    _windows: list[WindowScore] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._window = _Window(started=self.started)

    def stepped(self, records: int, seconds: float, loss: float | None) -> None:
        """One step over ``records`` records took ``seconds``, with training loss ``loss``."""
        self.steps += 1
        self._phase_steps += 1
        w = self._window
        w.steps += 1
        w.records += records
        w.step_time_s += seconds
        if loss is not None:
            self.loss_ema = loss if self.loss_ema is None else (
                (1 - LOSS_EMA_WEIGHT) * self.loss_ema + LOSS_EMA_WEIGHT * loss)

    def pushed(self, clock: int, wire_bytes: int, produced_ts_ms: int) -> None:
        """The push at ``clock`` was committed: ``wire_bytes`` on the wire, its records produced at
        ``produced_ts_ms`` (0: unknown, no freshness sample)."""
        self._window.wire_bytes += wire_bytes
        if produced_ts_ms:
            self._sent.append((clock, produced_ts_ms))

    def applied(self, own_applied: int, now_ms: float) -> None:
        """Our updates are applied up to clock ``own_applied`` (as a clock wait read it): each push
        up to it yields a freshness sample, the seconds from produce to the first model version
        holding its gradient."""
        while self._sent and self._sent[0][0] <= own_applied:
            _, produced = self._sent.popleft()
            self._freshness.append(max(0.0, (now_ms - produced) / 1000))

    def scored(self, windows: list[WindowScore]) -> None:
        """Progressive-validation windows scored since the last call (oldest first), for the next heartbeat."""
        if windows:
            self._windows.extend(windows)
            self.last_window = windows[-1]

    def phase(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name`` (wait, pull, compute, push_wait) of the current steps."""
        self._phases[name] += seconds

    def phase_report(self) -> dict[str, float] | None:
        """Every :data:`PHASE_REPORT_STEPS` steps: milliseconds per step of each phase since the last
        report (then the counts restart); None in between."""
        if self._phase_steps < PHASE_REPORT_STEPS:
            return None
        report = {k: 1000 * v / self._phase_steps for k, v in sorted(self._phases.items())}
        self._phases.clear()
        self._phase_steps = 0
        return report

    def heartbeat_stats(self, now: float, *, clock: int, staleness: int, accuracy: float | None,
                        lag: Mapping[int, int], row_cache: tuple[int, int] | None = None,
                        auc: float | None = None, log_loss: float | None = None) -> dict[str, object]:
        """The stats one heartbeat carries, over the window since the last one (which closes now).

        ``clock`` is the last clock pushed, ``staleness`` the last step's, ``lag`` the consumer's
        per partition. ``row_cache`` is the row cache's (hits, misses) since it was made (None for
        a model without embedding tables): ``row_cache_hit_rate`` is the hits over the lookups of
        the window, sent when it had any (counts that went back, a new cache, start a new count).
        ``auc`` and ``log_loss``: a binary model's held-out AUC and log loss at its last evaluation.
        ``progressive``: the progressive-validation windows closed since the last heartbeat (the
        newest :data:`MAX_PROGRESSIVE_WINDOWS`), and ``progressive_auc`` the newest window's AUC.
        Only finite numbers are sent (JSON has no NaN).
        """
        w, self._window = self._window, _Window(started=now)
        elapsed = max(now - w.started, 1e-6)
        stats: dict[str, object] = {"records_per_s": w.records / elapsed, "clock": max(clock, 0),
                                    "staleness": staleness, "samples": w.records}
        if self.loss_ema is not None and math.isfinite(self.loss_ema):
            stats["loss"] = self.loss_ema
        if w.steps:
            stats["step_time_s"] = w.step_time_s / w.steps
            stats["bytes_per_step"] = w.wire_bytes / w.steps
        for name, value in (("accuracy", accuracy), ("auc", auc), ("log_loss", log_loss)):
            if value is not None and math.isfinite(value):
                stats[name] = value
        if lag:
            stats["lag"] = sum(lag.values())
        if self._freshness:
            stats["freshness_s"], self._freshness = self._freshness[:MAX_FRESHNESS_SAMPLES], []
        if row_cache is not None:
            (hits, misses), (hits_before, misses_before) = row_cache, self._row_lookups
            if hits < hits_before or misses < misses_before:
                hits_before = misses_before = 0
            self._row_lookups = row_cache
            lookups = (hits - hits_before) + (misses - misses_before)
            if lookups > 0:
                stats["row_cache_hit_rate"] = (hits - hits_before) / lookups
        if self._windows:
            windows, self._windows = self._windows[-MAX_PROGRESSIVE_WINDOWS:], []
            stats["progressive"] = [w.as_json() for w in windows if math.isfinite(w.log_loss)]
        if self.last_window is not None and self.last_window.auc is not None:
            stats["progressive_auc"] = self.last_window.auc
        return stats
