"""SSP/BSP/ASP waits and consistent snapshots under concurrent updates (also pulled ahead, as a trainer
overlaps its pulls with compute: trainers.prefetch), on the real Redis."""

from __future__ import annotations

import threading

import pytest
import redis as redis_lib
import torch
from plane_util import set_membership

from common.keys import JobKeys
from services import (
    Consistency,
    OptimizerConfig,
    ParameterServer,
    ParameterStore,
    Pusher,
    ServerSettings,
    StalenessTimeout,
    starting_clock,
    wait_for_clock,
)
from services.consistency import required_clock
from services.protocol import group_of
from streamtrain.launcher import wait_until
from trainers.prefetch import PullAhead, overlaps

JOB = "sspjob"


def test_required_clock() -> None:
    assert required_clock(Consistency("bsp"), 5) == 4
    assert required_clock(Consistency("ssp", 2), 5) == 2
    assert required_clock(Consistency("asp"), 5) is None
    with pytest.raises(ValueError, match="consistency must be"):
        Consistency("eventual")


def model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(300), "b": torch.zeros(7)}


def start_job(redis: redis_lib.Redis, redis_url: str, cfg: OptimizerConfig, compact_fraction: float = 0.5,
              groups: int = 1) -> tuple[ParameterStore, list[ParameterServer]]:
    """The job's store and its running servers, one per shard group."""
    store = ParameterStore(redis, JOB)
    store.init_model(model(), shard_elems=64, optimizer=cfg, groups=groups)
    set_membership(redis, JOB, {"fast": [0], "slow": [1]}, generation=1)
    servers = [ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, block_ms=20, group=g, groups=groups,
                                              compact_fraction=compact_fraction)) for g in range(groups)]
    try:
        for server in servers:
            server.start()
    except BaseException:
        for server in servers:
            server.close()
        raise
    return store, servers


@pytest.fixture
def job(redis: redis_lib.Redis, redis_url: str):
    store, servers = start_job(redis, redis_url, OptimizerConfig(lr=1.0, momentum=0.0))
    try:
        yield store
    finally:
        for server in servers:
            server.close()


PLANES = {
    # dense SGD: every apply rewrites the shards in full
    "full": (OptimizerConfig(lr=1.0, momentum=0.0), "none", 0.5),
    # a sparse optimizer fed top-k gradients that keep every value: every apply publishes deltas,
    # and every second or third one per shard also compacts it (a delta of a 64-value shard is ~1.3x its bytes)
    "deltas": (OptimizerConfig(name="dgc", lr=1.0, momentum=0.0), "topk", 3.0),
}


@pytest.fixture(params=[(name, groups) for name in sorted(PLANES) for groups in (1, 2)],
                ids=lambda p: f"{p[0]}-{p[1]}group{'s' if p[1] > 1 else ''}")
def plane(request, redis: redis_lib.Redis, redis_url: str):
    """(store, codec the pushes use) of a job applied by running servers (one, or two splitting the
    shards), for each way an apply publishes."""
    name, groups = request.param
    cfg, codec, fraction = PLANES[name]
    store, servers = start_job(redis, redis_url, cfg, fraction, groups)
    try:
        yield store, codec
    finally:
        for server in servers:
            server.close()


def ones() -> dict[str, torch.Tensor]:
    return {k: torch.ones_like(v) for k, v in model().items()}


def test_ssp_blocks_then_releases_and_a_departed_member_releases(redis: redis_lib.Redis, job) -> None:
    cons = Consistency("ssp", staleness=1)
    fast, slow = Pusher(redis, JOB, "fast"), Pusher(redis, JOB, "slow")
    slow.push(ones(), generation=1, clock=1)
    for c in (1, 2, 3):
        fast.push(ones(), generation=1, clock=c)
    wait_until(lambda: redis.hget(JobKeys(JOB).applied_clocks, "fast") == b"3", 60, what="fast applied")
    # fast at clock 4 needs everyone at applied clock >= 2; slow is at 1
    assert wait_for_clock(redis, JOB, "fast", 3, consistency=cons).staleness == 1
    with pytest.raises(StalenessTimeout, match="slowest live member slow is at 1"):
        wait_for_clock(redis, JOB, "fast", 4, consistency=cons, timeout_s=0.2)
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(
        w=wait_for_clock(redis, JOB, "fast", 4, consistency=cons, timeout_s=60)))
    waiter.start()
    try:
        waiter.join(0.5)
        assert waiter.is_alive() and "w" not in result  # still blocked: slow is at 1
        slow.push(ones(), generation=1, clock=2)  # slow catches up -> releases fast
        waiter.join(60)
        assert not waiter.is_alive(), "the waiter was not released by slow catching up"
    finally:
        waiter.join(60)
    assert result["w"].min_applied >= 2 and result["w"].staleness <= 1
    # BSP: fast at clock 4 needs slow at 3 (it is at 2); slow leaves the membership instead
    with pytest.raises(StalenessTimeout):
        wait_for_clock(redis, JOB, "fast", 4, consistency=Consistency("bsp"), timeout_s=0.1)
    waiter = threading.Thread(target=lambda: result.update(
        b=wait_for_clock(redis, JOB, "fast", 4, consistency=Consistency("bsp"), timeout_s=60)))
    waiter.start()
    try:
        waiter.join(0.5)
        assert waiter.is_alive() and "b" not in result  # still blocked: slow is at 2
        set_membership(redis, JOB, {"fast": [0, 1]}, generation=2, departed=("slow",))
        waiter.join(60)
        assert not waiter.is_alive(), "the waiter was not released by slow departing"
    finally:
        waiter.join(60)
    assert result["b"].min_applied == 3  # only fast counts now
    assert redis.hget(JobKeys(JOB).staleness, "fast") is not None
    assert wait_for_clock(redis, JOB, "fast", 100, consistency=Consistency("asp")).required is None
    assert starting_clock(redis, JOB, "newcomer") == 4


def test_a_members_own_updates_are_due_before_it_counts_as_participating(redis: redis_lib.Redis, job) -> None:
    bsp = Consistency("bsp")
    set_membership(redis, JOB, {"fast": [0], "slow": [1]}, generation=1)
    # nobody has pushed: no member participates, so the others' part of the bound is met at once ...
    assert wait_for_clock(redis, JOB, "fast", 2, consistency=bsp, timeout_s=0.1).min_applied is None
    # ... but under BSP fast's own update of clock 1 is due at clock 2, pushed or still on its way
    with pytest.raises(StalenessTimeout, match="its own updates up to clock 1"):
        wait_for_clock(redis, JOB, "fast", 2, consistency=bsp, timeout_s=0.1, own_from=1)
    Pusher(redis, JOB, "fast").push(ones(), generation=1, clock=1)
    assert wait_for_clock(redis, JOB, "fast", 2, consistency=bsp, timeout_s=60, own_from=1).own_applied == 1
    # SSP s = 1: at clock 3 fast's own clock 1 is due (applied), clock 2 not yet
    assert wait_for_clock(redis, JOB, "fast", 3, consistency=Consistency("ssp", staleness=1), timeout_s=0.1,
                          own_from=1).own_applied == 1
    # a member that starts at clock 5 owes nothing of its own before it; fast (applied 1) meets the rest
    assert wait_for_clock(redis, JOB, "slow", 2, consistency=bsp, timeout_s=0.1, own_from=5).min_applied == 1
    # live, slow (first clock 1, nothing applied) waits on its own update of clock 1 ...
    with pytest.raises(StalenessTimeout, match="its own updates up to clock 1"):
        wait_for_clock(redis, JOB, "slow", 2, consistency=bsp, timeout_s=0.1, own_from=1)
    # ... fenced (out of the membership), it does not: its refused pushes would never be applied, so
    # it goes on to push, is refused and resynchronises
    set_membership(redis, JOB, {"fast": [0, 1]}, generation=2, departed=("slow",))
    assert wait_for_clock(redis, JOB, "slow", 2, consistency=bsp, timeout_s=0.1, own_from=1).own_applied == 0


def test_a_window_of_local_steps_waits_for_its_own_previous_windows_in_any_mode(redis: redis_lib.Redis, job) -> None:
    ssp = Consistency("ssp", staleness=2)
    # SSP s = 2 asks nothing of fast's own clock 1 at clock 2; local steps (own_through 1) do
    assert wait_for_clock(redis, JOB, "fast", 2, consistency=ssp, timeout_s=0.1, own_from=1).own_applied == 0
    for mode in (ssp, Consistency("asp")):
        with pytest.raises(StalenessTimeout, match="its own updates up to clock 1"):
            wait_for_clock(redis, JOB, "fast", 2, consistency=mode, timeout_s=0.1, own_from=1, own_through=1)
    Pusher(redis, JOB, "fast").push(ones(), generation=1, clock=1)
    for mode in (ssp, Consistency("asp")):
        wait = wait_for_clock(redis, JOB, "fast", 2, consistency=mode, timeout_s=60, own_from=1, own_through=1)
        assert wait.own_applied == 1


def updates_held(store, snap_tensors: dict[str, torch.Tensor]) -> list[float]:
    """Per group, the number of updates u its values hold (every update adds -1 to every value), checking
    every value of the group is -u."""
    layout, groups = store.layout, store.meta().groups
    flat = {name: t.reshape(-1) for name, t in snap_tensors.items()}
    u: list[float | None] = [None] * groups
    for s in layout.shards:
        g = group_of(s.index, groups)
        seg = flat[s.name][s.start:s.start + s.numel]
        u[g] = -float(seg[0]) if u[g] is None else u[g]
        assert torch.all(seg == -u[g]), f"shard {s.index} ({s.name}) not all at {-u[g]} in group {g}"
    return [float(x) for x in u]


def test_snapshots_are_consistent_under_concurrent_updates(redis: redis_lib.Redis, plane) -> None:
    """Every update adds -1 to every value (lr 1, gradient 1) and each atomic write of a group (one
    group version) applies one or more whole updates to every shard of the group: a consistent
    snapshot has, in each group, every value of every shard equal to -u, with u growing with the
    group's version (invariant 3 holds per group; two groups may be a few applies apart)."""
    job, codec = plane
    groups = job.meta().groups

    def updates_in(snap) -> list[float]:
        return updates_held(job, snap.tensors)

    stop = threading.Event()
    pushed = []

    def pusher() -> None:
        p = Pusher(redis, JOB, "fast", max_pending=4, codec=codec,  # backpressure keeps the log short
                   codec_options={"density": 1.0} if codec == "topk" else {})
        c = 0
        while not stop.is_set() and c < 200:
            c += 1
            p.push(ones(), generation=1, clock=c)
            pushed.append(c)

    thread = threading.Thread(target=pusher)
    thread.start()
    snaps = []
    try:
        snap = job.pull()
        applied_at: dict[tuple[int, int], float] = {}  # (group, group version) -> updates applied by then
        while thread.is_alive() or int(redis.hget(JobKeys(JOB).applied_clocks, "fast") or 0) < len(pushed):
            snap = job.pull(since=snap)
            snaps.append(snap)
            for g, u in enumerate(updates_in(snap)):
                assert applied_at.setdefault((g, snap.group_versions[g]), u) == u
        for g in range(groups):  # u grows with the group's version
            versions = sorted(v for h, v in applied_at if h == g)
            assert [applied_at[g, v] for v in versions] == sorted({applied_at[g, v] for v in versions})
    finally:
        stop.set()
        thread.join(60)
    snap = job.pull(since=snap)
    assert len(pushed) == 200 and torch.all(snap.tensors["w"] == -200.0)
    assert len({s.version for s in snaps}) > 3  # the pulls saw the model move
    assert any(len(s.fetched) > 0 for s in snaps)
    # every update writes all 6 shards: each is at its group's version
    assert all(s.versions == tuple(s.group_versions[group_of(i, groups)] for i in range(6)) for s in snaps)
    assert all(s.version == sum(s.group_versions) for s in snaps)
    keys = [JobKeys(JOB).group(group_of(i, groups)) for i in range(6)]  # shard i's group
    bases = [int(redis.hget(keys[i].bases, str(i))) for i in range(6)]
    at = [snap.group_versions[group_of(i, groups)] for i in range(6)]
    if codec == "topk":  # deltas were published, and shards compacted now and then
        assert all(redis.xlen(keys[i].deltas(i)) > 0 for i in range(6)) and all(0 < b <= v for b, v in zip(bases, at))
    else:  # every apply rewrote every shard: no deltas
        assert all(redis.xlen(keys[i].deltas(i)) == 0 for i in range(6)) and bases == at


def test_a_wait_reuses_its_last_read_only_while_no_update_can_be_due_that_it_did_not_see(
        redis: redis_lib.Redis) -> None:
    """With every live member pushing at the last read, a step that read already allows needs no read
    (a member that starts pushing later starts above this one's pushed clock). A live member that had
    not pushed yet, or a clock the read does not allow, forces a read (seen here as a timeout: Redis is
    made to miss the bound)."""
    keys = JobKeys(JOB)
    set_membership(redis, JOB, {"a": [0], "b": [1]}, generation=1)
    redis.hset(keys.clocks, mapping={"a": 10, "b": 10})
    redis.hset(keys.applied_clocks, mapping={"a": 9, "b": 9})
    ssp = Consistency("ssp", 2)
    known = wait_for_clock(redis, JOB, "a", 11, consistency=ssp)
    assert known.complete and known.pushed == 10 and known.min_applied == 9
    redis.hset(keys.applied_clocks, "b", 0)  # a read would now block
    assert wait_for_clock(redis, JOB, "a", 12, consistency=ssp, known=known, timeout_s=0.05).waited_s == 0
    with pytest.raises(StalenessTimeout):  # clock 13 needs applied clocks >= 10: the read saw 9
        wait_for_clock(redis, JOB, "a", 13, consistency=ssp, known=known, timeout_s=0.05)
    redis.hset(keys.applied_clocks, "b", 9)
    redis.hset(keys.members, "c", "{}")  # live, has not pushed yet: its first clocks may be low
    partial = wait_for_clock(redis, JOB, "a", 11, consistency=ssp)
    assert not partial.complete
    redis.hset(keys.applied_clocks, "b", 0)
    with pytest.raises(StalenessTimeout):
        wait_for_clock(redis, JOB, "a", 12, consistency=ssp, known=partial, timeout_s=0.05)


# -- overlapped pulls (trainers.prefetch): a pull ahead, swapped into the replica --------------------------

def as_params(tensors: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    return {name: torch.nn.Parameter(t.clone()) for name, t in tensors.items()}


def data(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {name: p.data for name, p in params.items()}


def test_overlaps_only_where_a_pull_ahead_can_serve_the_next_step() -> None:
    assert overlaps(Consistency("ssp", 2), 1) and overlaps(Consistency("ssp", 1), 1) and overlaps(Consistency("asp"), 1)
    assert not overlaps(Consistency("bsp"), 1)  # the next step needs this step's own update
    assert not overlaps(Consistency("ssp", 0), 1)
    assert not overlaps(Consistency("ssp", 2), 8)  # local steps write the parameters they compute on


def test_pulls_ahead_swapped_in_hold_every_update_their_clocks_said_and_reuse_two_buffers(
        redis: redis_lib.Redis, plane) -> None:
    """While a member pushes 150 updates, the replica takes pull after pull ahead (reading its
    parameters meanwhile, as a step computes): each holds, in every group, at least the updates up to
    the lowest applied clock it read before pulling, and is consistent; the parameters alternate between
    two buffers (no copy, no allocation per step); the last one holds all 150."""
    store, codec = plane
    stop, pushed = threading.Event(), []

    def pusher() -> None:
        p = Pusher(redis, JOB, "fast", max_pending=4, codec=codec,
                   codec_options={"density": 1.0} if codec == "topk" else {})
        for c in range(1, 151):
            if stop.is_set():
                return
            p.push(ones(), generation=1, clock=c)
            pushed.append(c)

    params = as_params(store.pull().tensors)
    snap = store.pull(out=data(params))
    ahead = PullAhead(redis, JOB, data(params))
    storages: set[int] = set()
    thread = threading.Thread(target=pusher)
    thread.start()
    taken = lows = 0
    try:
        while True:
            done = not thread.is_alive() and int(redis.hget(JobKeys(JOB).applied_clocks, "fast") or 0) == 150
            assert ahead.start(snap, "fast", data(params))
            before = updates_held(store, data(params))  # the step computes: it reads the parameters
            got = ahead.take(snap, "fast")
            assert got is not None and got.base is snap
            ahead.swap(params, got)
            taken += 1
            assert all(params[n].data_ptr() == t.data_ptr() for n, t in got.snapshot.tensors.items())
            u = updates_held(store, data(params))
            assert all(a >= b for a, b in zip(u, before, strict=True))  # never back in time
            if got.low is not None:  # every update up to the clock read before the pull is in it
                lows += 1
                assert min(u) >= got.low, (u, got.low)
            storages.update(p.data.data_ptr() for p in params.values())
            snap = got.snapshot
            if done:
                break
    finally:
        stop.set()
        thread.join(60)
        ahead.close()
    assert updates_held(store, data(params)) == [150.0] * store.meta().groups
    assert taken > 3 and lows > 0 and ahead.taken == taken == ahead.started
    assert len(storages) == 2 * len(params)  # two buffers, swapped back and forth


def test_a_pull_ahead_is_dropped_unless_it_extends_what_the_replica_holds(redis: redis_lib.Redis, job) -> None:
    """Taken only from the snapshot the replica holds and under the same member id; one that failed is
    dropped too. One that found nothing new holds the parameters themselves: nothing is swapped."""
    store = job
    params = as_params(store.pull().tensors)
    snap = store.pull(out=data(params))
    ahead = PullAhead(redis, JOB, data(params))
    try:
        ptrs = {n: p.data.data_ptr() for n, p in params.items()}
        assert ahead.start(snap, "fast", data(params))
        assert not ahead.start(snap, "fast", data(params))  # one at a time
        got = ahead.take(snap, "fast")
        assert got is not None and got.snapshot.tensors is snap.tensors  # nothing changed
        ahead.swap(params, got)
        assert {n: p.data.data_ptr() for n, p in params.items()} == ptrs

        Pusher(redis, JOB, "fast", codec="none").push(ones(), generation=1, clock=1)
        assert ahead.start(snap, "fast", data(params))
        newer = store.pull(snap, out=data(params))  # the step pulled by itself meanwhile
        assert ahead.take(newer, "fast") is None
        assert ahead.start(newer, "fast", data(params))
        assert ahead.take(newer, "someone-else") is None
        assert ahead.start(newer, "fast", data(params))
        assert ahead.take(None, "fast") is None  # the replica is not trusted (after an outage)

        broken = PullAhead(redis, "no-such-job", data(params))
        try:
            assert broken.start(newer, "fast", data(params))
            assert broken.take(newer, "fast") is None  # no model there: the pull failed
        finally:
            broken.close()
    finally:
        ahead.close()
