"""Progressive validation end to end, everything real: a learnable click stream through Kafka, two
trainers running the built-in ranking model, each scoring every window of records on its training
logits before training on them, and the coordinator's ``/v1/history`` carrying the series."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from coordinator.progressive import mean_auc
from coordinator.settings import CoordinatorSettings
from datastream.sources import TEST_EVERY
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.launcher.process import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RECORDS = 16000
TRAINED = RECORDS - RECORDS // TEST_EVERY
"""The producer streams the train split; every fifth record is held out."""
EVERY = 1000
RATE = 1000.0
"""Records/s produced: the last records arrive at least TRAINED / RATE = 12.8 s after the first, so each
trainer's windows (one every two seconds or so) reach the coordinator over several of its samples,
however fast the trainers are."""
SOURCE = f"clicks?features=4&dense=3&vocab=2000&seed=5&limit={RECORDS}"
MODEL = "dlrm?features=4&dense=3&dim=8&row_lr=0.05"


def test_trainers_score_the_next_records_before_training_on_them_and_the_history_shows_it(tmp_path) -> None:
    spec = ClusterSpec(job="online", topic="online", trainers=2,
                       coordinator=CoordinatorSettings(optimizer="adam", lr=0.005, codec="fp16"),
                       trainer=replace(LOCAL_TRAINER, model=MODEL, eval_source="", batch_size=128,
                                       progressive_every=EVERY),
                       producer=replace(LOCAL_STREAM, source=SOURCE, shard_size=64, rate=RATE))
    cluster = LocalCluster(spec, workdir=tmp_path / "cluster")
    found: dict = {}

    def scored_all() -> bool:  # each trainer leaves less than a window unscored at the end
        series = cluster.progressive()
        cluster.raise_if_crashed()
        if series is None or not series["job"]["records"] or series["job"]["records"][-1] < TRAINED - 2 * EVERY:
            return False
        found.update(series)
        return True

    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        cluster.wait_consumed(timeout_s=300)
        wait_until(scored_all, 60, interval_s=0.5, what="the trainers' last windows in /v1/history")
    job, members = found["job"], found["members"]
    assert job["records"] == sorted(job["records"]) and len(set(job["records"])) == len(job["records"])
    assert sum(job["n"]) == job["records"][-1]  # the job's x axis: every window scored, summed
    assert len(members) >= 2  # a series per trainer (per member id: one that lost its lease has two)
    for series in members.values():
        assert len(series["records"]) >= 2
        assert all(b > a for a, b in zip(series["records"], series["records"][1:], strict=False))
        assert all(n % EVERY == 0 for n in series["n"])  # whole windows only
        assert all(a is None or 0.0 <= a <= 1.0 for a in series["auc"])
        assert all(loss >= 0 for loss in series["log_loss"])
    assert all(a is not None and 0.0 <= a <= 1.0 for a in job["auc"])  # windows of 1000 hold both classes
    later = mean_auc(job, 0.5, 1.0)
    assert later is not None and later > 0.6, (later, job)  # the stream's hidden truth is learnable
