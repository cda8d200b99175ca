"""SSP/BSP/ASP waits and consistent snapshots under concurrent updates, on the real Redis."""

from __future__ import annotations

import threading

import pytest
import redis as redis_lib
import torch
from test_services_util import set_membership

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


def test_snapshots_are_consistent_under_concurrent_updates(redis: redis_lib.Redis, plane) -> None:
    """Every update adds -1 to every value (lr 1, gradient 1) and each atomic write of a group (one
    group version) applies one or more whole updates to every shard of the group: a consistent
    snapshot has, in each group, every value of every shard equal to -u, with u growing with the
    group's version (invariant 3 holds per group; two groups may be a few applies apart)."""
    job, codec = plane
    layout, groups = job.layout, job.meta().groups

    def updates_in(snap) -> list[float]:
        """u of each group of ``snap``, checking every value of the group's shards is -u."""
        flat = {name: t.reshape(-1) for name, t in snap.tensors.items()}
        u: list[float | None] = [None] * groups
        for s in layout.shards:
            g = group_of(s.index, groups)
            seg = flat[s.name][s.start:s.start + s.numel]
            if u[g] is None:
                u[g] = -float(seg[0])
            assert torch.all(seg == -u[g]), (f"shard {s.index} ({s.name}) not all at {-u[g]} in version "
                                             f"{snap.group_versions[g]} of group {g}")
        return u

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
