"""Updates: what a trainer pushes, the atomic push, and how a log entry is read back.

The encoded gradients go first, as blobs in the slots of the groups that own their shards (never through
Lua nor the job's slot); then one Lua script (``lua/push.lua``) fences, checks the offsets, the clock and
backpressure, logs the update's header and commits its offsets, all or nothing. :func:`was_committed`
settles a push whose reply was lost. See docs/parameter-plane.md, *Push: the blobs, then one atomic step*.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import cast

import redis

from common.keys import JobKeys
from common.outage import REDIS_DOWN

from ..codecs import Sent, decode_sent, decode_sents, is_topk
from ..errors import (
    BackpressureError,
    BadGradientError,
    FencedError,
    OffsetConflictError,
    ParameterPlaneError,
    PayloadError,
)
from ..layout import Layout
from ..protocol import Update, group_of
from ..scripts import PushCall, execute_with_script
from ..slots import read_meta
from ..wire import DEFAULT_MAX_BYTES

logger = logging.getLogger(__name__)

__all__ = ["push_update", "was_committed", "committed_offsets", "unapplied_updates", "load_gradients", "blob_keys",
           "row_blob_keys", "validate_gradients", "DEFAULT_MAX_PENDING"]

DEFAULT_MAX_PENDING = 64
"""Unapplied updates the log may hold before pushes are refused with BackpressureError."""


def validate_gradients(update: Update, layout: Layout, *,
                       max_bytes: int = DEFAULT_MAX_BYTES) -> dict[int, Sent]:
    """Decode every gradient of ``update`` and check it against ``layout``: top-k gradients all
    at once (:func:`services.codecs.decode_sents`), others one by one.

    Returns:
        Shard index -> decoded gradient, sparse as it was sent.

    Raises:
        BadGradientError: unknown shard, wrong number of values, NaN/inf (names the shard).
        UnknownCodecError, PayloadError: from decoding.
    """
    n = len(layout.shards)
    bad = [i for i in update.shards if not 0 <= i < n]
    if bad:  # the header's shard list: every group reaches this verdict, whichever blobs it holds
        raise BadGradientError(f"update from {update.member_id}: shard(s) {bad} do not exist "
                               f"(the model has shards 0..{n - 1})")
    blobs = update.gradients
    together: dict[int, Sent] = {}
    if all(0 <= i < n for i in blobs):  # the shards' top-k gradients decoded together (the small
        sparse = [i for i, b in blobs.items() if is_topk(b)]  # tensors a Pusher sends dense aside)
        sents = decode_sents([bytes(blobs[i]) for i in sparse], [layout.shards[i].numel for i in sparse],
                             max_bytes=max_bytes)
        together = dict(zip(sparse, sents, strict=True)) if sents is not None else {}
    out = {}  # the rest one by one: other codecs, or a refused gradient (the error names its shard)
    for i, blob in blobs.items():
        if i in together:
            out[i] = together[i]
            continue
        if not 0 <= i < n:
            raise BadGradientError(f"update from {update.member_id}: shard {i} does not exist "
                                   f"(the model has shards 0..{n - 1})")
        spec = layout.shards[i]
        out[i] = decode_sent(bytes(blob), numel=spec.numel, max_bytes=max_bytes,
                                 what=f"gradient of shard {i} ({spec.name}[{spec.start}:{spec.start + spec.numel}])")
    return out


def push_update(client: redis.Redis, job: str, update: Update, *, layout: Layout | None = None,
                max_pending: int = DEFAULT_MAX_PENDING, backpressure_timeout_s: float = 30.0,
                max_bytes: int = DEFAULT_MAX_BYTES, groups: int | None = None) -> str:
    """Append ``update`` to the job's log and commit its offsets, atomically and fenced.

    The gradient blobs are written first, each into the slot of the group that owns its shard
    (``groups``: the model's group count, read from its meta when None); the push itself runs in
    the job's slot. A refused push deletes its blobs again.

    With ``layout`` every gradient is decoded and validated first (pass it for
    gradients you did not encode yourself; :class:`services.push.encoder.Pusher`
    validates the tensors before encoding instead). When the log is full the
    push is retried until ``backpressure_timeout_s``.

    Returns:
        The update's log entry id.

    Raises:
        FencedError: stale generation or a partition owned by someone else.
        OffsetConflictError: an offset range does not start at the committed
            offset, or the clock does not advance.
        BackpressureError: the log stayed full until the timeout.
        BadGradientError, UnknownCodecError, PayloadError: a refused gradient or header.
        NoModelError: ``groups`` is None and the job has no model.
        redis.ConnectionError and the other ``common.outage.REDIS_DOWN`` errors (a Redis Cluster's
            CLUSTERDOWN too): the reply may be lost, the push may have been committed
            (:func:`was_committed` says); its blobs are left in place.
    """
    update.validate_header()
    if layout is not None:
        validate_gradients(update, layout, max_bytes=max_bytes)
    total = sum(len(b) for b in update.gradients.values()) + sum(len(b) for b in update.rows.values())
    if total > max_bytes:
        raise PayloadError(f"update from {update.member_id}: oversized, {total} bytes > limit {max_bytes}")
    keys = JobKeys(job)
    if groups is None:
        groups = read_meta(client, job).groups
    bad = [g for g in update.rows if g >= groups]
    if bad:
        raise PayloadError(f"update from {update.member_id}: gradient rows for group(s) {bad} of a model with "
                           f"{groups} group(s)")
    update = dataclasses.replace(update, token=uuid.uuid4().hex, wire_bytes=total)
    blobs = _blobs(keys, update, groups)
    call = PushCall(keys, update, max_pending)
    # the blobs first, each group's into its own slot (one transaction per group), then the push
    for group_blobs in blobs.values():
        pipe = client.pipeline(transaction=True)
        for key, value in group_blobs:
            pipe.set(key, value)
        pipe.execute()

    deadline = time.monotonic() + backpressure_timeout_s
    delay = 0.002
    while True:
        try:
            entry = execute_with_script(client, call.SCRIPT, call.queue)[-1]
            return entry.decode() if isinstance(entry, bytes) else str(entry)
        except REDIS_DOWN:  # CLUSTERDOWN is a ResponseError, but no refusal: the push may have gone
            raise           # through, so its blobs stay and the caller settles it with was_committed
        except redis.ResponseError as exc:
            err = _translate(str(exc))
            if not isinstance(err, BackpressureError) or time.monotonic() >= deadline:
                _drop_blobs(client, blobs)
                raise err from None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def _blob_keys(keys: JobKeys, token: str, shards: Sequence[int], groups: int) -> list[tuple[str, int]]:
    """(blob key, shard) of an update's gradients: each in the slot of the group that owns its shard."""
    return [(keys.group(group_of(i, groups)).update_blob(token, i), i) for i in shards]


def _blobs(keys: JobKeys, update: Update, groups: int) -> dict[int, list[tuple[str, bytes]]]:
    """Group -> (key, value) of every blob of ``update`` in the group's slot: its shards' gradients
    and its gradient rows, in group order."""
    split: dict[int, list[tuple[str, bytes]]] = {}
    for key, i in _blob_keys(keys, update.token, sorted(update.gradients), groups):
        split.setdefault(group_of(i, groups), []).append((key, update.gradients[i]))
    for g, blob in update.rows.items():
        split.setdefault(g, []).append((keys.group(g).rows_blob(update.token), blob))
    return {g: split[g] for g in sorted(split)}


def _drop_blobs(client: redis.Redis, blobs: Mapping[int, Sequence[tuple[str, bytes]]]) -> None:
    """Delete a refused push's blobs (best effort: the groups' sweepers remove what this misses)."""
    for group_blobs in blobs.values():
        try:
            client.delete(*(key for key, _ in group_blobs))
        except redis.RedisError as exc:
            logger.warning("could not delete the blobs of a refused push (%s); the sweeper will", exc)


_REFUSAL = re.compile(r"\b(FENCED|OFFSET|CLOCK|BACKPRESSURE) (.*)", re.S)


def was_committed(client: redis.Redis, job: str, member_id: str, clock: int) -> bool:
    """True when ``member_id``'s push at ``clock`` (or a later one) was committed.

    For a push whose reply was lost (a connection error after sending): the
    member's clock is set only by a committed push, in the same atomic step.
    """
    last = client.hget(JobKeys(job).clocks, member_id)
    return last is not None and int(last) >= clock


def committed_offsets(client: redis.Redis, job: str, partitions: Sequence[int]) -> dict[int, int | None]:
    """Partition -> the next offset to consume, as the committed pushes left it (None: nothing of the
    partition was ever committed: start where the consumer's policy says). Written only by a committed
    push, atomically with its update (``push.lua``), so a new owner resumes exactly there."""
    if not partitions:
        return {}
    committed = client.hmget(JobKeys(job).offsets, [str(p) for p in partitions])
    return {p: (int(c) if c is not None else None) for p, c in zip(partitions, committed)}


def unapplied_updates(client: redis.Redis, job: str) -> int:
    """Pushed updates not yet applied by every parameter-server group (what backpressure counts)."""
    return int(client.get(JobKeys(job).unapplied) or 0)


def _translate(message: str) -> ParameterPlaneError:
    found = _REFUSAL.search(message)
    if found is None:
        return ParameterPlaneError(message)
    kind, text = found.group(1), found.group(2)
    if kind == "FENCED":
        return FencedError(text)
    if kind in ("OFFSET", "CLOCK"):
        return OffsetConflictError(text)
    if kind == "BACKPRESSURE":
        return BackpressureError(text)
    return ParameterPlaneError(message)


def blob_keys(job: str, update: Update, *, groups: int, group: int | None = None) -> list[str]:
    """Keys of the gradient blobs of a parsed update (of ``group``'s shards only, when given)."""
    return [key for key, i in _blob_keys(JobKeys(job), update.token, update.shards, groups)
            if group is None or group_of(i, groups) == group]


def row_blob_keys(job: str, update: Update, *, group: int | None = None) -> list[str]:
    """Keys of the row-gradient blobs of a parsed update (of ``group`` only, when given)."""
    return [JobKeys(job).group(g).rows_blob(update.token) for g in update.row_groups if group is None or g == group]


def load_gradients(client: redis.Redis, job: str, updates: Sequence[Update], *, groups: int,
                   group: int, rows: bool = False) -> list[Update | PayloadError]:
    """Each of ``updates`` with the gradient bytes of ``group``'s shards read from the group's slot
    (one MGET for all of them), and with ``rows`` its gradient rows for the group too; or, for an
    update whose blobs are missing, a PayloadError naming them."""
    mine = [[i for i in u.shards if group_of(i, groups) == group] for u in updates]
    keys = JobKeys(job).group(group)
    row_blob = [rows and group in u.row_groups for u in updates]
    names = [keys.update_blob(u.token, i) for u, shards in zip(updates, mine, strict=True) for i in shards]
    names += [keys.rows_blob(u.token) for u, want in zip(updates, row_blob, strict=True) if want]
    got_all = client.mget(names) if names else []
    blobs, row_blobs = iter(got_all), iter(got_all[len(names) - sum(row_blob):])
    out: list[Update | PayloadError] = []
    for u, shards, want in zip(updates, mine, row_blob, strict=True):
        got = [next(blobs) for _ in shards]
        row = next(row_blobs) if want else None
        missing = [i for i, b in zip(shards, got, strict=True) if b is None]
        lost = [f"gradient blob of shard(s) {missing}"] if missing else []
        if want and row is None:
            lost.append(f"gradient rows blob of group {group}")
        if lost:
            out.append(PayloadError(f"update {u.log_id}: {' and '.join(lost)} missing"))
        else:
            out.append(dataclasses.replace(u, gradients=dict(zip(shards, cast("list[bytes]", got), strict=True)),
                                           rows={group: cast(bytes, row)} if row is not None else {}))
    return out
