"""Chaos against one shared real topology: Redis killed and restarted on its AOF, the Kafka broker
killed and restarted, a trainer frozen past its lease. Every service must ride it out by itself,
and after each case every record produced is applied exactly once (the record-by-record audit)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis as redis_lib

from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from services import unapplied_updates
from streamtrain.accounting import audit
from streamtrain.cluster import ClusterSpec, LocalCluster
from streamtrain.launcher import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two trainers, no producer of its own: each case produces what it audits."""
    spec = ClusterSpec(producer=None, trainers=2, trainer=replace(ClusterSpec().trainer, eval_source=""),
                       coordinator=CoordinatorSettings(lease_ms=2000, heartbeat_interval_ms=250))
    with LocalCluster(spec, workdir=tmp_path_factory.mktemp("chaos")) as c:
        c.wait_for(lambda st: len(st["members"]) == 2, timeout_s=120, what="two trainers registered")
        yield c


def produce_during(cluster: LocalCluster, records: int, rate: float) -> subprocess.Popen:
    """``streamtrain produce`` of ``records`` digits records at ``rate`` records/s, in its own process
    (it rides out a broker outage: idempotent, retrying). Two shards in flight at most, so an outage
    fills them at once and the producer waits on the brokers, which is the path under test."""
    return subprocess.Popen(
        [sys.executable, "-m", "streamtrain.cli", "produce", "--source", "digits?repeat=0", "--split", "train",
         "--topic", cluster.spec.topic, "--partitions", str(cluster.spec.partitions), "--shard-size", "32",
         "--limit", str(records), "--rate", str(rate), "--max-in-flight-shards", "2", "--no-progress",
         "--bootstrap", cluster.bootstrap],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def settle_and_audit(cluster: LocalCluster, producer: subprocess.Popen) -> None:
    """Wait until everything produced is committed and applied, check no service died, audit."""
    try:
        assert producer.wait(timeout=120) == 0, producer.stderr.read().decode(errors="replace")[-2000:]
    finally:
        producer.kill()
        producer.stderr.close()
    cluster.wait_consumed(timeout_s=180)
    client = redis_lib.Redis.from_url(cluster.redis_url)
    try:
        wait_until(lambda: unapplied_updates(client, cluster.spec.job) == 0, 60,
                   what="every pushed update to be applied")
    finally:
        client.close()
    cluster.raise_if_crashed()
    report = audit(cluster.bootstrap, cluster.spec.topic, cluster.redis_url, cluster.spec.job)
    assert report.uncommitted == 0 and report.exact, report
    assert report.applied == report.expected > 0 and report.rejected_updates == 0


def applied_so_far(cluster: LocalCluster) -> int:
    client = redis_lib.Redis.from_url(cluster.redis_url)
    try:
        return client.xlen(JobKeys(cluster.spec.job).applied_samples)
    finally:
        client.close()


@pytest.mark.parametrize("which", ["redis", "kafka"])
@pytest.mark.leaks_allowed("restarts a server of the module's cluster, which stops it at module teardown",
                           kinds=("processes", "fds"))
def test_a_dependency_killed_and_restarted_is_ridden_out(cluster: LocalCluster, which: str) -> None:
    before = applied_so_far(cluster)
    producer = produce_during(cluster, 4000, rate=1000)
    wait_until(lambda: applied_so_far(cluster) > before + 20, 60, what="training under way")
    cluster.restart(which, down_s=1.0)  # SIGKILL, a second away, back on the same port and folder
    settle_and_audit(cluster, producer)


def test_a_frozen_trainer_is_fenced_and_its_late_pushes_are_refused(cluster: LocalCluster) -> None:
    keys = JobKeys(cluster.spec.job)
    producer = produce_during(cluster, 3000, rate=600)
    frozen = cluster.trainers[0]
    st = cluster.wait_for(lambda s: len(s["members"]) == 2 and all(m["partitions"] for m in s["members"]),
                          timeout_s=60, what="both trainers owning partitions")
    cluster.freeze_trainer(0)
    client = redis_lib.Redis.from_url(cluster.redis_url)
    try:
        # the lease (2 s) runs out: the other trainer takes every partition under a new generation
        after = cluster.wait_for(lambda s: len(s["members"]) == 1, timeout_s=30, what="the frozen trainer expired")
        gone = ({m["member_id"] for m in st["members"]} - {m["member_id"] for m in after["members"]}).pop()
        # what it pushed before it froze is applied (a push already on the wire lands within
        # milliseconds, long before the lease runs out); its clock field may already be gone: a
        # departed member's is removed once its last update is applied
        wait_until(lambda: unapplied_updates(client, cluster.spec.job) == 0, 60,
                   what="the frozen trainer's pushes applied")
        last_clock = client.hget(keys.clocks, gone)
        applied_before = {f[b"update"] for _, f in client.xrange(keys.applied_samples)
                          if f[b"member"] == gone.encode()}
        time.sleep(1.0)
        cluster.thaw(frozen)
        settle_and_audit(cluster, producer)
        # thawed, it pushed with its stale generation: refused, so its clock never moved again (or was
        # cleaned up with the rest of a departed member's state) and nothing of it was applied after
        assert client.hget(keys.clocks, gone) in (last_clock, None)
        late = [f for _, f in client.xrange(keys.applied_samples)
                if f[b"member"] == gone.encode() and f[b"update"] not in applied_before]
        assert late == []
        # and it came back under a new member id
        cluster.wait_for(lambda s: len(s["members"]) == 2, timeout_s=30, what="the thawed trainer back")
    finally:
        client.close()
