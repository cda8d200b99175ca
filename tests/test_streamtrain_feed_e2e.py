"""The feed end to end, everything real: a ranking model with small, expiring, capped tables trains on
a click stream over two shard groups while a consumer replays ``GET /v1/model/updates`` into an empty
copy. Several times during training the parameter servers are frozen (SIGSTOP: no apply, no sweep),
the consumer catches up, and its copy must equal every group's rows hash in Redis, IDs and values
bit for bit, evictions and expiries included; then they run on (SIGCONT). Once more at the end."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from common.keys import JobKeys
from coordinator.feed_copy import FeedCopy, fetch_changes, lag_of
from coordinator.settings import CoordinatorSettings
from services import ServerSettings, connect
from services.store import ModelMeta
from services.tables.rows import row_dtype
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.launcher import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

SOURCE = "clicks?features=4&dense=3&vocab=20000&seed=5&limit=60000"
MODEL = "dlrm?features=4&dense=3&dim=8&max_rows=1200&expire_s=4&row_lr=0.05"
"""Tables capped at 1200 rows (600 per group) of a 20,000-ID vocabulary, rows unwritten for 4 s expire:
rows are evicted and expire all along."""


class Consumer:
    """Follows the feed over HTTP into a :class:`FeedCopy` on a thread of its own; :meth:`paused` holds
    it (the test then polls itself until nothing is new)."""

    def __init__(self, url: str, token: str, groups: int) -> None:
        self.url, self.token = url, token
        self.copy = FeedCopy(groups=groups)
        self.removed = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.applied_ms: list[np.ndarray] = []
        self.seen_ms: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.started_ms = time.time() * 1000
        self.thread = threading.Thread(target=self._run, name="feed-consumer", daemon=True)

    def poll(self, timed: bool = True) -> bool:
        """One read applied; True when it had entries. ``timed``: count the lag of its entries applied
        since the consumer started (not the catch-ups after a freeze: their entries waited for it)."""
        changes = fetch_changes(self.url, self.token, self.copy.position)
        now = time.time() * 1000
        self.copy.apply(changes)
        self.removed += sum(r.size for _, _, r in changes.tables.values())
        if timed:
            fresh = changes.applied_ms[changes.applied_ms >= self.started_ms]
            self.applied_ms.append(fresh)
            self.seen_ms.append(np.full(fresh.size, now))
        return changes.applied_ms.size > 0

    def _run(self) -> None:
        try:
            with self.lock:
                self.poll(timed=False)  # the coordinator's first answer imports the parameter plane: no lag
            self.started_ms = time.time() * 1000
            while not self.stop.is_set():
                with self.lock:
                    more = self.poll()
                if not more:
                    time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001  # surfaced by the test (self.error)
            self.error = exc

    def catch_up(self) -> None:
        """Poll until a read brings nothing new (the caller holds :attr:`lock`)."""
        while self.poll(timed=False):
            pass


def redis_rows(client, job: str, meta: ModelMeta) -> dict[str, dict[int, bytes]]:
    """Every row of every table, straight from every group's rows hash: table -> ID -> values' bytes."""
    out: dict[str, dict[int, bytes]] = {}
    for spec in meta.tables:
        rows = out.setdefault(spec.name, {})
        for g in range(meta.groups):
            for k, v in client.hgetall(JobKeys(job).group(g).table_rows(spec.name)).items():
                rows[int(np.frombuffer(k, "<i8")[0])] = np.frombuffer(v, dtype=row_dtype(spec))[0]["values"].tobytes()
    return out


def assert_same(consumer: Consumer, client, job: str, meta: ModelMeta) -> int:
    want = redis_rows(client, job, meta)
    rows = 0
    for name, table in want.items():
        got = consumer.copy.tables.get(name, {})
        assert sorted(got) == sorted(table), f"table {name}: {len(got)} rows in the copy, {len(table)} in Redis"
        bad = [i for i, v in table.items() if got[i].tobytes() != v]
        assert not bad, f"table {name}: {len(bad)} rows differ, e.g. {bad[:3]}"
        rows += len(table)
    return rows


def test_a_copy_following_the_feed_holds_exactly_the_rows_while_training_evicts_and_expires(tmp_path) -> None:
    spec = ClusterSpec(job="feed", topic="feed", trainers=1,
                       coordinator=CoordinatorSettings(ps_groups=2, optimizer="adam", lr=0.005, codec="fp16",
                                                       table_consistency="asp", table_staleness=4),
                       trainer=replace(LOCAL_TRAINER, model=MODEL, eval_source=SOURCE, batch_size=128,
                                       eval_every=100000),
                       ps=ServerSettings(table_sweep_every_s=0.2, table_sweep_count=500),
                       producer=replace(LOCAL_STREAM, source=SOURCE, shard_size=64))
    cluster = LocalCluster(spec, workdir=tmp_path / "cluster")
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        cluster.wait_for(lambda st: (st["versions"]["max"] or 0) >= 5, timeout_s=180, what="training to begin")
        client = connect(cluster.redis_url)
        stack.callback(client.close)
        meta = ModelMeta.from_json(client.get(JobKeys(spec.job).meta))
        consumer = Consumer(cluster.coordinator_url, cluster.job_token, meta.groups)
        consumer.thread.start()
        stack.callback(consumer.stop.set)

        def check(when: str) -> int:
            version = [int(client.get(JobKeys(spec.job).group(g).version) or 0) for g in range(meta.groups)]
            with consumer.lock:
                frozen = [p.pid for p in cluster.ps if p.pid is not None]
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    time.sleep(0.2)  # a write already sent lands (each is one atomic script)
                    consumer.catch_up()
                    rows = assert_same(consumer, client, spec.job, meta)
                finally:
                    for pid in frozen:
                        os.kill(pid, signal.SIGCONT)
            assert consumer.error is None, consumer.error
            print(f"{when}: the copy holds the {rows} rows of Redis at feed position {consumer.copy.position}, "
                  f"versions {version}")
            return rows

        training = 0
        for _ in range(3):  # every 30 versions or so of the groups, while training goes on
            target = max(int(client.get(JobKeys(spec.job).group(g).version) or 0) for g in range(meta.groups)) + 30
            st = cluster.wait_for(lambda st, t=target: (st["versions"]["max"] or 0) >= t or cluster.consumed(st),
                                  timeout_s=240, what=f"version {target}")
            training += not cluster.consumed(st)
            check(f"at version {target}")
        assert training >= 2  # most checks ran while training went on
        cluster.wait_consumed(timeout_s=300)
        check("at the end")
        # nothing is written any more: every row expires (4 s) and the sweeps remove it
        wait_until(lambda: sum(client.hlen(JobKeys(spec.job).group(g).table_rows(t.name)) for g in range(meta.groups)
                               for t in meta.tables) == 0, 60, what="every row to expire")
        assert check("after every row expired") == 0
        consumer.stop.set()
        consumer.thread.join(timeout=30)
        assert consumer.error is None, consumer.error
        stats = [client.hgetall(JobKeys(spec.job).group(g).table_stats) for g in range(meta.groups)]
    evicted = sum(int(v) for s in stats for k, v in s.items() if k.endswith(b":evicted"))
    expired = sum(int(v) for s in stats for k, v in s.items() if k.endswith(b":expired"))
    # rows were evicted and expired during the run, and the copy got their tombstones
    assert evicted > 0 and expired > 0 and consumer.removed > 0, (evicted, expired, consumer.removed)
    lag = lag_of(np.concatenate(consumer.seen_ms), np.concatenate(consumer.applied_ms))
    print(f"feed lag over {lag.entries} entries (polling every 50 ms): p50 {lag.p50_ms:.0f} ms, "
          f"p99 {lag.p99_ms:.0f} ms, max {lag.max_ms:.0f} ms; evicted {evicted}, expired {expired}")
