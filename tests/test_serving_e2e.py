"""A serving replica end to end, everything real: a click stream through Kafka, a ranking model whose
tables expire and evict rows while it trains, over two parameter servers SIGKILLed mid-run, and a
replica that follows the feed. Once the job quiesces, the replica equals the parameter plane bit for
bit (rows, tombstones, dense tensors), and its scores are the scores computed from Redis."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest
import redis as redis_lib
import torch
from serving_util import (
    assert_held_rows_are_the_plane_s,
    assert_replica_equals_plane,
    call_json,
    infer_body,
    outputs_of,
    replica_status,
    wait_caught_up,
    wait_ready,
)

from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from datastream import load_source
from datastream.jagged import Jagged
from services import ParameterStore, ServerSettings, connect
from services.tables.store import pull_rows
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.launcher import wait_until
from trainers import build_model
from trainers.tables import table_inputs

pytestmark = [pytest.mark.slow]

JOB = "clicks"
SOURCE = "clicks?features=4&dense=3&vocab=5000&seed=3&limit=20000"
MODEL = "dlrm?features=4&dense=3&dim=8&admit=1&row_lr=0.05&expire_s=12&max_rows=300"
"""Rows unused for 12 s expire and each table keeps about 300: the sweeps remove rows all through training
(the quiesce must take less than 12 s, or every row has expired before the comparison)."""
BOUNDED = 40
"""Rows per table of the second, bounded replica (--max-rows): fewer than the tables hold."""
HELD_OUT = 400
"""Held-out records scored; the producer writes 1000 records a second, so the job still trains when it quiesces."""


def plane_scores(client: redis_lib.Redis, job: str, model: str, x: np.ndarray, ids: Mapping[str, Jagged]
                 ) -> tuple[np.ndarray, int, int]:
    """The logits of the records from what Redis holds now, the way ``streamtrain.scoring`` computes
    them (one consistent dense snapshot, each row as its group last wrote it); and how many of the
    rows looked up Redis holds, of how many."""
    spec = build_model(model)
    store = ParameterStore(client, job)
    spec.model.load_state_dict(store.pull().tensors)
    spec.model.eval()
    tables, groups = {t.name: t for t in spec.tables}, store.meta().groups

    counts = [0, 0]

    def pull(wanted: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        got = pull_rows(client, job, tables, groups, wanted)
        counts[0] += sum(int(rows.present.sum()) for rows in got.tables.values())
        counts[1] += sum(int(rows.ids.size) for rows in got.tables.values())
        return {name: rows.values for name, rows in got.tables.items()}

    inputs = table_inputs(tables, ids, pull, torch.device("cpu"))
    with torch.no_grad():
        logits = spec.model(torch.from_numpy(x).float(), *inputs(0, len(x))).reshape(-1).numpy()
    return logits, counts[0], counts[1]


def removed_rows(client: redis_lib.Redis, job: str, groups: int) -> int:
    """Rows the table sweeps expired or evicted so far, every table and group."""
    total = 0
    for g in range(groups):
        for k, v in client.hgetall(JobKeys(job).group(g).table_stats).items():
            if k.endswith((b":expired", b":evicted")):
                total += int(v)
    return total


@pytest.mark.timeout(600)
def test_a_replica_equals_the_parameter_plane_through_ps_kills_expiry_and_eviction(tmp_path) -> None:
    spec = ClusterSpec(job=JOB, topic=JOB, trainers=1, replicas=1,
                       coordinator=CoordinatorSettings(ps_groups=2, optimizer="adam", lr=0.005, codec="none",
                                                       table_consistency="asp", table_staleness=4),
                       trainer=replace(LOCAL_TRAINER, model=MODEL, eval_source="", batch_size=128),
                       ps=ServerSettings(feed_entries=1_000_000),  # the replica never falls off the feed
                       producer=replace(LOCAL_STREAM, source=SOURCE, shard_size=64, rate=1000.0))
    cluster = LocalCluster(spec, workdir=tmp_path / "cluster")
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        client = connect(cluster.redis_url)
        stack.callback(client.close)
        cluster.wait_for(lambda st: (st["versions"]["max"] or 0) >= 10, timeout_s=240,
                         what="training to be under way")
        wait_ready(cluster)
        assert replica_status(cluster)["reloads"] == 0
        cluster.add_replica(flags=("--max-rows", str(BOUNDED)))  # a replica smaller than the tables
        wait_ready(cluster, 1)
        cluster.restart("ps")  # both groups' servers SIGKILLed and started again
        cluster.wait_for(lambda st: (st["versions"]["max"] or 0) >= 30, timeout_s=240,
                         what="training to go on after the servers' restart")
        wait_until(lambda: removed_rows(client, JOB, 2) > 0, 120, what="the sweeps to expire or evict rows")
        cluster.quiesce()  # mid-stream: the rows written last are fresh
        # the servers stop too, so no sweep moves the plane any more (rows written last have not expired)
        for ps in cluster.ps:
            ps.stop()
        assert removed_rows(client, JOB, 2) > 0
        wait_caught_up(cluster, client)
        rows = assert_replica_equals_plane(cluster, client)
        assert sum(rows.values()) > 0, rows
        status = replica_status(cluster)
        assert status["ready"] and status["reloads"] == 0, status
        assert status["rows"] == sum(rows.values())

        # the replica's scores of held-out records are those computed from Redis
        held = load_source(SOURCE, split="test").read(limit=HELD_OUT)
        x = np.ascontiguousarray(held.x, dtype=np.float32)
        want, stored, looked_up = plane_scores(client, JOB, MODEL, x, held.ids)
        code, answer = call_json(cluster.replica_url(), f"/v2/models/{JOB}/infer", token=cluster.job_token,
                                 body=infer_body(x, held.ids))
        assert code == 200, answer
        assert answer["model_name"] == JOB and answer["model_version"] == status["model_version"]
        got = outputs_of(answer)
        assert got["logit"].shape == (len(x),)
        np.testing.assert_allclose(got["logit"], want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got["probability"], 1 / (1 + np.exp(-want.astype(np.float64))), rtol=0, atol=1e-6)
        # some of the records' IDs have rows (trained), others none (their initial values): both were scored
        assert 0 < stored < looked_up, (stored, looked_up)
        # /v1/predict, with the training topic's JSON records, answers the same
        records = [{"x": x[i].tolist(), "ids": {f: col.values[col.offsets[i]:col.offsets[i + 1]].tolist()
                                                for f, col in held.ids.items()}} for i in range(50)]
        code, predicted = call_json(cluster.replica_url(), "/v1/predict", token=cluster.job_token,
                                    body={"records": records})
        assert code == 200, predicted
        assert predicted["model_version"] == status["model_version"] and predicted["misses"] == 0
        np.testing.assert_allclose([p["logit"] for p in predicted["predictions"]], want[:50], rtol=0, atol=1e-6)

        # the bounded replica: the rows it lacks are read from Redis (one round trip a request) and counted,
        # its scores are the same, and it never holds a row the plane lacks
        wait_caught_up(cluster, client, 1)
        code, bounded = call_json(cluster.replica_url(1), f"/v2/models/{JOB}/infer", token=cluster.job_token,
                                  body=infer_body(x, held.ids))
        assert code == 200, bounded
        assert bounded["parameters"]["misses"] > 0, bounded["parameters"]
        np.testing.assert_allclose(outputs_of(bounded)["logit"], want, rtol=0, atol=1e-6)
        small = replica_status(cluster, 1)
        assert small["misses"] >= bounded["parameters"]["misses"]
        assert all(t["rows"] <= BOUNDED and t["max_rows"] == BOUNDED for t in small["tables"].values()), small
        assert sum(assert_held_rows_are_the_plane_s(cluster, client, 1).values()) > 0

        # the servers run again: every row expires, and the replica follows every tombstone
        cluster.start_ps()
        wait_until(lambda: all(client.hlen(JobKeys(JOB).group(g).table_rows(f"c{i}")) == 0
                               for g in (0, 1) for i in range(1, 5)), 120, what="every row to expire")
        wait_caught_up(cluster, client)
        assert assert_replica_equals_plane(cluster, client) == {f"c{i}": 0 for i in range(1, 5)}
        assert replica_status(cluster)["rows"] == 0
