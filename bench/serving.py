"""Serving replica of the MovieLens example: latency under a load generator that is not ours, throughput
against the same forward pass in process, freshness of served predictions, served AUC and memory, in one run.

The job: ``up --example movielens``'s settings (``streamtrain.examples``: ``dlrm?schema=movielens``, tables
ASP with a row cache of 4, dense part by Adam sent whole), two trainers (one thread each), one parameter
server, one serving replica (``streamtrain serve``, its defaults: one torch thread, the feed read every
50 ms once caught up), everything real (Kafka, Redis, the coordinator) on loopback. The bench is the
producer.

1. **Capacity**: the first ``--capacity-records`` records of the train split (in time order) produced at
   once; records/s the server applied, first to last applied update (as ``bench/pipeline.py``).
2. **Stream at half capacity, scored**: the rest of the train split (then its passes again, if the run
   outlasts one), paced at half that rate, in shards of 64, for ``WARMUP_S`` + ``--fresh-s`` seconds
   (while 3 runs). Before a shard is produced, its records are scored by
   the replica with their labels (``POST /v1/predict``; every ``--score-every``-th record, by default
   every record or every n-th so that the replica keeps them all): the served AUC, *scored before
   trained*. When the producer has that itself (``produce(score_url=...)``, read at run time), it does it
   (skipping records when scoring would take over a tenth of its time: counted), and the replica's
   ``served_auc`` is the figure; ``--score-by bench`` scores here instead, which also gives the served AUC
   pooled in windows as the progressive one is. The trainers' progressive AUC (each trainer scores every
   record before training on it, in windows of 2,000; the job's figure is the records-weighted mean of
   the windows' AUCs) over the same records (those of this part of the stream) is read from the
   coordinator (``/v1/history``, ``coordinator.progressive.mean_auc``). Scoring stops with this part, so
   that the latency runs (4) measure requests beside training, not beside the scoring as well.
3. **Freshness** (``--fresh-s`` seconds of 2, from ``WARMUP_S`` into it): a probe record every
   ``--probe-every-s`` whose ``user`` and ``item`` IDs are new (never seen), produced through Kafka into
   the training topic among the stream. A poller asks the replica for the probes' predictions every
   ``POLL_S`` and keeps the version each answer names; Redis says at which version of its group the
   update that trained on a probe wrote its rows (a new ID's row is written once, by that update: its
   row version). A probe's freshness is from its produce time to the first answer whose version holds
   that update (rows and dense part: the feed sends both as of one version). The score itself cannot be
   the signal: the dense part changes with every update of the stream, so a probe's score moves long
   before its own update is served. The accounting record of the probe's update (``applied_samples``)
   splits it into produce -> applied in Redis, and applied -> served.
4. **Latency, training running**: the stream goes on at the same rate, unscored; ``wrk`` (Debian's,
   ``-t1``) POSTs one held-out record a
   request to ``/v1/predict`` at each of ``RATES`` req/s for ``--wrk-s`` seconds (connections with random
   waits hold the rate: Debian's wrk has no ``-R``; ``bench/serving_post.lua``); p50/p99 as wrk measures
   them. The highest rate that held (90 % of it achieved: a slow replica lowers the rate of connections
   that wait after each answer, rather than queueing) with p99 under 10 ms is reported.
5. **Latency, training stopped**: the trainers leave (the replica keeps serving the last state); the
   same sweep.
6. **Throughput**: ``wrk`` without waits (``THROUGHPUT_CONNECTIONS`` connections), 256 held-out records a
   request, on ``/v1/predict`` and on ``/v2/models/<job>/infer`` (Open Inference Protocol JSON): records/s.
   The peer: the same module's forward in this process (one torch thread, as the replica) on the same
   256-record batches: the replica's state (``GET /v1/replica/state``) loaded into the model built by
   ``trainers.models.build_model``, rows gathered by ID, ``plan_lookups`` + ``pool`` + forward, timed
   (its logits of one batch are checked against the replica's answer). The replica's parse of a request
   body and its answer's encoding are timed in process too, to say where a request's time goes.
7. **Memory**: the replica's bytes per row over its raw bytes (``GET /v1/replica``'s
   ``bytes_per_raw_row``: 8 bytes of ID and dim x 4 of values).

Every phase shares the machine's cores with the others of the run (and with whatever else runs there: the
load average is printed). Writes ``bench/results/serving.json``; prints the figures, their targets beside
them, the ratio last. About 3.5 minutes (``--quick``: under 2).

    .venv/bin/python bench/serving.py [--quick] [--fresh-s 25] [--wrk-s 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from safetensors.numpy import load as load_safetensors

from bench import harness
from coordinator.progressive import mean_auc
from coordinator.settings import CoordinatorSettings
from datastream import Examples, encode_shard, load_source, produce, reliable_producer
from datastream.records import hash_id
from datastream.settings import ProduceSettings
from datastream.sources import Source
from services import connect
from services.protocol import AccountingRecord
from services.slots import read_meta
from services.tables import initial_rows
from services.tables.rows import group_of_ids
from services.tables.store import pull_rows
from serving.protocol import parse_infer, parse_records
from serving.report import MOST_LABELLED
from serving.settings import ServeSettings
from serving.state import signature_of
from streamtrain.cluster import LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.examples import EXAMPLES
from trainers.models import build_model
from trainers.progressive import ClosedWindow, score_window
from trainers.tables import plan_lookups, pool

console = Console(width=120)

EXAMPLE = EXAMPLES["movielens"]
SOURCE = str(EXAMPLE["source"])
MODEL = str(EXAMPLE["model"])
JOB = "movielens"
BATCH = LOCAL_TRAINER.batch_size
"""Records a shard (the trainers' batch, 64)."""
PARTITIONS = 4
TRAINERS = 2
LUA = Path(__file__).resolve().parent / "serving_post.lua"
RATES = (250, 500, 750, 1000, 2000)
"""Requests/s of one record tried, lowest first."""
WAIT_MS = 20.0
"""Mean wait of a wrk connection between requests at a held rate: connections = rate x this."""
BIG = 256
"""Records a request of the throughput runs."""
THROUGHPUT_CONNECTIONS = 4
POLL_S = 0.01
"""How often the poller asks the replica for the probes' predictions (the resolution of freshness)."""
ROWS_EVERY_S = 0.05
"""How often it asks Redis at which version the probes' rows were written."""
WARMUP_S = 3.0
"""Seconds the stream runs before the first probe (past its start: the replica's first served AUC, the
trainers' first pulls at the new rate), as ``bench/pipeline.py`` measures freshness past the start-up."""
PROBE_TIMEOUT_S = 15.0
"""A probe not served within this long counts as this long (and as missed)."""
PROGRESSIVE_WINDOW = 2000
"""Records a trainer's progressive window holds (the trainers' default)."""

TARGET_P99_MS = 10.0
TARGET_RATE = 1000
TARGET_RATIO = 0.5
TARGET_FRESH_S = 1.0
GOAL_FRESH_S = 0.25
TARGET_AUC_GAP = 0.005
TARGET_BYTES = 1.5


# -- the job --------------------------------------------------------------------------------------

def job_spec() -> ClusterSpec:
    """The example's job: two trainers, one replica, no producer (the bench produces)."""
    return ClusterSpec(
        job=JOB, topic=JOB, trainers=TRAINERS, producer=None,
        coordinator=CoordinatorSettings(partitions=PARTITIONS, optimizer=str(EXAMPLE["optimizer"]),
                                        lr=float(EXAMPLE["lr"]), codec=str(EXAMPLE["codec"]),
                                        table_consistency=str(EXAMPLE["table_consistency"]),
                                        table_staleness=int(EXAMPLE["table_staleness"])),
        trainer=replace(LOCAL_TRAINER, model=MODEL, threads=1, eval_source="", prefetch=8),
        replicas=1, serve=ServeSettings())


class Http:
    """One keep-alive connection to the replica, with its bearer token."""

    def __init__(self, base: str, token: str, timeout_s: float = 30.0) -> None:
        parts = urlsplit(base)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.timeout_s = timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                self.conn.request(method, path, body=body, headers=self.headers)
                resp = self.conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def json(self, method: str, path: str, obj: Any = None) -> Any:
        status, data = self.call(method, path, None if obj is None else json.dumps(obj).encode())
        if status != 200:
            raise RuntimeError(f"{method} {path}: {status} {data[:300]!r}")
        return json.loads(data)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def records_json(ex: Examples, rows: Sequence[int], *, labels: bool) -> list[dict[str, Any]]:
    """Records ``rows`` of ``ex`` in the training topic's JSON record format (with ``y`` if ``labels``)."""
    out = []
    for i in rows:
        rec: dict[str, Any] = {"ids": {f: col.values[col.offsets[i]:col.offsets[i + 1]].tolist()
                                       for f, col in ex.ids.items()}}
        if ex.x.shape[1]:
            rec["x"] = ex.x[i].tolist()
        if labels:
            rec["y"] = int(ex.y[i])
        out.append(rec)
    return out


def infer_json(ex: Examples) -> dict[str, Any]:
    """``ex`` as an Open Inference Protocol JSON request: per feature its IDs and lengths (and ``x``)."""
    inputs: list[dict[str, Any]] = []
    n = len(ex)
    if ex.x.shape[1]:
        inputs.append({"name": "x", "datatype": "FP32", "shape": [n, ex.x.shape[1]], "data": ex.x.ravel().tolist()})
    for f, col in ex.ids.items():
        lengths = np.diff(col.offsets)
        inputs.append({"name": f, "datatype": "INT64", "shape": [int(lengths.sum())],
                       "data": col.values[col.offsets[0]:col.offsets[-1]].tolist()})
        inputs.append({"name": f + ".lengths", "datatype": "INT64", "shape": [n], "data": lengths.tolist()})
    return {"inputs": inputs}


def replica_status(cluster: LocalCluster) -> dict[str, Any]:
    http_ = Http(cluster.replica_url(0), cluster.job_token)
    try:
        return cast("dict[str, Any]", http_.json("GET", "/v1/replica"))
    finally:
        http_.close()


def wait_replica_ready(cluster: LocalCluster, timeout_s: float = 180.0) -> None:
    http_ = Http(cluster.replica_url(0), cluster.job_token, timeout_s=5.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                if http_.call("GET", "/v2/health/ready")[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            cluster.raise_if_crashed()
            time.sleep(0.25)
    finally:
        http_.close()
    raise TimeoutError(f"the replica was not ready within {timeout_s:.0f} s")


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- 1. capacity ----------------------------------------------------------------------------------

def capacity(cluster: LocalCluster, train: Examples, records: int) -> dict[str, Any]:
    """Records/s the two trainers get applied on ``records`` records produced at once."""
    cluster.wait_for(lambda st: len(st.get("members", [])) >= TRAINERS
                     and all(p["owner"] is not None for p in st.get("partitions", [])),
                     timeout_s=180, what="the trainers to own the partitions")
    part = train.slice(0, records)
    report = produce(cluster.bootstrap, JOB, Source("movielens-head", lambda: iter([(0, part)])),
                     partitions=PARTITIONS, shard_size=BATCH, producer_id="bench-capacity")
    cluster.wait_for(cluster.all_committed, timeout_s=600, what="the capacity records to be committed")
    cluster.wait_applied(120)
    entries = harness.applied_entries(cluster)
    span = (entries[-1].applied_ms - entries[0].applied_ms) / 1000
    done = sum(e.batch_size for e in entries)
    assert done == report.records, f"applied {done} of {report.records} records"
    return {"records": done, "span_s": span, "records_per_s": done / span}


# -- 2. the stream, scored before it is produced ---------------------------------------------------

def producer_scores() -> bool:
    """The producer scores records on a replica itself (``ProduceSettings.score_url``, ``produce(score_url=)``)."""
    wanted = {"score_url", "score_token", "score_every"}
    fields = {f.name for f in dataclasses.fields(ProduceSettings)}
    return wanted <= fields and wanted <= set(inspect.signature(produce).parameters)


@dataclass
class Served:
    """Labels and logits of the records the replica scored before they were produced."""

    labels: list[int] = field(default_factory=list)
    logits: list[float] = field(default_factory=list)
    requests: int = 0
    seconds: float = 0.0


def passes(train: Examples, first: int) -> Source:
    """The train split from record ``first``, then whole passes of it, without end."""
    def blocks() -> Any:
        yield first, train.slice(first, len(train))
        k = 1
        while True:
            yield k * len(train), train
            k += 1
    return Source("movielens-stream", blocks)


def stream(cluster: LocalCluster, train: Examples, first: int, rate: float, score_every: int, by_producer: bool,
           stop: threading.Event, served: Served, out: dict[str, Any]) -> None:
    """Produce from ``first`` at ``rate`` records/s until ``stop``, shards of :data:`BATCH`; every
    ``score_every``-th record scored by the replica with its label before its shard is produced: by the
    producer (``by_producer``: ``produce(score_url=...)``), or here; none with ``score_every`` 0."""
    if by_producer:
        kwargs: dict[str, Any] = {"score_url": cluster.replica_url(0), "score_token": cluster.job_token,
                                  "score_every": score_every} if score_every else {}
        started = time.monotonic()
        report = produce(cluster.bootstrap, JOB, passes(train, first), partitions=PARTITIONS, shard_size=BATCH,
                         rate=rate, stop=stop, producer_id="bench-stream", **kwargs)
        out.update(records=report.records, scored_by="producer", seconds=time.monotonic() - started,
                   **{k: getattr(report, k, None) for k in ("scored", "score_failed", "score_skipped")})
        return
    replica = Http(cluster.replica_url(0), cluster.job_token)
    producer = reliable_producer(cluster.bootstrap, client_id="bench-serving-stream", linger_ms=5,
                                 batch_size=1 << 20)
    sent = 0
    at = first
    started = time.monotonic()
    try:
        while not stop.is_set():
            stop.wait(max(0.0, started + sent / rate - time.monotonic()))
            if stop.is_set():
                break
            shard = train.slice(at, min(at + BATCH, len(train)))
            picked = [j for j in range(len(shard)) if score_every and (sent + j) % score_every == 0]
            if picked:
                t0 = time.perf_counter()
                got = replica.json("POST", "/v1/predict", {"records": records_json(shard, picked, labels=True)})
                served.seconds += time.perf_counter() - t0
                served.requests += 1
                served.labels.extend(int(shard.y[j]) for j in picked)
                served.logits.extend(float(p["logit"]) for p in got["predictions"])
            value = encode_shard(shard.x, shard.y, ids=shard.ids, producer_id="bench-stream", first_seq=sent)
            producer.send(JOB, value, partition=(sent // BATCH) % PARTITIONS)
            sent += len(shard)
            at = at + len(shard) if at + len(shard) < len(train) else 0
        producer.flush(60)
    finally:
        producer.close()
        replica.close()
    out.update(records=sent, scored_by="bench", seconds=time.monotonic() - started, scored=len(served.labels),
               score_failed=0, score_skipped=0)


def windowed_auc(labels: Sequence[int], logits: Sequence[float], window: int) -> float | None:
    """Records-weighted mean AUC of consecutive windows of ``window`` records (as the trainers' progressive
    validation pools its windows); the last, partial window left out."""
    y, z = np.asarray(labels, np.int64), np.asarray(logits, np.float64)
    scored = []
    for lo in range(0, len(y) - window + 1, window):
        auc = score_window(ClosedWindow(window, z[lo:lo + window], y[lo:lo + window])).auc
        if auc is not None:
            scored.append(auc)
    return float(np.mean(scored)) if scored else None


# -- 3. freshness probes ---------------------------------------------------------------------------

@dataclass
class Probe:
    """One probe record: new ``user`` and ``item`` IDs, the rest of a real record's."""

    k: int
    record: dict[str, Any]
    """Its JSON record (no label), as the poller asks for it."""
    ids: dict[str, int]
    """Table -> its new ID there (``user``, ``item``)."""
    producer_id: str
    produced_ms: float = 0.0
    """Its shard's produce timestamp (ms since the epoch)."""
    history: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    """(ms since the epoch an answer came back, the version it named), each version's first answer."""
    row_versions: dict[int, int] | None = None
    """Group -> the version at which the probe's update wrote its rows there (None: not written yet)."""
    served_ms: float | None = None
    """When the first answer holding that update came back."""
    applied_ms: int | None = None
    """When the server applied its update (its accounting record)."""


def make_probe(train: Examples, k: int, rng: np.random.Generator, run: str) -> tuple[Probe, Examples]:
    """Probe ``k``: a random train record with a new user and a new item; (the probe, its one-record shard)."""
    base = train.take(np.array([int(rng.integers(len(train)))]))
    fresh = {"user": hash_id(f"user/probe-{run}-{k}"), "item": hash_id(f"item/probe-{run}-{k}")}
    ids = {}
    for f, col in base.ids.items():
        ids[f] = replace(col, values=np.array([fresh[f]], np.int64)) if f in fresh else col
    shard = Examples(base.x, base.y, ids)
    record = records_json(shard, [0], labels=False)[0]
    return Probe(k=k, record=record, ids=fresh, producer_id=f"bench-probe-{run}-{k}"), shard


def send_probes(cluster: LocalCluster, train: Examples, every_s: float, stop: threading.Event,
                probes: list[Probe], lock: threading.Lock) -> None:
    """A probe every ``every_s`` until ``stop``, each a shard of its own, partitions in turn."""
    producer = reliable_producer(cluster.bootstrap, client_id="bench-serving-probes", linger_ms=5)
    rng = np.random.default_rng(7)
    run = f"{os.getpid()}-{int(time.time())}"
    k = 0
    try:
        while not stop.wait(every_s if k else 0.0):
            probe, shard = make_probe(train, k, rng, run)
            ts = int(time.time() * 1000)
            value = encode_shard(shard.x, shard.y, ids=shard.ids, producer_id=probe.producer_id, first_seq=0,
                                 ts_ms=ts)
            probe.produced_ms = ts
            with lock:
                probes.append(probe)
            producer.send(JOB, value, partition=k % PARTITIONS)
            k += 1
        producer.flush(60)
    finally:
        producer.close()


def poll_probes(cluster: LocalCluster, probes: list[Probe], lock: threading.Lock, stop: threading.Event) -> None:
    """Until ``stop`` and no probe is left waiting: every :data:`POLL_S` the probes waiting, predicted
    in one request (the version named kept); every :data:`ROWS_EVERY_S` their rows' versions in Redis."""
    replica = Http(cluster.replica_url(0), cluster.job_token)
    client = connect(cluster.redis_url)
    meta = read_meta(client, JOB)
    specs = {t.name: t for t in meta.tables}
    rows_at = 0.0
    try:
        while True:
            tick = time.monotonic()
            now_ms = time.time() * 1000
            with lock:
                waiting = [p for p in probes if p.served_ms is None and now_ms - p.produced_ms < PROBE_TIMEOUT_S * 1000]
            if not waiting:
                if stop.is_set():
                    return
                time.sleep(POLL_S)
                continue
            got = replica.json("POST", "/v1/predict", {"records": [p.record for p in waiting]})
            back_ms = time.time() * 1000
            version = tuple(int(v) for v in str(got["model_version"]).split("."))
            for p in waiting:
                if not p.history or p.history[-1][1] != version:
                    p.history.append((back_ms, version))
            unknown = [p for p in waiting if p.row_versions is None]
            if unknown and tick - rows_at >= ROWS_EVERY_S:
                rows_at = tick
                wanted = {name: np.array([p.ids[name] for p in unknown], np.int64) for name in ("user", "item")}
                pulled = pull_rows(client, JOB, specs, meta.groups, wanted)
                groups = {name: group_of_ids(ids, meta.groups) for name, ids in wanted.items()}
                for i, p in enumerate(unknown):
                    if all(pulled.tables[name].present[i] for name in wanted):
                        at: dict[int, int] = {}
                        for name in wanted:
                            g = int(groups[name][i])
                            at[g] = max(at.get(g, 0), int(pulled.tables[name].versions[i]))
                        p.row_versions = at
            for p in waiting:
                if p.row_versions is not None:
                    rv = p.row_versions
                    p.served_ms = next((t for t, v in p.history if all(v[g] >= need for g, need in rv.items())), None)
            time.sleep(max(0.0, POLL_S - (time.monotonic() - tick)))
    finally:
        replica.close()
        client.close()


def freshness(probes: list[Probe], entries: list[AccountingRecord]) -> dict[str, Any]:
    """p50/p99 of produce -> first served answer holding the probe's update, and its two parts."""
    applied_at = {pid: e.applied_ms for e in entries for pid, _, _ in e.samples}
    for p in probes:
        p.applied_ms = applied_at.get(p.producer_id)
    done = [p for p in probes if p.served_ms is not None]
    missed = len(probes) - len(done)
    total = [(p.served_ms - p.produced_ms) / 1000 for p in done if p.served_ms is not None]
    total += [PROBE_TIMEOUT_S] * missed
    to_apply = [(p.applied_ms - p.produced_ms) / 1000 for p in done if p.applied_ms is not None]
    to_serve = [(p.served_ms - p.applied_ms) / 1000 for p in done
                if p.applied_ms is not None and p.served_ms is not None]
    if not total:
        raise RuntimeError("no probe was produced")

    def q(values: list[float]) -> dict[str, float | None]:
        return {"p50": quantile(values, 0.5) if values else None, "p99": quantile(values, 0.99) if values else None,
                "max": max(values) if values else None}

    return {"probes": len(probes), "served": len(done), "missed": missed, "total_s": q(total),
            "produce_to_applied_s": q(to_apply), "applied_to_served_s": q(to_serve),
            "samples_s": [round(v, 4) for v in total]}


# -- 4, 5. wrk -------------------------------------------------------------------------------------

def wrk(url: str, bodies: Path, token: str, *, connections: int, seconds: float, interval_ms: float = 0.0,
        limit: int = 0, binary: bool = False) -> dict[str, Any]:
    """One ``wrk -t1`` run of ``bench/serving_post.lua``: its summary (latencies in µs) and the rate achieved."""
    env = {**os.environ, "BENCH_BODIES": str(bodies), "BENCH_TOKEN": token, "BENCH_INTERVAL_MS": f"{interval_ms:.3f}",
           "BENCH_LIMIT": str(limit), "BENCH_BINARY": "1" if binary else "0"}
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed: scripts/setup_tests.sh installs it (Debian's package wrk)")
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "5s", "-s", str(LUA), url]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 60, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-500:]}")
    out: dict[str, Any] = json.loads(line.removeprefix("WRK_JSON "))
    out["rate"] = out["requests"] / (out["duration_us"] / 1e6)
    out["errors"] = sum(out[k] for k in ("connect_errors", "read_errors", "write_errors", "status_errors",
                                         "timeouts"))
    out.update(connections=connections, interval_ms=interval_ms)
    return out


def sweep(url: str, bodies: Path, token: str, seconds: float, rates: Sequence[int]) -> list[dict[str, Any]]:
    """Each rate of ``rates`` held for ``seconds`` (connections = rate x :data:`WAIT_MS`; their wait the
    rest of a connection's period after the mean latency the previous run measured)."""
    wrk(url, bodies, token, connections=2, seconds=1, interval_ms=5)  # warm: connections, caches
    latency_ms = 1.0
    runs = []
    for rate in rates:
        conns = max(1, round(rate * WAIT_MS / 1000))
        interval = max(0.0, conns * 1000 / rate - latency_ms)
        run = wrk(url, bodies, token, connections=conns, seconds=seconds, interval_ms=interval,
                  limit=int(rate * seconds * 1.5) + conns)
        run["offered"] = rate
        latency_ms = run["mean_us"] / 1000
        runs.append(run)
        console.print(f"  {rate:>5} req/s offered, {run['rate']:,.0f} achieved: p50 {run['p50_us'] / 1000:.2f} ms, "
                      f"p99 {run['p99_us'] / 1000:.2f} ms, max {run['max_us'] / 1000:.1f} ms, errors {run['errors']}")
    return runs


def held(run: dict[str, Any]) -> bool:
    """The run held its rate (achieved 90 % of it: with waits after answers, a slow replica lowers the
    rate instead of queueing) with p99 under the target and no error."""
    return bool(run["rate"] >= 0.9 * run["offered"] and run["p99_us"] < TARGET_P99_MS * 1000 and run["errors"] == 0)


def best(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The highest rate :func:`held` (None: none)."""
    ok = [r for r in runs if held(r)]
    return max(ok, key=lambda r: r["offered"]) if ok else None


def freshness_histogram(cluster: LocalCluster) -> dict[str, Any]:
    """The replica's own ``streamtrain_serve_freshness_seconds`` (per feed apply: from the newest entry's
    apply in Redis to the served state holding it): applies, and the bucket bounds of its p50 and p99."""
    with urllib.request.urlopen(cluster.replica_url(0) + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith("streamtrain_serve_freshness_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0

    def bound(q: float) -> float | None:
        return next((le for le, c in buckets if c >= q * total), None) if total else None

    return {"applies": int(total), "p50_at_most_s": bound(0.5), "p99_at_most_s": bound(0.99)}


# -- 6. throughput and its peer ------------------------------------------------------------------

def in_process(state_body: bytes, batches: list[Examples], seconds: float, served: np.ndarray) -> dict[str, Any]:
    """Records/s of the same module's forward in this process on ``batches``: the replica's rows and
    dense part loaded, rows gathered by ID, ``plan_lookups`` + ``pool`` + forward; one torch thread.
    ``served``: the replica's logits of ``batches[0]``, which the forward must give too."""
    torch.set_num_threads(1)
    tensors = load_safetensors(state_body)
    spec = build_model(MODEL)
    module = spec.model
    module.load_state_dict({k.removeprefix("dense."): torch.from_numpy(v.copy()) for k, v in tensors.items()
                            if k.startswith("dense.")})
    module.eval()
    specs = {t.name: t for t in spec.tables}
    tables = {}
    for name in specs:
        ids, values = tensors[f"{name}.ids"], tensors[f"{name}.values"]
        order = np.argsort(ids)
        tables[name] = (ids[order], values[order])

    def forward(batch: Examples) -> np.ndarray:
        lookups = plan_lookups(specs, batch.ids, len(batch), dedupe=False)
        rows = {}
        for name, lk in lookups.items():
            ids, values = tables[name]
            at = np.minimum(np.searchsorted(ids, lk.ids), len(ids) - 1)
            found = ids[at] == lk.ids if len(ids) else np.zeros(len(lk.ids), bool)
            out = values[at] if len(ids) else np.empty((len(lk.ids), lk.spec.dim), np.float32)
            if not found.all():
                out[~found] = initial_rows(lk.spec, lk.ids[~found])
            rows[name] = out
        pooled, _ = pool(lookups, rows, torch.device("cpu"), grad=False)
        return cast("np.ndarray", module(torch.from_numpy(batch.x), pooled).numpy())

    with torch.no_grad():
        diff = float(np.abs(forward(batches[0]).reshape(-1) - served).max())  # the same model, or no peer
        for b in batches[:4]:
            forward(b)  # warm
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for b in batches:
                forward(b)
                done += len(b)
        took = time.perf_counter() - t0
    return {"records": done, "seconds": took, "records_per_s": done / took, "max_abs_logit_diff": diff}


def request_parts(bodies: list[bytes], infer_bodies: list[bytes]) -> dict[str, float]:
    """ms per 256-record request of the replica's parse of a body (both routes) and of its answer's encoding."""
    spec = build_model(MODEL)
    sig = signature_of(spec, JOB, max_records=4096)

    def timed(fn: Callable[[], object], repeat: int = 3) -> float:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat * 1000

    parse_v1 = timed(lambda: [parse_records(b, sig) for b in bodies]) / len(bodies)
    parse_v2 = timed(lambda: [parse_infer(b, sig) for b in infer_bodies]) / len(infer_bodies)
    z = np.random.default_rng(0).normal(size=BIG).astype(np.float32)

    def encode() -> bytes:
        p = (0.5 + 0.5 * np.tanh(0.5 * z)).astype(np.float32)
        cols = {"probability": p.tolist(), "logit": z.tolist()}
        rows = [{k: c[i] for k, c in cols.items()} for i in range(BIG)]
        return json.dumps({"model_version": "1", "predictions": rows, "misses": 0}).encode()

    return {"parse_v1_ms": parse_v1, "parse_v2_ms": parse_v2, "encode_v1_ms": timed(encode, 50)}


# -- the run -------------------------------------------------------------------------------------

def write_bodies(path: Path, bodies: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(bodies) + b"\n")
    return path


def infer_binary(ex: Examples) -> tuple[bytes, int]:
    """``ex`` as Triton's Python client sends it by default: binary tensors (the body and the length of its
    JSON header), built by ``tritonclient.http`` itself, binary outputs asked."""
    import tritonclient.http as httpclient

    inputs = []
    n = len(ex)
    if ex.x.shape[1]:
        x = httpclient.InferInput("x", [n, ex.x.shape[1]], "FP32")
        x.set_data_from_numpy(np.ascontiguousarray(ex.x, dtype=np.float32))
        inputs.append(x)
    for f, col in ex.ids.items():
        values = np.ascontiguousarray(col.values[col.offsets[0]:col.offsets[-1]], dtype=np.int64)
        ids = httpclient.InferInput(f, [int(values.size)], "INT64")
        ids.set_data_from_numpy(values)
        lengths = httpclient.InferInput(f + ".lengths", [n], "INT64")
        lengths.set_data_from_numpy(np.diff(col.offsets).astype(np.int64))
        inputs += [ids, lengths]
    outputs = [httpclient.InferRequestedOutput(name) for name in ("probability", "logit")]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    return body, int(json_size or len(body))


def write_binary_bodies(folder: Path, bodies: list[tuple[bytes, int]]) -> Path:
    """Each body in a file of ``folder``, and the index :data:`LUA` reads with ``BENCH_BINARY=1``."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (body, json_size) in enumerate(bodies):
        (folder / f"{i}.bin").write_bytes(body)
        lines.append(f"{json_size} {folder / f'{i}.bin'}")
    index = folder / "index.txt"
    index.write_text("\n".join(lines) + "\n")
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases (under 2 minutes in all)")
    ap.add_argument("--capacity-records", type=int, default=16_000, help="records of the capacity run")
    ap.add_argument("--fresh-s", type=float, default=30.0, help="seconds probes are produced at half capacity")
    ap.add_argument("--probe-every-s", type=float, default=0.2, help="seconds between probes")
    ap.add_argument("--wrk-s", type=float, default=5.0, help="seconds of each wrk run")
    ap.add_argument("--score-every", type=int, default=0,
                    help="score every n-th streamed record before producing it (0: the smallest n that keeps the "
                         f"records scored within the replica's {MOST_LABELLED:,})")
    ap.add_argument("--score-by", choices=("auto", "producer", "bench"), default="auto",
                    help="who scores them: the producer (produce(score_url=...); the replica's served_auc), this "
                         "bench (also gives the served AUC in windows like the progressive one), auto: the producer "
                         "when it can")
    ap.add_argument("--latency-route", choices=("v2", "v1"), default="v2",
                    help="route of the one-record latency sweeps: v2, the Open Inference Protocol's infer (JSON "
                         "tensors, what Triton and KServe clients send), or v1, /v1/predict with training records")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/streamtrain-bench-serving"))
    args = ap.parse_args()
    if args.quick:
        args.capacity_records, args.fresh_s, args.wrk_s = min(args.capacity_records, 8000), min(args.fresh_s, 10), 2
    by_producer = producer_scores() if args.score_by == "auto" else args.score_by == "producer"
    if by_producer and not producer_scores():
        ap.error("--score-by producer: this producer has no score_url (datastream.produce)")
    harness.start()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    began = time.monotonic()
    phases: dict[str, float] = {}

    def mark(name: str, since: list[float] = [began]) -> None:  # noqa: B006 - the previous mark
        now = time.monotonic()
        phases[name] = round(now - since[0], 1)
        since[0] = now

    train = load_source(SOURCE, split="train").read()
    test = load_source(SOURCE, split="test").read()
    if args.latency_route == "v1":
        singles = [json.dumps({"records": records_json(test, [i], labels=False)}).encode() for i in range(2000)]
    else:
        singles = [json.dumps(infer_json(test.slice(i, i + 1))).encode() for i in range(2000)]
    batches = [test.slice(lo, lo + BIG) for lo in range(0, len(test) - BIG + 1, BIG)]
    big_v1 = [json.dumps({"records": records_json(b, range(len(b)), labels=False)}).encode() for b in batches]
    big_v2 = [json.dumps(infer_json(b)).encode() for b in batches]
    single_file = write_bodies(args.workdir / "single.jsonl", singles)
    big_v1_file = write_bodies(args.workdir / "big-v1.jsonl", big_v1)
    big_v2_file = write_bodies(args.workdir / "big-v2.jsonl", big_v2)
    big_bin_file = write_binary_bodies(args.workdir / "big-v2-binary", [infer_binary(b) for b in batches])
    results: dict[str, Any] = {"model": MODEL, "trainers": TRAINERS, "partitions": PARTITIONS, "rates": RATES,
                               "latency_route": args.latency_route,
                               "wrk_s": args.wrk_s, "poll_s": POLL_S, "probe_every_s": args.probe_every_s}

    with LocalCluster(job_spec(), workdir=args.workdir / "cluster") as cluster:
        mark("start")
        predict_url = cluster.replica_url(0) + "/v1/predict"
        latency_url = predict_url if args.latency_route == "v1" else f"{cluster.replica_url(0)}/v2/models/{JOB}/infer"
        cap = capacity(cluster, train, args.capacity_records)
        results["capacity"] = cap
        console.print(f"capacity, {TRAINERS} trainers: {cap['records_per_s']:,.0f} records/s "
                      f"({cap['records']:,} records in {cap['span_s']:.1f} s)")
        wait_replica_ready(cluster)
        mark("capacity")

        half = cap["records_per_s"] / 2
        every = args.score_every or max(1, math.ceil(half * (WARMUP_S + args.fresh_s) / (0.9 * MOST_LABELLED)))
        results["score_every"] = every
        stop_a, stop_b, stop_probes = threading.Event(), threading.Event(), threading.Event()
        served = Served()
        streamed: dict[str, Any] = {}
        probes: list[Probe] = []
        lock = threading.Lock()
        stream_a = threading.Thread(target=stream, args=(cluster, train, args.capacity_records, half, every,
                                                         by_producer, stop_a, served, streamed), daemon=True)
        probing = [threading.Thread(target=send_probes, args=(cluster, train, args.probe_every_s, stop_probes, probes,
                                                              lock), daemon=True),
                   threading.Thread(target=poll_probes, args=(cluster, probes, lock, stop_probes), daemon=True)]
        scorer = "producer" if by_producer else "bench"
        console.print(f"streaming at half capacity, {half:,.0f} records/s, every {every} scored by the {scorer} "
                      f"before it is produced; probes for {args.fresh_s:.0f} s after {WARMUP_S:g} s")
        stream_a.start()
        load_before = os.getloadavg()
        time.sleep(WARMUP_S)
        for t in probing:
            t.start()
        time.sleep(args.fresh_s)
        stop_probes.set()
        for t in probing:  # the last probes served while the stream still runs
            t.join(PROBE_TIMEOUT_S + 30)
        stop_a.set()
        stream_a.join(120)
        stream_status = replica_status(cluster)  # its served AUC: of the records scored in this part only
        histogram = freshness_histogram(cluster)
        mark("freshness")
        # the stream goes on, unscored, while wrk measures
        first_b = (args.capacity_records + int(streamed.get("records", 0))) % len(train)
        stream_b = threading.Thread(target=stream, args=(cluster, train, first_b, half, 0, False, stop_b, Served(), {}),
                                    daemon=True)
        stream_b.start()
        time.sleep(1.0)
        console.print("latency, training running:")
        running = sweep(latency_url, single_file, cluster.job_token, args.wrk_s, RATES)
        mark("latency_running")
        stop_b.set()
        stream_b.join(120)
        cluster.quiesce(120)
        entries = harness.applied_entries(cluster)
        progressive = cluster.progressive() or {}
        fresh = freshness(probes, entries)
        fresh["replica_histogram"] = histogram
        mark("quiesce")

        console.print("latency, training stopped:")
        stopped = sweep(latency_url, single_file, cluster.job_token, args.wrk_s, RATES)
        mark("latency_stopped")
        tput: dict[str, Any] = {}
        infer_url = f"{cluster.replica_url(0)}/v2/models/{JOB}/infer"
        for route, url, bodies, binary in (("v1_predict", predict_url, big_v1_file, False),
                                           ("v2_infer", infer_url, big_v2_file, False),
                                           ("v2_infer_binary", infer_url, big_bin_file, True)):
            wrk(url, bodies, cluster.job_token, connections=THROUGHPUT_CONNECTIONS, seconds=1, binary=binary)  # warm
            run = wrk(url, bodies, cluster.job_token, connections=THROUGHPUT_CONNECTIONS, seconds=args.wrk_s,
                      limit=100_000, binary=binary)
            run["records_per_s"] = run["rate"] * BIG
            tput[route] = run
            console.print(f"throughput {route}: {run['records_per_s']:,.0f} records/s ({run['rate']:,.0f} req/s of "
                          f"{BIG}, p50 {run['p50_us'] / 1000:.1f} ms, errors {run['errors']})")
        status = replica_status(cluster)
        http_ = Http(cluster.replica_url(0), cluster.job_token)
        try:
            code, state_body = http_.call("GET", "/v1/replica/state")
            first = http_.json("POST", "/v1/predict", {"records": records_json(batches[0], range(BIG), labels=False)})
        finally:
            http_.close()
        if code != 200:
            raise RuntimeError(f"GET /v1/replica/state: {code}")
        mark("throughput")
    load_after = os.getloadavg()
    peer = in_process(state_body, batches, max(2.0, args.wrk_s),
                      np.array([p["logit"] for p in first["predictions"]], np.float32))
    parts = request_parts(big_v1, big_v2)
    mark("peer_and_stop")
    console.print(f"in-process forward: {peer['records_per_s']:,.0f} records/s (its logits within "
                  f"{peer['max_abs_logit_diff']:.1g} of the replica's"
                  + (": NOT THE SAME MODEL, the ratio means nothing)" if peer["max_abs_logit_diff"] > 1e-4 else ")"))

    # the served AUC: the replica's (the producer scored) or ours; the progressive AUC over the same records
    if streamed.get("scored_by") == "producer":
        served_auc, labelled = stream_status.get("served_auc"), int(stream_status.get("labelled") or 0)
        windowed = None
    else:
        labels, logits = served.labels, served.logits
        served_auc = score_window(ClosedWindow(len(labels), np.asarray(logits), np.asarray(labels))).auc
        labelled = len(labels)
        windowed = windowed_auc(labels, logits, PROGRESSIVE_WINDOW * TRAINERS)
    # the progressive AUC of the records the scored part of the stream held: those after the capacity run's,
    # as many as it produced (the job's series counts the records its trainers scored, in order of training)
    series = progressive.get("job") or {}
    scored = (series.get("records") or [0])[-1]
    lo = min(0.99, args.capacity_records / scored) if scored else 0.0
    hi = min(1.0, (args.capacity_records + int(streamed.get("records", 0))) / scored) if scored else 1.0
    if labelled > MOST_LABELLED:  # the replica's AUC is of its newest MOST_LABELLED: the part's last records
        lo = hi - (hi - lo) * MOST_LABELLED / labelled
    prog = mean_auc(series, lo, hi) if series and hi > lo else None
    gap = None if prog is None or served_auc is None else prog - served_auc
    gap_windowed = None if prog is None or windowed is None else prog - windowed
    ratio_v1 = tput["v1_predict"]["records_per_s"] / peer["records_per_s"]
    ratio_v2 = tput["v2_infer"]["records_per_s"] / peer["records_per_s"]
    ratio_bin = tput["v2_infer_binary"]["records_per_s"] / peer["records_per_s"]
    bytes_ratio = status.get("bytes_per_raw_row")
    results.update(
        half_capacity_records_per_s=half, stream=streamed, latency_running=running, latency_stopped=stopped,
        freshness=fresh, throughput=tput, in_process=peer, request_parts_ms=parts, replica=status,
        replica_while_streaming=stream_status,
        served={"auc": served_auc, "labelled": labelled, "windowed_auc": windowed, "requests": served.requests,
                "mean_request_ms": served.seconds / served.requests * 1000 if served.requests else None},
        progressive={"auc": prog, "span": [lo, hi], "records_scored": scored}, phases_s=phases,
        load_average={"stream_start": load_before, "end": load_after},
        ratios={"v1_over_in_process": ratio_v1, "v2_over_in_process": ratio_v2,
                "v2_binary_over_in_process": ratio_bin, "auc_gap": gap,
                "auc_gap_windowed": gap_windowed, "bytes_per_raw_row": bytes_ratio})

    route = "/v1/predict" if args.latency_route == "v1" else f"/v2/models/{JOB}/infer"
    table = Table(title=f"one-record requests to {route}, wrk -t1, {args.wrk_s:g} s a rate (latency ms)")
    for col in ("offered req/s", "conns", "running: achieved", "p50", "p99", "max", "stopped: achieved", "p50",
                "p99", "max"):
        table.add_column(col, justify="right")
    for a, b in zip(running, stopped, strict=True):
        table.add_row(str(a["offered"]), str(a["connections"]), *(
            cell for r in (a, b) for cell in (f"{r['rate']:,.0f}" + (f" ({r['errors']} err)" if r["errors"] else ""),
                                              f"{r['p50_us'] / 1000:.2f}", f"{r['p99_us'] / 1000:.2f}",
                                              f"{r['max_us'] / 1000:.1f}")))
    console.print(table)

    def fmt(v: float | None, spec: str = ".3f") -> str:
        return "n/a" if v is None else format(v, spec)

    pa, ps = fresh["produce_to_applied_s"], fresh["applied_to_served_s"]
    console.print(f"freshness parts, p50 / p99 s: produce -> applied in Redis {fmt(pa['p50'])} / {fmt(pa['p99'])}; "
                  f"applied -> first served answer {fmt(ps['p50'])} / {fmt(ps['p99'])} (the replica's own histogram, "
                  f"applied -> served state, over {histogram['applies']} applies: p50 <= "
                  f"{fmt(histogram['p50_at_most_s'], 'g')}, p99 <= {fmt(histogram['p99_at_most_s'], 'g')}); "
                  f"{fresh['served']} of {fresh['probes']} probes served within {PROBE_TIMEOUT_S:.0f} s")
    console.print(f"the scored part of the stream: {streamed.get('records', 0):,} records, {streamed.get('scored')} "
                  f"scored, {streamed.get('score_failed')} failed, {streamed.get('score_skipped')} skipped (every "
                  f"{every}); the progressive AUC over its span of the trainers' records ({lo:.3f} .. {hi:.3f} of "
                  f"{scored:,})")
    console.print(f"a {BIG}-record request in the replica's own code, in process: parse /v1/predict "
                  f"{parts['parse_v1_ms']:.2f} ms, parse OIP JSON {parts['parse_v2_ms']:.2f} ms, encode the "
                  f"/v1/predict answer {parts['encode_v1_ms']:.2f} ms; the forward (lookup + pool + module) "
                  f"{BIG / peer['records_per_s'] * 1000:.2f} ms")
    console.print(f"phases (s): {phases}, {time.monotonic() - began:.0f} s in all; load average (1 min) "
                  f"{load_before[0]:.1f} when the stream began, {load_after[0]:.1f} at the end, on "
                  f"{os.cpu_count()} cores (other work on this machine counts)")

    def lat(runs: list[dict[str, Any]], what: str) -> list[str]:
        b = best(runs)
        at = next((r for r in runs if r["offered"] == TARGET_RATE), None)
        lines = []
        if b is None:
            lines.append(f"predict latency p50 / p99 ms, 1 record a request, {what}: no rate tried held with p99 < "
                         f"{TARGET_P99_MS:g} ms (lowest, {runs[0]['offered']} req/s, achieved {runs[0]['rate']:,.0f}: "
                         f"{runs[0]['p50_us'] / 1000:.2f} / {runs[0]['p99_us'] / 1000:.2f})")
        else:
            lines.append(f"predict latency p50 / p99 ms, 1 record a request, at {b['offered']} req/s "
                         f"(achieved {b['rate']:,.0f}), {what}: {b['p50_us'] / 1000:.2f} / {b['p99_us'] / 1000:.2f}"
                         f" (the highest rate tried that held with p99 < {TARGET_P99_MS:g} ms)")
        if at is not None and at is not b:
            lines.append(f"predict latency p50 / p99 ms, 1 record a request, at {TARGET_RATE} req/s (achieved "
                         f"{at['rate']:,.0f}), {what}: {at['p50_us'] / 1000:.2f} / {at['p99_us'] / 1000:.2f}")
        return lines

    stopped_at = next((r for r in stopped if r["offered"] == TARGET_RATE), None)
    met = stopped_at is not None and held(stopped_at)
    total = fresh["total_s"]
    harness.finish("serving", results, [
        *lat(running, "training running"),
        *lat(stopped, "training stopped"),
        (f"  target: p99 < {TARGET_P99_MS:g} ms at {TARGET_RATE} req/s of one record, training stopped: "
         f"{'met' if met else 'MISSED'}"),
        (f"serving freshness p99 s at half training capacity ({half:,.0f} records/s): {total['p99']:.3f} (p50 "
         f"{total['p50']:.3f}; {fresh['probes']} probes, {fresh['missed']} missed) (target <= {TARGET_FRESH_S:g}, "
         f"goal {GOAL_FRESH_S:g})"),
        (f"served auc (scored before trained), movielens: {fmt(served_auc, '.4f')} over {labelled:,} records, scored "
         f"by the {streamed.get('scored_by', '?')}" + (f"; in windows of {PROGRESSIVE_WINDOW * TRAINERS:,} as the "
                                                       f"progressive one: {fmt(windowed, '.4f')}" if windowed else "")),
        (f"auc gap, trainers' progressive - served, movielens: {fmt(gap, '.4f')} (progressive {fmt(prog, '.4f')}"
         + (f"; against the windowed served AUC {fmt(gap_windowed, '.4f')}" if gap_windowed is not None else "")
         + f") (target |gap| <= {TARGET_AUC_GAP:g})"),
        f"replica bytes per row / (8 + dim x 4): {fmt(bytes_ratio)} (target <= {TARGET_BYTES:g})",
        (f"ratio serve records/s, {BIG} records a request / in-process forward, /v1/predict (training records, "
         f"JSON): {ratio_v1:.3f} ({tput['v1_predict']['records_per_s']:,.0f} records/s)"),
        (f"ratio serve records/s, {BIG} records a request / in-process forward, OIP JSON tensors: {ratio_v2:.3f} "
         f"({tput['v2_infer']['records_per_s']:,.0f} records/s)"),
        (f"ratio serve records/s, {BIG} records a request / in-process forward: {ratio_bin:.3f} (OIP binary tensors, "
         f"tritonclient's default: {tput['v2_infer_binary']['records_per_s']:,.0f} records/s; in process "
         f"{peer['records_per_s']:,.0f}) (target >= {TARGET_RATIO:g})"),
    ])
    shutil.rmtree(args.workdir, ignore_errors=True)
    assert math.isfinite(ratio_bin)


if __name__ == "__main__":
    main()
