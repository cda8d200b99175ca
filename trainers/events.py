"""Structured records a trainer writes to its log for programs to read: one JSON object a line.

A trainer's human log lines say what they like and may be reworded at will; a program that reads a
trainer's log (``bench/pipeline.py``, ``bench/embeddings.py``) reads these records instead.
:func:`emit` logs one on the logger :data:`LOGGER` at INFO as :data:`PREFIX` and a JSON object with
``event`` (its kind), ``time`` (seconds since the epoch, when it was emitted) and its fields;
:func:`read` finds the records of a kind in a log whatever the log's format puts before the
message (``streamtrain.cli``'s: time, level and logger name).

The kinds and their fields:

``consuming``
    the trainer began consuming the partitions of an assignment: ``member``, ``generation``,
    ``partitions`` (partition -> the offset it starts from; JSON makes the partitions strings).
``step_phases``
    where the last ``steps`` steps' time went (every :data:`trainers.progress.PHASE_REPORT_STEPS`
    steps): ``member``, ``steps``, ``ms_per_step`` (phase -> milliseconds per step: ``wait``,
    ``pull``, ``compute``, and ``push_wait`` where steps push).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["CONSUMING", "LOGGER", "PREFIX", "STEP_PHASES", "emit", "read"]

LOGGER = "trainers.events"
"""The logger the records go to (INFO)."""
PREFIX = "STREAMTRAIN_EVENT "
"""What a record's message starts with; the JSON object follows on the same line."""
CONSUMING = "consuming"
STEP_PHASES = "step_phases"

_logger = logging.getLogger(LOGGER)


def emit(event: str, **fields: Any) -> None:
    """Log one record of kind ``event`` with ``fields`` (JSON-serialisable) and the time now."""
    if _logger.isEnabledFor(logging.INFO):
        record = {"event": event, "time": time.time(), **fields}
        _logger.info("%s%s", PREFIX, json.dumps(record, separators=(",", ":"), default=str))


def read(log: Path | Iterable[str], event: str) -> Iterator[dict[str, Any]]:
    """The records of kind ``event`` in ``log`` (a log file, or its lines), oldest first. A line
    that does not parse (the last one, half written while the trainer runs) is skipped."""
    lines = log.read_text(errors="replace").splitlines() if isinstance(log, Path) else log
    for line in lines:
        _, found, body = line.partition(PREFIX)
        if not found:
            continue
        try:
            record = json.loads(body)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            yield record
