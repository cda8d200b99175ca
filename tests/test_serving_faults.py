"""A serving replica through faults, on real services: the coordinator SIGKILLed (the replica serves its
last version, turns unready past --max-staleness-s, and catches up once it returns), Redis killed (it
keeps answering), the replica itself SIGKILLed, and the feed moving past a paused replica (it loads
the tables anew). After each, once the job quiesces, the replica equals the parameter plane. And a
load from a table scan that returned a row twice (HSCAN may) does not stop the replica."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis as redis_lib
from serving_util import (
    assert_replica_equals_plane,
    call,
    call_json,
    infer_body,
    outputs_of,
    replica_status,
    wait_caught_up,
    wait_ready,
)

from coordinator.settings import CoordinatorSettings
from datastream import load_source
from services import ServerSettings, connect
from services.slot_types import VersionVector
from services.snapshot.table_cut import Piece
from services.tables.feed import feed_heads, feed_oldest
from services.tables.rows import pull_dtype
from serving import loader
from serving.settings import ServeSettings
from serving.state import ModuleFactory
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.launcher import wait_until
from trainers import build_model

JOB = "clicks"
SOURCE = "clicks?features=4&dense=3&vocab=5000&seed=5&limit=200000"
RATE = 800.0
"""Records per second the producer writes (some 6 steps a second): the job trains all through a test,
which quiesces it mid-stream."""
MODEL = "dlrm?features=4&dense=3&dim=8&admit=1&row_lr=0.05&max_rows=300"
"""Each table keeps about 300 rows: the sweeps evict (and the feed carries tombstones) while it trains."""


def spec_of(**kw: Any) -> ClusterSpec:
    """A small job: one trainer, two shard groups, one replica."""
    return replace(ClusterSpec(job=JOB, topic=JOB, trainers=1, replicas=1,
                               coordinator=CoordinatorSettings(ps_groups=2, optimizer="adam", lr=0.005, codec="none",
                                                               table_consistency="asp", table_staleness=4),
                               trainer=replace(LOCAL_TRAINER, model=MODEL, eval_source="", batch_size=128),
                               producer=replace(LOCAL_STREAM, source=SOURCE, shard_size=64, rate=RATE)), **kw)


@contextlib.contextmanager
def running(spec: ClusterSpec, workdir: Path) -> Iterator[tuple[LocalCluster, redis_lib.Redis]]:
    """The cluster started, training under way and its replica ready; stopped on exit."""
    cluster = LocalCluster(spec, workdir=workdir)
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        cluster.wait_for(lambda st: (st["versions"]["max"] or 0) >= 5, timeout_s=240,
                         what="training to be under way")
        wait_ready(cluster)
        client = connect(cluster.redis_url)
        stack.callback(client.close)
        yield cluster, client


@functools.cache
def request_body() -> dict[str, Any]:
    """An infer request of 20 held-out records."""
    held = load_source(SOURCE, split="test").read(limit=20)
    return infer_body(np.ascontiguousarray(held.x, dtype=np.float32), held.ids)


def infer(cluster: LocalCluster) -> dict[str, Any]:
    """The replica's answer to :func:`request_body` (asserting 200 and 20 finite scores)."""
    code, answer = call_json(cluster.replica_url(), f"/v2/models/{JOB}/infer", token=cluster.job_token,
                             body=request_body())
    assert code == 200, answer
    probability = outputs_of(answer)["probability"]
    assert probability.shape == (20,) and np.isfinite(probability).all()
    return answer


def ready_now(cluster: LocalCluster) -> tuple[int, dict[str, Any]]:
    """``GET /v2/health/ready``: its status and body."""
    return call_json(cluster.replica_url(), "/v2/health/ready")


def versions_max(cluster: LocalCluster) -> int:
    """The newest group version on the coordinator's status (0 while it does not answer)."""
    st = cluster.status()
    return 0 if st is None else int(st["versions"]["max"] or 0)


def settle(cluster: LocalCluster, client: redis_lib.Redis) -> dict[str, int]:
    """Quiesce the job, wait for the replica to reach the feed's heads, and check it equals the plane."""
    cluster.quiesce()
    wait_caught_up(cluster, client)
    rows = assert_replica_equals_plane(cluster, client)
    assert sum(rows.values()) > 0, rows
    return rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_coordinator_down_the_replica_serves_its_last_version_then_turns_unready_then_catches_up(
        tmp_path) -> None:
    spec = spec_of(serve=ServeSettings(max_staleness_s=3.0))
    with running(spec, tmp_path / "cluster") as (cluster, client):
        assert cluster.coordinator is not None
        cluster.coordinator.kill()
        cluster.coordinator.stop()
        time.sleep(0.5)  # a feed answer read before the kill is applied by now
        served = infer(cluster)["model_version"]
        samples: list[tuple[int, dict[str, Any]]] = []

        def unready() -> bool:
            code, body = ready_now(cluster)
            samples.append((code, body))
            assert infer(cluster)["model_version"] == served  # answers on, from the last version
            return code == 503
        wait_until(unready, 60, interval_s=0.2, what="the replica to turn unready past --max-staleness-s")
        for code, body in samples:  # ready while the staleness is within the bound, not after
            assert body["max_staleness_s"] == 3.0
            assert body["model_version"] == served
            if body["staleness_s"] < 3.0 - 0.01:
                assert code == 200 and body["ready"], body
            if body["staleness_s"] > 3.0 + 0.01:
                assert code == 503 and not body["ready"], body
        staleness = [body["staleness_s"] for _, body in samples]
        assert staleness == sorted(staleness) and staleness[-1] > 3.0, staleness  # grows
        status = replica_status(cluster)
        assert not status["ready"] and status["staleness_s"] >= staleness[-1] and status["error"], status
        assert status["model_version"] == served and status["reloads"] == 0
        # the model routes still answer; the model's own readiness says unready too
        assert call(cluster.replica_url(), f"/v2/models/{JOB}/ready")[0] == 503
        infer(cluster)

        cluster.start_coordinator()
        wait_ready(cluster)
        before = versions_max(cluster)
        code, body = ready_now(cluster)
        assert code == 200 and body["staleness_s"] < 3.0, body
        # training goes on, and the replica follows it
        wait_until(lambda: versions_max(cluster) > before + 5, 240, what="training to go on")
        wait_until(lambda: infer(cluster)["model_version"] != served, 120, what="the replica to serve a newer version")
        settle(cluster, client)
        status = replica_status(cluster)
        assert status["ready"] and status["reloads"] == 0, status


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_redis_down_the_replica_keeps_answering_and_follows_again(tmp_path) -> None:
    with running(spec_of(), tmp_path / "cluster") as (cluster, client):
        client.close()  # its server is about to go
        assert cluster.redis is not None
        # killed here and restarted by cluster.restart from this thread: a server dies with the thread that
        # spawned it (its parent-death signal), so no helper thread may start it
        cluster.redis.kill()
        errors: list[str] = []
        answers: list[str] = []
        down_until = time.monotonic() + 8.0
        while time.monotonic() < down_until:
            answers.append(infer(cluster)["model_version"])
            status = replica_status(cluster)
            if status["error"]:
                errors.append(status["error"])
            time.sleep(0.2)
        cluster.restart("redis")  # on its port and folder: it reloads its AOF
        assert len(answers) > 5 and errors, (answers, errors)  # answered all through, and saw the outage
        client = connect(cluster.redis_url)
        try:
            wait_ready(cluster)
            before = versions_max(cluster)
            wait_until(lambda: versions_max(cluster) > before + 5, 240, what="training to go on after Redis returned")
            settle(cluster, client)
            status = replica_status(cluster)
            assert status["ready"] and not status["error"], status
        finally:
            client.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replica_killed_comes_back_ready_and_equal_to_the_plane(tmp_path) -> None:
    with running(spec_of(), tmp_path / "cluster") as (cluster, client):
        first = infer(cluster)["model_version"]
        old = cluster.replicas[0][0].pid
        cluster.restart_replica()  # SIGKILL, and start it again on its port
        assert cluster.replicas[0][0].pid != old
        wait_ready(cluster)
        status = replica_status(cluster)
        assert status["reloads"] == 0 and status["rows"] > 0, status
        now = VersionVector.parse(infer(cluster)["model_version"], 2)
        assert all(a >= b for a, b in zip(now, VersionVector.parse(first, 2))), (now, first)
        settle(cluster, client)
        code, metrics = call(cluster.replica_url(), "/metrics")
        assert code == 200
        assert re.search(rb'^streamtrain_serve_reloads_total\{reason="start"\} 1\.0$', metrics, re.M), metrics


def feed_gone_reloads(cluster: LocalCluster) -> float:
    """``streamtrain_serve_reloads_total{reason="feed_gone"}`` on the replica's ``GET /metrics`` (0: none yet)."""
    code, metrics = call(cluster.replica_url(), "/metrics")
    assert code == 200
    found = re.search(rb'^streamtrain_serve_reloads_total\{reason="feed_gone"\} ([0-9.]+)$', metrics, re.M)
    return 0.0 if found is None else float(found.group(1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replica_the_feed_moved_past_loads_the_tables_anew_and_equals_the_plane(tmp_path) -> None:
    spec = spec_of(ps=ServerSettings(feed_entries=5))  # about 5: Redis trims whole stream nodes (MAXLEN ~)
    with running(spec, tmp_path / "cluster") as (cluster, client):
        # a replica that starts while the job trains may fall off so short a feed already: count from here
        reloads, counted = replica_status(cluster)["reloads"], feed_gone_reloads(cluster)
        assert reloads == counted
        pid = cluster.replicas[0][0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            paused_at = feed_heads(client, JOB, 2)  # the replica's position is at most this
            wait_until(lambda: all(o > h for o, h in zip(feed_oldest(client, JOB, 2), paused_at)), 300,
                       what="the feed to move past the paused replica's position")
        finally:
            os.kill(pid, signal.SIGCONT)

        def past() -> bool:  # only a new load gets it beyond the position the feed dropped
            at = VersionVector.parse(replica_status(cluster)["feed_position"], 2, kind="position")
            return all(a > h for a, h in zip(at, paused_at))
        wait_until(past, 120, what="the replica to serve again beyond where the feed moved past it")
        assert replica_status(cluster)["reloads"] > reloads
        assert feed_gone_reloads(cluster) > counted
        wait_ready(cluster)
        infer(cluster)
        settle(cluster, client)
        status = replica_status(cluster)
        assert status["ready"] and status["reloads"] == feed_gone_reloads(cluster), status


@pytest.mark.timeout(60)
def test_a_table_scan_that_returns_a_row_twice_still_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """HSCAN may return an entry twice (the hash resized between steps while rows come and go): the
    load keeps the later read, not failing on the repeated ID (a regression: it stopped the replica)."""
    model = build_model(MODEL)
    tables = tuple(model.tables)
    spec = tables[0]
    dtype = pull_dtype(spec)

    def piece(ids: list[int], versions: list[int], base: float) -> Piece:
        records = np.zeros(len(ids), dtype)
        records["version"] = versions
        records["values"] = base + np.arange(len(ids), dtype=np.float32)[:, None]
        return Piece(np.asarray(ids, np.int64), records.view(np.uint8).reshape(len(ids), dtype.itemsize), 1)

    def pieces(client: object, job: str, group: int, table: object, rows: int) -> Iterator[Piece]:
        if table is spec:
            yield piece([7, 3, 7, 9], [1, 1, 2, 1], 0.0)  # ID 7 read twice, the second time newer
            yield piece([3, 11], [1, 1], 10.0)  # and 3 again, in the next piece

    monkeypatch.setattr(loader, "live_pieces", pieces)
    meta = SimpleNamespace(tables=tables, groups=1)
    dense = model.model.state_dict()
    state = loader.state_from_redis(
        None, JOB, meta, dense, "1", ModuleFactory(model),  # type: ignore[arg-type]  # live_pieces is ours: no client
        position="0")
    ids, values, versions = state.tables[spec.name].items()
    assert ids.tolist() == [3, 7, 9, 11]
    assert values[:, 0].tolist() == [10.0, 2.0, 3.0, 11.0] and versions.tolist() == [1, 2, 1, 1]
