"""Is online training keeping up with its stream? A pure verdict from lag samples.

``streamtrain up`` samples the coordinator's ``/v1/status`` about once a second
(:func:`sample_from_status`), keeps the last ``window_s`` seconds in a :class:`LagWindow` and shows
:meth:`Verdict.line` (:func:`assess`). No clock and no I/O here, so the rule is tested directly.
See docs/online.md, *How it is measured* and *The rule*.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["LagSample", "LagWindow", "Trend", "Verdict", "assess", "sample_from_status"]


class Trend(str, Enum):
    """Where the lag is heading."""

    MEASURING = "measuring"
    """Too few samples (or too short a span) to fit a slope yet."""
    KEEPING_UP = "keeping up"
    """The lag holds still: consumption matches the input."""
    FALLING_BEHIND = "falling behind"
    """The lag grows: the input outpaces the trainers."""
    CATCHING_UP = "catching up"
    """A backlog shrinks: the trainers outpace the input."""


@dataclass(frozen=True)
class LagSample:
    """Totals over every partition of the training topic at one moment."""

    t_s: float
    """Monotonic time of the sample, seconds."""
    end: int
    """Sum of the partitions' end offsets (messages ever written)."""
    committed: int
    """Sum of the committed offsets (the beginning where nothing is committed yet)."""
    lag: int
    """Sum of the partitions' lag (messages written, not yet committed)."""


@dataclass(frozen=True)
class Verdict:
    """Whether a job keeps up, in records/s, and what to do about it."""

    trend: Trend
    """Where the lag is heading."""
    lag_records: int
    """Lag of the newest sample, records."""
    lag_slope_per_s: float | None
    """Growth of the lag, records/s (negative: shrinking); None while measuring."""
    input_per_s: float | None
    """Records/s written to the topic; None while measuring."""
    consumed_per_s: float | None
    """Records/s committed by the trainers; None while measuring."""
    trainers: int
    """Live trainers."""
    per_trainer_per_s: float | None
    """Measured records/s of one trainer (consumption / trainers); None when unknown."""
    add_trainers: int | None
    """Trainers to add when falling behind (0 otherwise; None: unknown, the trainers consume nothing)."""
    drain_s: float | None
    """Catching up: seconds until the backlog is gone at the current slope."""
    partitions: int | None = None
    """Partitions of the topic, the most trainers that can share it (None: unknown)."""

    def line(self) -> str:
        """One line for the live view."""
        if self.trend is Trend.MEASURING:
            return f"keeping up? measuring the lag trend (lag {self.lag_records:,} records)"
        rates = (f"consumption {self.consumed_per_s:,.0f}/s vs input {self.input_per_s:,.0f}/s"
                 if self.consumed_per_s is not None and self.input_per_s is not None else "")
        if self.trend is Trend.FALLING_BEHIND:
            head = f"falling behind: lag +{self.lag_slope_per_s:,.0f} records/s; {rates}; "
            if self.add_trainers is None:
                return head + "the trainers consume nothing: see their state and logs"
            wanted = self.trainers + self.add_trainers
            advice = (f"add about {self.add_trainers} trainer{'s' if self.add_trainers != 1 else ''} "
                      f"(each does ~{self.per_trainer_per_s:,.0f} records/s)")
            if self.partitions is not None and wanted > self.partitions:
                advice += f" and partitions (the topic has {self.partitions}; a trainer needs one)"
            return head + advice
        if self.trend is Trend.CATCHING_UP:
            return (f"catching up: lag {self.lag_records:,} records, {self.lag_slope_per_s:,.0f} records/s, "
                    f"gone in ~{self.drain_s:,.0f} s; {rates}")
        return f"keeping up: lag {self.lag_records:,} records; {rates}"

    def to_json(self) -> dict[str, Any]:
        """The verdict as JSON (the trend as its value)."""
        return {"trend": self.trend.value, "lag_records": self.lag_records,
                "lag_slope_per_s": self.lag_slope_per_s, "input_per_s": self.input_per_s,
                "consumed_per_s": self.consumed_per_s, "trainers": self.trainers,
                "per_trainer_per_s": self.per_trainer_per_s, "add_trainers": self.add_trainers,
                "drain_s": self.drain_s, "partitions": self.partitions}


def _slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``ts`` (at least two distinct times)."""
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def assess(samples: Sequence[LagSample], trainers: int, *, partitions: int | None = None,
           records_per_message: float = 1.0, min_samples: int = 5, min_span_s: float = 5.0,
           tolerance: float = 0.05, min_growth_per_s: float = 1.0, headroom: float = 0.2) -> Verdict:
    """The verdict on ``samples`` (oldest first) of a job with ``trainers`` live trainers.

    Args:
        samples: lag samples, oldest first; all of them are fitted (a :class:`LagWindow` bounds them).
        trainers: live trainers now.
        partitions: partitions of the topic (caps useful trainers), None when unknown.
        records_per_message: records per Kafka message, to report records rather than offsets.
        min_samples: fewer samples than this give :attr:`Trend.MEASURING`.
        min_span_s: so does a window shorter than this.
        tolerance: lag growth, as a fraction of the input rate, that still counts as keeping up.
        min_growth_per_s: lag growth in records/s that always counts as keeping up (a quiet stream).
        headroom: spare capacity the advice aims at, as a fraction of the input rate.

    Raises:
        ValueError: a negative trainer count, a non-positive ``records_per_message`` or
            negative thresholds.
    """
    if trainers < 0:
        raise ValueError(f"trainers must be >= 0, got {trainers}")
    if not records_per_message > 0:
        raise ValueError(f"records_per_message must be > 0, got {records_per_message}")
    if tolerance < 0 or min_growth_per_s < 0 or headroom < 0:
        raise ValueError(f"tolerance, min_growth_per_s and headroom must be >= 0, got "
                         f"{tolerance}, {min_growth_per_s}, {headroom}")
    scale = records_per_message
    lag_now = round(samples[-1].lag * scale) if samples else 0
    span = samples[-1].t_s - samples[0].t_s if samples else 0.0
    if len(samples) < max(min_samples, 2) or span < min_span_s:
        return Verdict(Trend.MEASURING, lag_now, None, None, None, trainers, None, 0, None, partitions)
    ts = [s.t_s for s in samples]
    lag_slope = _slope(ts, [s.lag for s in samples]) * scale
    input_rate = max(0.0, _slope(ts, [s.end for s in samples]) * scale)
    consumed = max(0.0, _slope(ts, [s.committed for s in samples]) * scale)
    per_trainer = consumed / trainers if trainers and consumed > 0 else None
    threshold = max(min_growth_per_s, tolerance * input_rate)
    if lag_slope > threshold:
        trend = Trend.FALLING_BEHIND
        if per_trainer is None:
            add: int | None = None
        else:
            needed = math.ceil(input_rate * (1 + headroom) / per_trainer)
            add = max(1, needed - trainers)
        return Verdict(trend, lag_now, lag_slope, input_rate, consumed, trainers, per_trainer, add, None,
                       partitions)
    if lag_slope < -threshold and lag_now > 0:
        return Verdict(Trend.CATCHING_UP, lag_now, lag_slope, input_rate, consumed, trainers, per_trainer, 0,
                       lag_now / -lag_slope, partitions)
    return Verdict(Trend.KEEPING_UP, lag_now, lag_slope, input_rate, consumed, trainers, per_trainer, 0, None,
                   partitions)


class LagWindow:
    """The samples of the last ``window_s`` seconds (bounded: older ones are dropped)."""

    def __init__(self, window_s: float = 30.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.samples: deque[LagSample] = deque()

    def add(self, sample: LagSample) -> None:
        """Append ``sample`` and drop those older than the window (a sample out of order restarts it)."""
        if self.samples and sample.t_s <= self.samples[-1].t_s:
            self.samples.clear()
        if self.samples and sample.end < self.samples[-1].end:  # the topic was recreated: start over
            self.samples.clear()
        self.samples.append(sample)
        while self.samples[0].t_s < sample.t_s - self.window_s:
            self.samples.popleft()

    def verdict(self, trainers: int, **kwargs: Any) -> Verdict:
        """:func:`assess` on the window."""
        return assess(list(self.samples), trainers, **kwargs)


def sample_from_status(status: Mapping[str, Any], t_s: float) -> LagSample | None:
    """Totals of a ``/v1/status`` answer at time ``t_s``; None while an offset is unknown (Kafka down)."""
    parts = status.get("partitions") or []
    if not parts:
        return None
    end = committed = lag = 0
    for p in parts:
        done = p.get("committed")
        done = p.get("beginning") if done is None else done
        if p.get("end") is None or done is None or p.get("lag") is None:
            return None
        end += int(p["end"])
        committed += int(done)
        lag += int(p["lag"])
    return LagSample(t_s, end, committed, lag)
