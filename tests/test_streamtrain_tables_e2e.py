"""End to end with embedding tables, everything real: a click stream with categorical IDs through
Kafka, trainers running the built-in ranking model, tables split over two parameter servers that
are SIGKILLed mid-run and restarted, and the accounting audited record by record."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest

from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from services import connect
from streamtrain.accounting import audit
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.scoring import score_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SOURCE = "clicks?features=4&dense=3&vocab=20000&seed=3&limit=12000"
MODEL = "dlrm?features=4&dense=3&dim=8&admit=2&row_lr=0.05"


def test_a_ranking_model_trains_with_its_tables_in_the_parameter_plane_through_ps_kills(tmp_path) -> None:
    spec = ClusterSpec(job="clicks", topic="clicks", trainers=2,
                       coordinator=CoordinatorSettings(ps_groups=2, optimizer="adam", lr=0.005, codec="fp16",
                                                       table_consistency="asp", table_staleness=4),
                       trainer=replace(LOCAL_TRAINER, model=MODEL, eval_source=SOURCE, batch_size=128,
                                       eval_every=1000),
                       producer=replace(LOCAL_STREAM, source=SOURCE, shard_size=64))
    cluster = LocalCluster(spec, workdir=tmp_path / "cluster")
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        cluster.wait_for(lambda st: (st["versions"]["max"] or 0) >= 20, timeout_s=180,
                         what="training to be under way")
        # the coordinator shows the tables, and the trainers' heartbeats carry their row cache's hit rate
        st = cluster.wait_for(lambda st: st["tables"]["row_cache_hit_rate"] is not None
                              and all(t["rows"] > 0 and t["bytes"] > 0 for t in st["tables"]["per_table"]),
                              timeout_s=60, what="the tables and the row cache's hit rate on /v1/status")
        assert [t["name"] for t in st["tables"]["per_table"]] == ["c1", "c2", "c3", "c4"]
        assert 0 <= st["tables"]["row_cache_hit_rate"] <= 1
        cluster.restart("ps")  # both groups' servers SIGKILLed and started again
        cluster.wait_consumed(timeout_s=300)
        report = audit(cluster.bootstrap, spec.topic, cluster.redis_url, spec.job)
        assert report.exact, report
        assert report.applied == report.expected > 9000 and report.rejected_updates == 0
        client = connect(cluster.redis_url)
        try:
            rows = [client.hlen(JobKeys(spec.job).group(g).table_rows("c1")) for g in (0, 1)]
            stats = [client.hgetall(JobKeys(spec.job).group(g).table_stats) for g in (0, 1)]
        finally:
            client.close()
        assert all(r > 0 for r in rows)  # c1's rows are split over both groups
        # admission after two sightings: some gradients were dropped, and counted
        assert sum(int(s.get(b"c1:dropped", 0)) for s in stats) > 0
        assert sum(int(s.get(b"c1:admitted", 0)) for s in stats) == sum(rows)
        score = score_job(cluster.redis_url, spec.job, MODEL, SOURCE, limit=2000)
        assert score.auc is not None and score.auc > 0.6, score  # the hidden truth ranks at ~0.85
        assert np.isfinite(score.loss)
