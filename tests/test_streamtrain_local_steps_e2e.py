"""Local steps (DiLoCo) end to end, everything real: Kafka, Redis, coordinator, parameter server, trainers.

- One BSP trainer with H local steps, an outer optimizer of lr 1 and momentum 0, and fp32 pushes,
  computes what a plain local AdamW loop computes: each window starts on the parameters its previous
  push left (BSP: the trainer's own update is due before the next pull), and the server's outer step
  ``theta - 1 * (theta_pulled - theta_H)`` is ``theta_H``. One push per window, one clock per push.
- Two trainers under SSP with local steps: no member computes beyond the bound (the staleness each
  trainer measured at its clock waits, and the spread of the clocks), each member's clocks advance
  once per push, and the accounting is exact.
- A trainer SIGKILLed in the middle of a window of local steps: the records it stepped on but never
  pushed are not committed, so the next owner trains on them, and the audit is exact.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import cast

import pytest
import redis as redis_lib
import torch

from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from datastream import load_source, produce
from services import ParameterStore, connect
from services.protocol import AccountingRecord
from streamtrain.accounting import audit
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster
from trainers.models import build_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

BATCH = 64


def applied_entries(cluster: LocalCluster) -> list[AccountingRecord]:
    """The job's ``applied_samples`` entries, oldest first."""
    client = redis_lib.Redis.from_url(cluster.redis_url)
    try:
        raw = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(JobKeys(cluster.spec.job).applied_samples))
        return [AccountingRecord.from_fields(fields) for _, fields in raw]
    finally:
        client.close()


def assert_exact(cluster: LocalCluster) -> None:
    report = audit(cluster.bootstrap, cluster.spec.topic, cluster.redis_url, cluster.spec.job)
    assert report.uncommitted == 0, report
    assert report.exact, report
    assert report.applied == report.expected > 0
    assert report.rejected_updates == 0


def assert_one_clock_per_push(entries: list[AccountingRecord], h: int) -> None:
    """Each member's updates carry clocks that rise by one per push, and each covers at most ``h``
    batches; some cover more than one (local steps were taken)."""
    clocks: dict[str, list[int]] = defaultdict(list)
    for e in entries:
        clocks[e.member_id].append(e.clock)
        assert e.batch_size <= h * BATCH, e
    for member, seen in clocks.items():
        assert seen == list(range(seen[0], seen[0] + len(seen))), f"{member}: clocks {seen}"
    assert max(e.batch_size for e in entries) > BATCH


def test_one_bsp_trainer_with_local_steps_computes_what_a_local_adamw_loop_computes(tmp_path) -> None:
    records, h, lr = 640, 4, 0.001
    spec = ClusterSpec(
        job="local", topic="local", trainers=0, producer=None,
        coordinator=CoordinatorSettings(partitions=1, optimizer="adam", lr=lr, codec="none", consistency="bsp",
                                        local_steps=h, outer_lr=1.0, outer_momentum=0.0),
        trainer=replace(LOCAL_TRAINER, model="digits-mlp", batch_size=BATCH, eval_source=""))
    with LocalCluster(spec, workdir=tmp_path / "cluster") as cluster:
        produce(cluster.bootstrap, spec.topic, "digits", partitions=1, shard_size=BATCH, split="train",
                limit=records)
        cluster.add_trainer()
        cluster.wait_consumed(timeout_s=180)
        cluster.quiesce()
        client = connect(cluster.redis_url)
        try:
            store = ParameterStore(client, spec.job)
            stored = store.pull().tensors
            outer = store.meta().optimizer
        finally:
            client.close()
        entries = applied_entries(cluster)
        assert_exact(cluster)
    assert (outer.name, outer.nesterov, outer.lr, outer.momentum) == ("sgd", True, 1.0, 0.0)
    # ten batches: windows of 4, 4 and the 2 left when the stream ran dry; one clock each
    assert [e.batch_size for e in entries] == [4 * BATCH, 4 * BATCH, 2 * BATCH]
    assert [e.clock for e in entries] == [1, 2, 3]
    train = load_source("digits", split="train").read(limit=records)
    net = build_model("digits-mlp").model
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    x, y = torch.from_numpy(train.x).float(), torch.from_numpy(train.y).long()
    for a in range(0, records, BATCH):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[a:a + BATCH]), y[a:a + BATCH]).backward()
        opt.step()
    for name, value in net.state_dict().items():
        assert torch.allclose(stored[name], value, rtol=0, atol=1e-5), \
            f"{name}: {float((stored[name] - value).abs().max()):.3g} off the local loop"


def test_two_ssp_trainers_with_local_steps_stay_within_the_bound_one_clock_per_push(tmp_path) -> None:
    h, s = 4, 1
    spec = ClusterSpec(trainers=2, coordinator=CoordinatorSettings(consistency="ssp", staleness=s, codec="fp16",
                                                                   optimizer="adam", local_steps=h),
                       producer=replace(LOCAL_STREAM, source="digits?repeat=10"))
    with LocalCluster(spec, workdir=tmp_path / "cluster") as cluster:
        spread: list[int] = []
        reported: list[int] = []
        # A member takes part from its first push: until the second trainer's first window is applied
        # the first runs alone, ahead of the clock the second started at (it registered before the
        # first pushed). The bound holds once the second has caught up to where the first was then.
        caught_up: int | None = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            cluster.raise_if_crashed()
            st = cluster.status() or {}
            staleness = st.get("staleness") or {}
            applied = staleness.get("applied_clocks") or {}
            if caught_up is None and len(applied) == 2:
                caught_up = max((staleness.get("clocks") or {}).values())
            if (staleness.get("clock_spread") is not None and caught_up is not None
                    and min(applied.values()) >= caught_up):
                spread.append(staleness["clock_spread"])
            if staleness.get("reported_max") is not None:
                reported.append(staleness["reported_max"])
            if st and cluster.consumed(st):
                break
            time.sleep(0.05)
        assert cluster.consumed(cluster.status() or {}), "not every record was committed in time"
        cluster.quiesce()
        entries = [e for e in applied_entries(cluster) if e.batch_size > 0]
        assert_exact(cluster)
    assert spread and reported, "the clocks were never observed"
    # a member pushes clock c only after every live member's updates up to c - s - 1 are applied
    assert max(spread) <= s + 1, spread
    assert max(reported) <= s, reported
    assert_one_clock_per_push(entries, h)
    assert len({e.member_id for e in entries}) == 2


def test_a_trainer_killed_in_a_window_of_local_steps_leaves_its_records_to_the_next_owner(tmp_path) -> None:
    # H = 16: a SIGKILL at a random moment falls inside a window (steps taken, not pushed) 15 times in 16
    h = 16
    spec = ClusterSpec(trainers=2, coordinator=CoordinatorSettings(codec="fp16", optimizer="adam", local_steps=h),
                       producer=replace(LOCAL_STREAM, source="digits?repeat=20"))
    with LocalCluster(spec, workdir=tmp_path / "cluster") as cluster:
        cluster.wait_for(lambda st: (st["versions"]["max"] or 0) >= 5 and len(st["members"]) == 2,
                         timeout_s=120, what="two trainers to have pushed a few windows")
        victim = cluster.trainers[0]
        cluster.kill_trainer(0)
        cluster.wait_reassigned(1, what=f"{victim.name}'s partitions to be reassigned")
        cluster.wait_consumed(timeout_s=300)
        cluster.quiesce()
        entries = [e for e in applied_entries(cluster) if e.batch_size > 0]
        assert_exact(cluster)
    assert_one_clock_per_push(entries, h)
