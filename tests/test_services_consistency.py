"""SSP/BSP/ASP waits and consistent snapshots under concurrent updates, on the real Redis."""

from __future__ import annotations

import threading

import pytest
import redis as redis_lib
import torch
from test_services_util import set_membership, wait_for

from services import (
    Consistency, OptimizerConfig, ParameterServer, ParameterStore, Pusher, ServerSettings, StalenessTimeout,
    starting_clock, wait_for_clock,
)
from services.consistency import required_clock
from streamtrain.keys import JobKeys

JOB = "sspjob"


def test_required_clock() -> None:
    assert required_clock(Consistency("bsp"), 5) == 4
    assert required_clock(Consistency("ssp", 2), 5) == 2
    assert required_clock(Consistency("asp"), 5) is None
    with pytest.raises(ValueError, match="consistency must be"):
        Consistency("eventual")


def model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(300), "b": torch.zeros(7)}


@pytest.fixture
def job(redis: redis_lib.Redis, redis_url: str):
    store = ParameterStore(redis, JOB)
    store.init_model(model(), shard_elems=64, optimizer=OptimizerConfig(lr=1.0, momentum=0.0))
    set_membership(redis, JOB, {"fast": [0], "slow": [1]}, generation=1)
    server = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, block_ms=20))
    server.start()
    try:
        yield store
    finally:
        server.close()


def ones() -> dict[str, torch.Tensor]:
    return {k: torch.ones_like(v) for k, v in model().items()}


def test_ssp_blocks_then_releases_and_a_departed_member_releases(redis: redis_lib.Redis, job) -> None:
    cons = Consistency("ssp", staleness=1)
    fast, slow = Pusher(redis, JOB, "fast"), Pusher(redis, JOB, "slow")
    slow.push(ones(), generation=1, clock=1)
    for c in (1, 2, 3):
        fast.push(ones(), generation=1, clock=c)
    wait_for(lambda: redis.hget(JobKeys(JOB).applied_clocks, "fast") == b"3", what="fast applied")
    # fast at clock 4 needs everyone at applied clock >= 2; slow is at 1
    assert wait_for_clock(redis, JOB, "fast", 3, consistency=cons).staleness == 1
    with pytest.raises(StalenessTimeout, match="slowest live member slow is at 1"):
        wait_for_clock(redis, JOB, "fast", 4, consistency=cons, timeout_s=0.2)
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(
        w=wait_for_clock(redis, JOB, "fast", 4, consistency=cons, timeout_s=60)))
    waiter.start()
    try:
        assert not waiter.join(0.3) and waiter.is_alive()  # still blocked
        slow.push(ones(), generation=1, clock=2)  # slow catches up -> releases fast
        waiter.join(60)
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
        assert not waiter.join(0.2) and waiter.is_alive()
        set_membership(redis, JOB, {"fast": [0, 1]}, generation=2, departed=("slow",))
    finally:
        waiter.join(60)
    assert result["b"].min_applied == 3  # only fast counts now
    assert redis.hget(JobKeys(JOB).staleness, "fast") is not None
    assert wait_for_clock(redis, JOB, "fast", 100, consistency=Consistency("asp")).required is None
    assert starting_clock(redis, JOB, "newcomer") == 4


def test_snapshots_are_consistent_under_concurrent_updates(redis: redis_lib.Redis, job) -> None:
    """Every update adds -1 to every value (lr 1, gradient 1) and each atomic write (one model
    version) applies one or more whole updates to every shard: a consistent snapshot has every
    value equal to -u, in every shard, with u growing with the version."""
    stop = threading.Event()
    pushed = []

    def pusher() -> None:
        p = Pusher(redis, JOB, "fast", max_pending=4)  # backpressure keeps the log short
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
        applied_at: dict[int, float] = {}  # version -> updates applied by then
        while thread.is_alive() or int(redis.hget(JobKeys(JOB).applied_clocks, "fast") or 0) < len(pushed):
            snap = job.pull(since=snap)
            snaps.append(snap)
            u = -float(next(iter(snap.tensors.values())).reshape(-1)[0])
            for name, t in snap.tensors.items():
                assert torch.all(t == -u), f"{name} not all at {-u} in version {snap.version}"
            assert applied_at.setdefault(snap.version, u) == u
        versions = sorted(applied_at)
        assert [applied_at[v] for v in versions] == sorted(set(applied_at.values()))  # u grows with v
    finally:
        stop.set()
        thread.join(60)
    snap = job.pull(since=snap)
    assert len(pushed) == 200 and torch.all(snap.tensors["w"] == -200.0)
    assert len({s.version for s in snaps}) > 3  # the pulls saw the model move
    assert any(0 < len(s.fetched) for s in snaps)
    assert all(s.versions == (s.version,) * 6 for s in snaps)  # every update writes all 6 shards
