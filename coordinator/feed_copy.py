"""A serving system's side of the feed: a copy of the tables kept in sync over HTTP, and the feed's lag.

:class:`FeedCopy` holds, per table, ID -> values and applies the answers of ``GET /v1/model/updates``
(upserts replace a row, tombstones remove it); :func:`follow` polls until the copy has caught up, and
:func:`measure_feed_lag` measures each entry's time from its apply to its arrival.
See docs/serving.md, *Following the tables row by row*.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from services.slot_types import VersionVector
from services.snapshot.pieces import read_manifest, read_piece
from services.tables.feed import DecodedChanges, changes_from_safetensors

__all__ = ["FeedCopy", "FeedHttpError", "fetch_changes", "follow", "FeedLag", "lag_of", "measure_feed_lag"]


class FeedHttpError(Exception):
    """The coordinator refused a read of the feed; ``code`` is its error code (``feed_gone``, ...)."""

    def __init__(self, status: int, code: str, message: str, body: dict) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        """HTTP status."""
        self.code = code
        """The error's code."""
        self.body = body
        """The error's JSON (``feed_gone`` carries ``oldest`` and ``current``)."""


@dataclass
class FeedCopy:
    """A copy of a job's tables (and dense tensors), kept by applying the feed's answers in order."""

    groups: int = 1
    """The job's shard groups (the number of parts of a position)."""
    position: str = ""
    """The position the copy has applied (the next ``since``; empty: "0" per group)."""
    tables: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    """Table -> ID -> its values (float32 ``[dim]``); an ID absent has no row (its initial value)."""
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    """The dense tensors by parameter name, as of the newest answer that carried them."""
    version: str = ""
    """The groups' versions at the newest read applied."""

    def __post_init__(self) -> None:
        if not self.position:
            self.position = VersionVector([0] * self.groups).name()

    @classmethod
    def load_export(cls, folder: str) -> FeedCopy:
        """A copy of the tables that ``streamtrain export --tables-dir folder`` wrote, at the feed position
        its manifest names (follow the feed from there to bring it up to date; the dense part is not in
        it: the first answer that changes dense shards carries them, or load ``GET /v1/model``).

        Raises:
            ValueError: the folder's manifest names no feed position (an export older than the feed).
            OSError: it cannot be read.
        """
        manifest = read_manifest(folder)
        position = manifest.get("feed_position")
        if not isinstance(position, str):
            raise ValueError(f"{folder}: the manifest names no feed_position (exported before the feed existed)")
        copy = cls(groups=int(manifest["groups"]), position=position)
        for table in manifest["tables"]:
            rows = copy.tables.setdefault(table["table"], {})
            for piece in table["pieces"]:
                t = read_piece(os.path.join(folder, piece["file"]))
                rows.update(zip(t["ids"].tolist(), t["values"], strict=True))
        return copy

    def apply(self, changes: DecodedChanges) -> int:
        """Apply one answer (upserts, then tombstones; the groups' IDs are disjoint, so the order
        does not matter); returns the rows it changed."""
        n = 0
        for name, (ids, values, removed) in changes.tables.items():
            rows = self.tables.setdefault(name, {})
            for i, v in zip(ids.tolist(), values, strict=True):
                rows[i] = v
            for i in removed.tolist():
                rows.pop(i, None)
            n += ids.size + removed.size
        if changes.dense:
            self.dense = dict(changes.dense)
        self.position, self.version = changes.position, changes.version
        return n


def fetch_changes(url: str, token: str, since: str, *, limit: int | None = None, timeout_s: float = 30.0
                  ) -> DecodedChanges:
    """One ``GET {url}/v1/model/updates?since=...`` (``url``: the coordinator's base URL).

    Raises:
        FeedHttpError: the coordinator answered an error (410 ``feed_gone``: reload the tables).
        OSError: it could not be reached.
    """
    query = f"since={since}" + (f"&limit={limit}" if limit is not None else "")
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/model/updates?{query}",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return changes_from_safetensors(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            body = json.loads(raw)
            err = body["error"]
            raise FeedHttpError(exc.code, err["code"], err["message"], body) from None
        except (ValueError, KeyError, TypeError):
            raise FeedHttpError(exc.code, "http_error", raw[:200].decode(errors="replace"), {}) from None


def follow(url: str, token: str, copy: FeedCopy, *, limit: int | None = None, most_reads: int = 1000) -> int:
    """Apply the feed's answers to ``copy`` until one reaches every group's head (at most
    ``most_reads``); returns the entries applied (each answer's ``applied_ms`` counts them)."""
    entries = 0
    for _ in range(most_reads):
        changes = fetch_changes(url, token, copy.position, limit=limit)
        copy.apply(changes)
        entries += changes.applied_ms.size
        if not changes.more:
            break
    return entries


@dataclass(frozen=True)
class FeedLag:
    """Apply-to-feed lag of the entries a polling consumer saw (:func:`measure_feed_lag`)."""

    entries: int
    """Entries seen (applied after the measurement began)."""
    p50_ms: float
    """Median ms from an entry's apply (Redis's time) to the consumer's receipt of it."""
    p99_ms: float
    """99th percentile."""
    max_ms: float
    """Largest."""


def lag_of(seen_ms: np.ndarray, applied_ms: np.ndarray) -> FeedLag:
    """The lag of entries applied at ``applied_ms`` and seen at ``seen_ms`` (ms since the epoch)."""
    lag = np.asarray(seen_ms, dtype=np.float64) - np.asarray(applied_ms, dtype=np.float64)
    if lag.size == 0:
        return FeedLag(0, float("nan"), float("nan"), float("nan"))
    return FeedLag(int(lag.size), float(np.percentile(lag, 50)), float(np.percentile(lag, 99)), float(lag.max()))


def measure_feed_lag(url: str, token: str, *, seconds: float, poll_interval_s: float = 0.05, groups: int = 1,
                     limit: int | None = None) -> FeedLag:
    """Poll the feed every ``poll_interval_s`` for ``seconds`` (on the machine of Redis, or one whose
    clock agrees with it: lag is this clock minus Redis's), applying nothing, and measure each entry:
    from its apply to the answer that carried it. The first answer only finds the head (the
    coordinator imports the parameter plane on its first request: seconds of a cold start, no lag of
    the feed); the entries after it are measured."""
    position = VersionVector([0] * groups).name()
    start_ms: float | None = None
    seen: list[np.ndarray] = []
    applied: list[np.ndarray] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            changes = fetch_changes(url, token, position, limit=limit)
        except FeedHttpError as exc:
            if exc.code != "feed_gone" or start_ms is not None:
                raise
            position = str(exc.body["error"]["oldest"])
            continue
        now_ms = time.time() * 1000
        if start_ms is None:  # start at the head
            start_ms, position = now_ms, changes.head
            continue
        applied.append(changes.applied_ms)
        seen.append(np.full(changes.applied_ms.size, now_ms))
        position = changes.position
        if not changes.more:
            time.sleep(poll_interval_s)
    return lag_of(np.concatenate(seen) if seen else np.zeros(0), np.concatenate(applied) if applied else np.zeros(0))
