"""End to end from raw events, everything real: impressions and delayed clicks on two topics, the joiner
(SIGKILLed mid-stream and started again) labelling them into the training topic, trainers running the ranking
model on it, and the accounting audited record by record from the impressions to the applied updates."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import msgpack
import pytest
from kafka import KafkaConsumer, TopicPartition

from coordinator.settings import CoordinatorSettings
from datastream.clickevents import Truth
from datastream.settings import EventsSettings, JoinSettings
from streamtrain.accounting import audit
from streamtrain.cluster import LOCAL_TRAINER, ClusterSpec, LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STREAM = "clicks?features=4&dense=3&vocab=20000&seed=3"
MODEL = "dlrm?features=4&dense=3&dim=8&row_lr=0.05"


def committed_records(bootstrap: str, topic: str) -> dict[str, dict]:
    """Impression id -> its training record, as a trainer reads the topic (read committed)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        ends = consumer.end_offsets(tps)
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out: dict[str, dict] = {}
        count = 0
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            for msgs in consumer.poll(timeout_ms=500).values():
                for m in msgs:
                    count += 1
                    out[m.key.decode()] = msgpack.unpackb(m.value)
        assert count == len(out), "an impression is on the training topic twice"
        return out
    finally:
        consumer.close()


@pytest.mark.parametrize("negative_rate", [1.0, 0.5])
def test_impressions_and_clicks_train_exactly_once_through_a_joiner_kill(tmp_path, negative_rate: float) -> None:
    truth_path = tmp_path / "truth.jsonl"
    spec = ClusterSpec(
        job="clicks", topic="clicks", trainers=2,
        coordinator=CoordinatorSettings(optimizer="adam", lr=0.005, codec="fp16", table_consistency="asp",
                                        table_staleness=4),
        trainer=replace(LOCAL_TRAINER, model=MODEL, eval_source=STREAM, batch_size=128, eval_every=1000),
        producer=None,
        events=EventsSettings(stream=STREAM, limit=15_000, rate_per_s=1000.0, rate=1000.0, delay_mean_s=2.0,
                              window_s=5.0, final_watermark_s=60.0, truth=str(truth_path), train_split=True),
        join=JoinSettings(impressions="clicks.impressions", feedback="clicks.feedback", window_s=5.0,
                          allowed_lateness_s=0.5, retain_s=120.0, negative_rate=negative_rate, instance_id="join",
                          app_id="clicks-join", session_timeout_s=6.0, commit_interval_ms=50))
    cluster = LocalCluster(spec, workdir=tmp_path / "cluster")
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        cluster.wait_for(lambda st: (st.get("join") or {}).get("joined", 0) > 500, timeout_s=120,
                         what="the joiner to label impressions")
        assert cluster.impressions_produced() is None, "the events ended before the kill: slow them down"
        cluster.kill_joiner()
        cluster.start_joiner()  # the same instance: it aborts what the killed one left open and restores its state
        st = cluster.wait_consumed(timeout_s=300)
        produced = cluster.impressions_produced()
        report = audit(cluster.bootstrap, spec.topic, cluster.redis_url, spec.job)
        records = committed_records(cluster.bootstrap, spec.topic)
    truth = Truth.read(truth_path)
    assert report.exact, report
    assert report.applied == report.expected == len(records) and report.rejected_updates == 0
    labels = truth.labels()
    assert len(truth) == produced == st["join"]["joined"] == 12_000  # the train split
    assert all(labels[k] == r["y"] for k, r in records.items())  # each as the truth says
    kept_negatives = [r for r in records.values() if r["y"] == 0]
    positives = sum(labels.values())
    assert len(records) - len(kept_negatives) == positives == st["join"]["positives"]
    if negative_rate == 1.0:
        assert set(records) == set(labels) and all("w" not in r for r in records.values())
    else:  # about half the negatives, each weighing 2: what they stand for is all of them
        negatives = len(labels) - positives
        assert 0.4 * negatives < len(kept_negatives) < 0.6 * negatives
        assert all(r["w"] == 2.0 for r in kept_negatives) and all("w" not in r for r in records.values() if r["y"])
        assert st["join"]["negatives_dropped"] == negatives - len(kept_negatives)
