"""Shard groups in their own hash slots, on the real Redis: an apply in two halves (the group's, then the
job's accounting), a server killed between them, the blobs of refused and abandoned pushes, an update
one group refuses, and two servers of one group overtaking each other's accounting."""

from __future__ import annotations

import json
import re

import pytest
import redis as redis_lib
import torch
from plane_util import accounting_left, gradient_blobs, set_membership
from test_services_server import JOB, applied, expected_params, grads_for, push_n, setup

import services.push.updates
import services.server.apply
from common.keys import JobKeys
from services import (
    BackpressureError,
    FencedError,
    OffsetConflictError,
    OptimizerConfig,
    ParameterServer,
    Pusher,
    ServerSettings,
    Update,
    get_codec,
    push_update,
    unapplied_updates,
)
from services.server.apply import finish_accounting
from streamtrain.launcher import wait_until

KEYS = JobKeys(JOB)


class Killed(Exception):
    """Stands for the SIGKILL of a server between the two halves of its write."""


def group_server(redis: redis_lib.Redis, redis_url: str, group: int, **settings: object) -> ParameterServer:
    """A loaded server of ``group`` of 2, driven by hand (no thread) on the test's client."""
    ps = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, group=group, groups=2, block_ms=1,
                                        **settings), client=redis)
    ps.load()
    return ps


def slot_of(key: bytes) -> bytes:
    """The hash tag of ``key`` (``psjob:g1`` of ``st:{psjob:g1}:grad:...``)."""
    return key.split(b"{", 1)[1].split(b"}", 1)[0]


def push_token(redis: redis_lib.Redis) -> str:
    """The blob token of the last logged update."""
    (eid, fields), = redis.xrevrange(KEYS.update_log, count=1)
    return Update.from_fields(eid, fields).token


def samples(redis: redis_lib.Redis) -> list[dict[bytes, bytes]]:
    return [f for _, f in redis.xrange(KEYS.applied_samples)]


@pytest.mark.parametrize("when", ["before-accounting", "after-accounting"])
def test_a_server_killed_between_its_halves_finishes_the_accounting_on_restart(
        redis: redis_lib.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """Group 1's server dies after its group's half is written, before (or just after, unaware) the
    job's half: the restarted server records the batch from the plan kept in its slot, and every
    update is accounted exactly once; nothing is applied twice."""
    cfg = OptimizerConfig(name="adam", lr=0.01)
    store = setup(redis, cfg, groups=2)
    push_n(redis, range(1, 5))
    first = group_server(redis, redis_url, 0)
    assert first.step() == 4
    assert applied(redis) == 0 and unapplied_updates(redis, JOB) == 4  # group 1 has reported nothing
    assert len(accounting_left(redis, JOB)) == 4

    doomed = group_server(redis, redis_url, 1)
    account = services.server.apply._account

    def killed(*args: object, **kwargs: object) -> object:
        if when == "after-accounting":
            account(*args, **kwargs)  # recorded, but the server dies before it hears so
        raise Killed

    monkeypatch.setattr(services.server.apply, "_account", killed)
    with pytest.raises(Killed):
        doomed.step()
    monkeypatch.undo()
    assert store.group_versions() == (1, 1)  # group 1's half is written: its shards moved
    if when == "before-accounting":
        assert applied(redis) == 0 and samples(redis) == [] and unapplied_updates(redis, JOB) == 4
    else:
        assert applied(redis) == 4 and len(samples(redis)) == 4

    # the restart (load) finishes the cut-off half first, once: a second time records nothing
    assert finish_accounting(redis, JOB, 1) is (when == "before-accounting")
    restarted = group_server(redis, redis_url, 1)  # load() runs finish_accounting again
    assert restarted.step() == 0  # its cursor is past the batch: nothing to apply again
    assert finish_accounting(redis, JOB, 1) is False
    entries = samples(redis)
    assert [int(f[b"clock"]) for f in entries] == [1, 2, 3, 4]
    assert {f[b"status"] for f in entries} == {b"applied"}
    assert [json.loads(f[b"offsets"]) for f in entries] == [[[0, 10 * c, 10 * c + 10]] for c in range(4)]
    assert applied(redis) == 4 and unapplied_updates(redis, JOB) == 0 and accounting_left(redis, JOB) == []
    assert store.group_versions() == (1, 1)
    snap = store.pull()
    want = expected_params(cfg, [1, 2, 3, 4])
    for k in want:
        torch.testing.assert_close(snap.tensors[k], want[k], rtol=1e-5, atol=1e-6)
    # the restarted server rebuilt group 1's optimizer state: once both groups persist, the log and
    # every blob are gone
    assert first.persist() and restarted.persist()
    assert redis.xlen(KEYS.update_log) == 0 and gradient_blobs(redis, JOB) == []


def test_a_refused_push_leaves_no_blob_in_any_group(redis: redis_lib.Redis) -> None:
    """The blobs go to each shard's group slot before the push; a push refused (fenced, an offset
    conflict, backpressure past its timeout) deletes them from every slot again."""
    setup(redis, OptimizerConfig(), groups=2)
    pusher = Pusher(redis, JOB, "a", max_pending=1)
    pusher.push(grads_for(1), generation=1, clock=1, offsets={0: (0, 10)})
    kept = gradient_blobs(redis, JOB)
    assert len(kept) == 6 and sorted(slot_of(k) for k in kept) == [b"psjob:g0"] * 3 + [b"psjob:g1"] * 3
    with pytest.raises(BackpressureError):  # the log holds max_pending unapplied updates
        pusher.push(grads_for(2), generation=1, clock=2, offsets={0: (10, 20)}, backpressure_timeout_s=0.05)
    assert gradient_blobs(redis, JOB) == kept
    pusher.max_pending = 64
    with pytest.raises(OffsetConflictError):
        pusher.push(grads_for(2), generation=1, clock=2, offsets={0: (15, 20)})
    assert gradient_blobs(redis, JOB) == kept
    set_membership(redis, JOB, {"b": [0]}, generation=2)
    with pytest.raises(FencedError):
        pusher.push(grads_for(2), generation=1, clock=2, offsets={0: (10, 20)})
    assert gradient_blobs(redis, JOB) == kept
    assert redis.xlen(KEYS.update_log) == 1 and unapplied_updates(redis, JOB) == 1


def test_the_blobs_of_an_abandoned_push_are_swept_after_the_grace(
        redis: redis_lib.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pusher that dies between writing its blobs and pushing leaves blobs no update names: each
    group's server deletes its own once they have gone unnamed for sweep_grace_s, and never touches
    the blobs of a logged update."""
    cfg = OptimizerConfig(name="sgd", lr=0.1)
    store = setup(redis, cfg, groups=2)
    pusher = Pusher(redis, JOB, "a")
    pusher.push(grads_for(1), generation=1, clock=1, offsets={0: (0, 10)})  # logged, not applied yet
    logged = gradient_blobs(redis, JOB)

    def dies(*args: object, **kwargs: object) -> object:
        raise redis_lib.ConnectionError("the pusher died before its push")

    monkeypatch.setattr(services.push.updates, "execute_with_script", dies)
    with pytest.raises(redis_lib.ConnectionError):
        pusher.push(grads_for(2), generation=1, clock=2, offsets={0: (10, 20)})
    monkeypatch.undo()
    orphans = sorted(set(gradient_blobs(redis, JOB)) - set(logged))
    assert len(orphans) == 6 and redis.xlen(KEYS.update_log) == 1

    sweepers = [group_server(redis, redis_url, g, sweep_grace_s=1.0) for g in (0, 1)]
    assert [s.sweep() for s in sweepers] == [0, 0]  # just found: within the grace
    swept = [0, 0]

    def sweeps(g: int) -> bool:
        swept[g] += sweepers[g].sweep()
        return swept[g] > 0

    wait_until(lambda: sweeps(0), timeout_s=30, interval_s=0.2, what="group 0 to sweep its orphans")
    assert swept[0] == 3  # group 0 deletes only its own slot's orphans
    assert gradient_blobs(redis, JOB) == sorted([*logged, *(k for k in orphans if slot_of(k) == b"psjob:g1")])
    wait_until(lambda: sweeps(1), timeout_s=30, interval_s=0.2, what="group 1 to sweep its orphans")
    assert swept[1] == 3 and gradient_blobs(redis, JOB) == logged
    assert [s.sweep() for s in sweepers] == [0, 0]

    for s in sweepers:  # the logged update's blobs were kept: it applies
        assert s.step() == 1
    (entry,) = samples(redis)
    assert entry[b"status"] == b"applied" and applied(redis) == 1
    torch.testing.assert_close(store.pull().tensors["w"], expected_params(cfg, [1])["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("refuser_first", [True, False], ids=["refuser-first", "refuser-last"])
@pytest.mark.parametrize("case", ["nan", "truncated", "missing", "unknown shard"])
def test_an_update_one_group_refuses_is_accounted_rejected_once(
        redis: redis_lib.Redis, redis_url: str, case: str, refuser_first: bool) -> None:
    """Each group validates only its own shards' blobs (and the header's shard list, which every group
    checks alike): an update whose blob for group 1 is bad is accounted once, as rejected with group
    1's reason, whichever group reports first; the next update applies everywhere."""
    store = setup(redis, OptimizerConfig(name="sgd", lr=0.1), groups=2)
    codec = get_codec("none")
    good = codec.encode(torch.ones(64)).data  # shards 0 and 1 (group 0 and 1) hold 64 values
    blobs = {0: good, 1: good}
    if case == "nan":
        blobs[1] = codec.encode(torch.full((64,), float("nan")), check_finite=False).data
        reason = "64 NaN"
    elif case == "truncated":
        blobs[1] = good[:-3]
        reason = "truncated"
    elif case == "missing":
        reason = r"gradient blob of shard\(s\) \[1\] missing"
    else:
        blobs[9] = good  # its blob lands in group 1's slot; the header names a shard the model lacks
        reason = r"shard\(s\) \[9\] do not exist"
    push_update(redis, JOB, Update(member_id="a", generation=1, clock=1, gradients=blobs, offsets={0: (0, 10)},
                                   samples=[("p", 0, 10)]))  # no layout: not validated by the pusher
    if case == "missing":
        redis.delete(KEYS.group(1).update_blob(push_token(redis), 1))
    servers = {g: group_server(redis, redis_url, g) for g in (0, 1)}
    order = (1, 0) if refuser_first else (0, 1)
    assert servers[order[0]].step() == 1
    assert samples(redis) == [] and unapplied_updates(redis, JOB) == 1  # one group has reported
    assert servers[order[1]].step() == 1
    (entry,) = samples(redis)
    assert entry[b"status"] == b"rejected" and entry[b"clock"] == b"1"
    assert re.search(reason, entry[b"reason"].decode()), entry[b"reason"]
    assert unapplied_updates(redis, JOB) == 0 and accounting_left(redis, JOB) == [] and applied(redis) == 1
    assert servers[1].rejected == 1 and servers[0].rejected == (1 if case == "unknown shard" else 0)
    # group 1's shards are untouched; group 0 applied its part unless it refused the header too (the
    # groups apply independently: `rejected` says the update was not applied as a whole)
    assert store.group_versions() == ((0, 0) if case == "unknown shard" else (1, 0))

    push_update(redis, JOB, Update(member_id="a", generation=1, clock=2, gradients={0: good, 1: good},
                                   offsets={0: (10, 20)}, samples=[("p", 10, 10)]))
    for g in order:
        assert servers[g].step() == 1
    assert [(f[b"clock"], f[b"status"]) for f in samples(redis)] == [(b"1", b"rejected"), (b"2", b"applied")]
    assert unapplied_updates(redis, JOB) == 0 and accounting_left(redis, JOB) == []


def test_a_server_whose_accounting_another_server_of_its_group_overtook_carries_on(
        redis: redis_lib.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two servers of one group: x writes its group's half, and before its job's half runs, y loses
    the compare-and-set, reloads (finishing x's accounting) and applies the next update. x's job's
    half then finds the group's accounting past its plan: already recorded, not an error (x goes on,
    and its next write loses the compare-and-set and reloads); each update is accounted once."""
    cfg = OptimizerConfig(name="sgd", lr=0.1)
    store = setup(redis, cfg, groups=2)
    push_n(redis, range(1, 3))
    x, y = (group_server(redis, redis_url, 0, batch=1) for _ in range(2))
    account = services.server.apply._account

    def delayed(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(services.server.apply, "_account", account)
        assert y.step() == 0  # lost the compare-and-set to x: reloaded, recording x's plan
        assert y.step() == 1  # the next update: the group's accounting is past x's plan
        return account(*args, **kwargs)

    monkeypatch.setattr(services.server.apply, "_account", delayed)
    assert x.step() == 1
    assert x.step() == 0 and x.step() == 0  # lost the compare-and-set to y, reloaded: nothing left
    other = group_server(redis, redis_url, 1)
    assert other.step() == 2
    assert [int(f[b"clock"]) for f in samples(redis)] == [1, 2] and applied(redis) == 2
    assert unapplied_updates(redis, JOB) == 0 and accounting_left(redis, JOB) == []
    assert store.group_versions() == (2, 1)
    torch.testing.assert_close(store.pull().tensors["w"], expected_params(cfg, [1, 2])["w"], rtol=1e-5, atol=1e-6)


def test_an_idle_housekeeping_with_a_stale_cursor_reloads(redis: redis_lib.Redis, redis_url: str) -> None:
    """A server idle at a cursor another server of its group has since moved past: its housekeeping
    write (the job's half alone) is refused as stale and the server reloads, instead of failing."""
    setup(redis, OptimizerConfig(name="sgd", lr=0.1), groups=2)
    idle = group_server(redis, redis_url, 0, housekeeping_s=0.0)
    busy = group_server(redis, redis_url, 0)
    push_n(redis, range(1, 2))
    assert busy.step() == 1
    assert idle.apply_entries([]) == 0  # housekeeping due, refused: the server reloads
    assert idle.step() == 0 and idle._state.cursor == busy._state.cursor
