"""The coordinator's dashboard: the history it samples every second, and the page in a real browser.

The browser test drives Debian's headless Chromium over the DevTools protocol
(``tests/cdp.py``) against a coordinator on the real Redis and Kafka, with two
members heartbeating through the HTTP API, then two serving replicas and two joiners reporting. It writes the
screenshot into the test's tmp_path, and also to ``docs/img/dashboard.png`` when
``STREAMTRAIN_DOCS_SCREENSHOT=1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
import torch
from aiohttp.test_utils import TestClient
from cdp import CHROMIUM, chromium
from kafka import KafkaProducer

from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from coordinator.testing import running_coordinator
from services import ParameterStore
from services.tables import TableSpec
from streamtrain.launcher import await_until

pytestmark = pytest.mark.timeout(180)  # the first Kafka test of a session starts the broker

JOB = "dash"
KEYS = JobKeys(JOB)
JOB_AUTH = {"Authorization": "Bearer job-secret"}
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img" / "dashboard.png"
PLOT_IDS = {"loss", "auc", "accuracy", "records", "lag", "staleness", "freshness", "versions"}
TABLE_PLOT_IDS = {"table_rows", "table_bytes", "table_rates", "row_cache"}
PROGRESSIVE_PLOT_IDS = {"progressive_auc", "progressive_log_loss"}


def make_tables(redis: redis_lib.Redis, *names: str) -> None:
    """Make the job's model with embedding tables ``names`` (one shard group), as a trainer would."""
    ParameterStore(redis, JOB).init_model({"w": torch.zeros(8)}, shard_elems=64,
                                          tables=tuple(TableSpec(n, 4) for n in names))


def grow_table(redis: redis_lib.Redis, name: str, step: int, rows: int) -> None:
    """What a parameter server's applies and sweeps leave in group 0: ``rows`` more rows of table
    ``name`` (records of 40 bytes), that many admitted, and some dropped, expired and evicted."""
    gk = KEYS.group(0)
    redis.hset(gk.table_rows(name), mapping={(step * rows + i).to_bytes(8, "little"): b"r" * 40
                                             for i in range(rows)})
    for counter, n in (("admitted", rows), ("dropped", 2 * rows), ("expired", step % 2), ("evicted", 1)):
        redis.hincrby(gk.table_stats, f"{name}:{counter}", n)


def coordinator_settings(redis_url: str, kafka_bootstrap: str, topic: str, partitions: int,
                         kafka_timeout_ms: int = 500) -> CoordinatorSettings:
    """A lease far longer than any test's pauses: the members registered here never expire."""
    return CoordinatorSettings(job=JOB, redis_url=redis_url, kafka_bootstrap=kafka_bootstrap, topic=topic,
                               partitions=partitions, lease_ms=30_000, heartbeat_interval_ms=500,
                               admin_token="admin-secret", job_token="job-secret",
                               kafka_timeout_ms=kafka_timeout_ms)



async def register(client: TestClient, host: str) -> str:
    resp = await client.post("/v1/members", headers=JOB_AUTH,
                             json={"capabilities": {"device": "cpu", "threads": 1, "hostname": host}})
    assert resp.status == 201, await resp.text()
    return (await resp.json())["member_id"]


async def heartbeat(client: TestClient, member_id: str, stats: dict[str, Any]) -> None:
    resp = await client.post(f"/v1/members/{member_id}/heartbeat", headers=JOB_AUTH, json={"stats": stats})
    assert resp.status == 200, await resp.text()


async def history(client: TestClient, query: str = "") -> dict[str, Any]:
    resp = await client.get("/v1/history" + query)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def wait_for_history(client: TestClient, predicate: Callable[[dict[str, Any]], bool],
                           timeout_s: float = 60.0, what: str = "the history") -> dict[str, Any]:
    """Poll ``/v1/history`` until ``predicate`` holds for it (samples come once a second)."""

    async def satisfied() -> dict[str, Any] | None:
        h = await history(client)
        return h if predicate(h) else None

    return await await_until(satisfied, timeout_s, interval_s=0.1, what=what)


async def test_history_samples_heartbeats_and_redis_once_a_second(
        redis_url: str, redis: redis_lib.Redis, silent_broker: str) -> None:
    """Per-member loss and records/s, job means and sums, staleness from the hash, freshness
    quantiles of exactly the samples heartbeats brought, versions/s; lag is null without Kafka."""
    settings = coordinator_settings(redis_url, silent_broker, "train", 2)
    async with running_coordinator(settings) as client:
        a = await register(client, "host-a")
        b = await register(client, "host-b")
        redis.set(KEYS.group(0).version, 100)
        redis.hset(KEYS.staleness, mapping={a: 1, b: 3})
        await heartbeat(client, a, {"loss": 0.5, "accuracy": 0.8, "auc": 0.75, "log_loss": 0.6,
                                    "records_per_s": 300.0, "freshness_s": [1.0, 2.0, 3.0]})
        await heartbeat(client, b, {"loss": 0.25, "records_per_s": 100.0})

        def seen_both(h: dict[str, Any]) -> bool:
            return len(h["t_ms"]) >= 2 and h["job"]["loss"][-1] == pytest.approx(0.375)

        h = await wait_for_history(client, seen_both, what="a sample of both heartbeats")
        last = {name: column[-1] for name, column in h["job"].items()}
        assert last["records_per_s"] == 400.0
        assert last["accuracy"] == 0.8  # b reports none: the mean is a's, not dragged to 0.4
        assert (last["auc"], last["log_loss"]) == (0.75, 0.6) and h["members"][b]["auc"][-1] is None
        assert (last["staleness_max"], last["staleness_mean"]) == (3.0, 2.0)
        assert last["lag"] is None  # Kafka is down
        assert h["members"][a]["loss"][-1] == 0.5 and h["members"][b]["accuracy"][-1] is None
        p50 = [v for v in h["job"]["freshness_p50_s"] if v is not None]
        p99 = [v for v in h["job"]["freshness_p99_s"] if v is not None]
        assert p50 == [2.0] and p99 == [pytest.approx(2.98)]  # one heartbeat's samples, one tick

        since = h["t_ms"][-1]
        redis.incrby(KEYS.group(0).version, 50)
        h = await wait_for_history(client, lambda h: h["job"]["version"][-1] == 150, what="version 150 sampled")
        # the rate of the sample that first saw 150: 50 versions over the time since the one before
        t, versions, rates = h["t_ms"], h["job"]["version"], h["job"]["versions_per_s"]
        i = versions.index(150)
        assert i > 0 and versions[i - 1] == 100, versions
        assert rates[i] == pytest.approx(50 / ((t[i] - t[i - 1]) / 1000))
        newer = await history(client, f"?since_ms={since}")
        assert newer["t_ms"] and all(t > since for t in newer["t_ms"])
        assert newer["capacity"] == settings.history_samples and newer["interval_s"] == 1.0

        bad = await client.get("/v1/history?since_ms=yesterday")
        assert bad.status == 400 and "since_ms" in (await bad.json())["error"]["message"]


async def test_history_samples_the_embedding_tables_and_their_rates(
        redis_url: str, redis: redis_lib.Redis, silent_broker: str) -> None:
    """A job with tables: per table rows, bytes and counter rates, their sums, and the mean of the
    trainers' row cache hit rates; none of it before the model exists."""
    settings = coordinator_settings(redis_url, silent_broker, "train", 2)
    async with running_coordinator(settings) as client:
        a = await register(client, "host-a")
        b = await register(client, "host-b")
        await wait_for_history(client, lambda h: len(h["t_ms"]) >= 1, what="a first sample")
        h = await history(client)
        assert h["tables"] == {} and set(h["job"]["table_rows"]) == {None}  # no model: no table series
        make_tables(redis, "user", "item")
        grow_table(redis, "user", 0, 5)
        await heartbeat(client, a, {"row_cache_hit_rate": 0.5})
        await heartbeat(client, b, {"row_cache_hit_rate": 0.25})
        h = await wait_for_history(client, lambda h: h["job"]["table_rows"][-1] == 5, what="the tables sampled")
        assert list(h["tables"]) == ["user", "item"]
        assert h["tables"]["user"]["rows"][-1] == 5 and h["tables"]["item"]["rows"][-1] == 0
        assert h["tables"]["user"]["bytes"][-1] > 5 * 40 and h["tables"]["item"]["bytes"][-1] == 0
        assert h["job"]["row_cache_hit_rate"][-1] == 0.375

        grow_table(redis, "user", 1, 30)
        h = await wait_for_history(client, lambda h: h["job"]["table_rows"][-1] == 35, what="30 more rows")
        # the rate of the sample that first saw them: 30 admitted over the time since the one before
        t, rows, admitted = h["t_ms"], h["tables"]["user"]["rows"], h["tables"]["user"]["admitted_per_s"]
        i = rows.index(35)
        assert i > 0 and rows[i - 1] == 5, rows
        seconds = (t[i] - t[i - 1]) / 1000
        assert admitted[i] == pytest.approx(30 / seconds)
        assert h["tables"]["user"]["dropped_per_s"][i] == pytest.approx(60 / seconds)
        assert h["tables"]["user"]["expired_per_s"][i] == pytest.approx(1 / seconds)
        assert h["job"]["table_admitted_per_s"][i] == pytest.approx(30 / seconds)  # item admitted none
        assert h["tables"]["item"]["admitted_per_s"][i] == 0.0


async def test_vendored_uplot_is_served_and_nothing_else(redis_url: str, silent_broker: str) -> None:
    settings = coordinator_settings(redis_url, silent_broker, "train", 2)
    async with running_coordinator(settings) as client:
        page = await (await client.get("/")).text()
        assert "/static/vendor/uPlot.iife.min.js" in page and "/v1/history" in page
        script = await client.get("/static/vendor/uPlot.iife.min.js")
        assert script.status == 200 and script.content_type == "application/javascript"
        assert "uPlot" in await script.text()
        css = await client.get("/static/vendor/uPlot.min.css")
        assert css.status == 200 and css.content_type == "text/css"
        licence = await client.get("/static/vendor/LICENSE")
        assert licence.status == 200 and "MIT" in await licence.text()
        for name in ("README.md", "..%2Fopenapi.yaml", "index.html"):
            missing = await client.get(f"/static/vendor/{name}")
            assert missing.status == 404, name
            assert (await missing.json())["error"]["code"] == "not_found"


@contextlib.asynccontextmanager
async def trainers_heartbeating(client: TestClient, redis: redis_lib.Redis, members: list[str],
                                scoring: asyncio.Event | None = None) -> AsyncIterator[None]:
    """Heartbeat like two trainers and publish versions, four times a second, until the block
    ends. The first reports a held-out accuracy, AUC and log loss; the second none, and a training loss of 3e-5 and
    below (a memorised training set: what the page once showed as 0.0000). Once the job has a
    model with embedding tables (:func:`make_tables`), they grow as a parameter server would grow
    them (:func:`grow_table`) and the trainers report their row cache's hit rate. Once ``scoring`` is
    set, each heartbeat carries a progressive-validation window of 100 records whose AUC climbs."""

    scored = [0] * len(members)

    async def beat() -> None:
        for step in range(10_000):
            tables = [t["name"] for t in json.loads(redis.get(KEYS.meta) or b"{}").get("tables", [])]
            for i, member in enumerate(members):
                stats: dict[str, Any] = {"loss": 2.0 / (1 + 0.2 * step) if i == 0 else 3e-5 / (1 + step),
                                         "records_per_s": 800.0 + 100 * i + 10 * (step % 7),
                                         "clock": step, "staleness": i,
                                         "freshness_s": [0.2 + 0.05 * (step % 5), 0.9]}
                if i == 0:  # a binary model's held-out scores
                    stats["accuracy"] = min(0.97, 0.2 + 0.05 * step)
                    stats["auc"] = min(0.8, 0.5 + 0.01 * step)
                    stats["log_loss"] = 0.69 - min(0.1, 0.005 * step)
                if tables:
                    stats["row_cache_hit_rate"] = 0.6 + 0.1 * i + 0.02 * (step % 5)
                if scoring is not None and scoring.is_set():
                    scored[i] += 100
                    auc = min(0.9, 0.5 + 0.01 * scored[i] / 100 + 0.02 * i)
                    stats["progressive"] = [{"records": scored[i], "n": 100, "auc": auc, "log_loss": 1.2 - auc}]
                    stats["progressive_auc"] = auc
                await heartbeat(client, member, stats)
            for k, name in enumerate(tables):
                grow_table(redis, name, step, 4 * (k + 1))
            redis.incrby(KEYS.group(0).version, 3)
            redis.hset(KEYS.staleness, mapping={m: (step + i) % 3 for i, m in enumerate(members)})
            await asyncio.sleep(0.25)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def replicas_reporting(client: TestClient, names: list[str]) -> AsyncIterator[None]:
    """Report like serving replicas (``POST /v1/serving/replicas/<name>``), four times a second, until the
    block ends: each answers 50 requests more per report (200/s) and more for the later ones; the second
    is loading (not ready, no version) for its first four reports."""

    async def report() -> None:
        for step in range(10_000):
            for i, name in enumerate(names):
                loading = i == 1 and step < 4
                body = {"url": f"http://10.0.0.{7 + i}:8800", "version": None if loading else f"{1200 + 3 * step}",
                        "staleness_s": None if loading else 0.05 + 0.01 * (step % 5) + 0.1 * i, "ready": not loading,
                        "rows": 0 if loading else 5000 + 40 * step, "misses": 3 * step * i, "reloads": i,
                        "requests": (50 + 10 * i) * step, "records": 64 * (50 + 10 * i) * step,
                        "latency_p99_ms": 2.5 + i + 0.1 * (step % 3), "served_auc": None if loading else 0.7 + 0.02 * i,
                        "labelled": 0 if loading else 500 * step}
                resp = await client.post(f"/v1/serving/replicas/{name}", headers=JOB_AUTH, json=body)
                assert resp.status == 204, await resp.text()
            await asyncio.sleep(0.25)

    task = asyncio.create_task(report())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def joiners_reporting(client: TestClient, names: list[str]) -> AsyncIterator[None]:
    """Report like joiners (``POST /v1/join/joiners/<name>``), four times a second, until the block ends: each
    owns two of four partitions and joins 100 records more per report (400/s), one in ten positive; the second
    counts late feedback and dead letters, and its watermark lags more."""

    async def report() -> None:
        for step in range(10_000):
            for i, name in enumerate(names):
                joined = 100 * step
                body = {"url": f"http://{name}:9105/metrics", "partitions": [i, i + 2], "joined": joined,
                        "positives": joined // 10, "negatives": joined - joined // 10, "negatives_dropped": 0,
                        "late": {"outside_window": 2 * i * step, "after_decision": i}, "dead_letters":
                        {"bad_event": i * 3} if i else {}, "decided_early": 0, "pending": 500 + 10 * (step % 5),
                        "early_feedback": 4, "watermark_ms": 1_700_000_000_000 + 250 * step,
                        "watermark_lag_s": 1.0 + 2 * i + 0.1 * (step % 3), "transactions": 25 * step}
                resp = await client.post(f"/v1/join/joiners/{name}", headers=JOB_AUTH, json=body)
                assert resp.status == 204, await resp.text()
            await asyncio.sleep(0.25)

    task = asyncio.create_task(report())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                                             "(scripts/setup_tests.sh installs it: apt-get install chromium)")
async def test_dashboard_plots_the_live_history_in_chromium_without_errors(
        redis_url: str, redis: redis_lib.Redis, kafka, tmp_path: Path) -> None:
    topic = kafka.create_topic(partitions=2, prefix="dash")
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
    try:
        for i in range(60):
            producer.send(topic, b"record %d" % i, partition=i % 2)
        producer.flush(timeout=30)
    finally:
        producer.close()
    settings = coordinator_settings(redis_url, kafka.bootstrap, topic, 2, kafka_timeout_ms=5000)
    async with running_coordinator(settings) as client:
        members = [await register(client, "host-a"), await register(client, "host-b")]
        redis.hset(KEYS.offsets, "0", 10)  # lag: 30 - 10 on partition 0, 30 on partition 1
        scoring = asyncio.Event()
        async with trainers_heartbeating(client, redis, members, scoring), chromium(tmp_path / "profile") as page:
            await page.navigate(str(client.make_url("/")))
            await page.wait_for("window.plots && Object.keys(window.plots).length === 8 && "
                                "Object.values(window.plots).every(u => u.data[0].length > 3 && "
                                "u.data.slice(1).some(s => s.some(v => v !== null)))", timeout_s=90)
            points = await page.evaluate(
                "Object.fromEntries(Object.entries(window.plots).map(([id, u]) => [id, "
                "u.series.slice(1).map((s, i) => [s.label, u.data[i + 1].filter(v => v !== null).length])]))")
            assert set(points) == PLOT_IDS
            for plot_id, series in points.items():
                assert any(n > 0 for _, n in series), f"plot {plot_id} has no values: {series}"
            for plot_id in ("loss", "records", "accuracy"):  # a line per trainer, and the job's
                assert [label for label, _ in points[plot_id]][1:] == sorted(members), points[plot_id]
            auc = dict(points["auc"])  # the job's AUC and log loss, a line per trainer
            assert auc["AUC"] > 0 and auc["log loss"] > 0 and auc[members[0]] > 0 and auc[members[1]] == 0
            accuracy = dict(points["accuracy"])
            assert accuracy[members[0]] > 0 and accuracy[members[1]] == 0  # b reports none: no line
            lag = await page.evaluate("window.plots.lag.data[1].filter(v => v !== null).slice(-1)[0]")
            assert lag == 50
            rows = await page.wait_for("document.querySelectorAll('#members tr').length")
            assert rows == 2
            losses = await page.evaluate("[...document.querySelectorAll('#members tr')]"
                                         ".map(tr => tr.children[6].textContent)")
            assert all(float(v) > 0 for v in losses), losses  # a tiny loss keeps its digits
            assert any(float(v) < 3e-5 for v in losses), losses
            summary = await page.evaluate("document.getElementById('summary').textContent")
            assert summary.startswith("ssp (s=2) · lazyadam") and "tables" not in summary, summary
            assert "held-out AUC 0." in summary and "log loss 0." in summary, summary
            # the embedding tables' own mode and bound, once the job has them, beside the dense part's
            resp = await client.patch("/v1/admin/config", headers={"Authorization": "Bearer admin-secret"},
                                      json={"table_consistency": "asp", "table_staleness": 8})
            assert resp.status == 200, await resp.text()
            summary = await page.wait_for("(t => t.includes('tables') && t)"
                                          "(document.getElementById('summary').textContent)", timeout_s=30)
            assert summary.startswith("ssp (s=2) · tables asp (s=8) · lazyadam"), summary

            # the embedding tables: no section for a dense job; a table and plots once the model has tables
            assert await page.evaluate("document.getElementById('tables').hidden") is True
            make_tables(redis, "user", "item", "ad")
            await page.wait_for("!document.getElementById('tables').hidden && "
                                "document.querySelectorAll('#table-rows tr').length === 4", timeout_s=30)
            await page.wait_for(  # the rates need two samples of the tables
                "[...document.querySelectorAll('#table-rows tr')].every(tr => tr.children[3].textContent !== '–')",
                timeout_s=30)
            cells = await page.evaluate("[...document.querySelectorAll('#table-rows tr')]"
                                        ".map(tr => [...tr.children].map(td => td.textContent))")
            assert [c[0] for c in cells] == ["user", "item", "ad", "all tables"], cells
            for name, rows, size, admitted_per_s, *_ in cells:
                assert int(rows.replace(",", "")) > 0 and size.endswith("B"), (name, rows, size)
                assert float(admitted_per_s.replace(",", "")) > 0, (name, admitted_per_s)
            line = await page.evaluate("document.getElementById('table-summary').textContent")
            hit_rate = re.search(r"hit rate ([0-9.]+) %", line)
            assert line.startswith("3 tables · ") and hit_rate, line
            assert 65 <= float(hit_rate[1]) <= 73, line  # the mean of the two trainers' 60..68 % and 70..78 %
            await page.wait_for(f"Object.keys(window.plots).length === {len(PLOT_IDS | TABLE_PLOT_IDS)} && "
                                + " && ".join(f"window.plots.{p}.data.slice(1).some(s => s.some(v => v !== null))"
                                              for p in sorted(TABLE_PLOT_IDS)), timeout_s=30)
            rates = await page.evaluate("window.plots.table_rates.series.slice(1).map(s => s.label)")
            assert rates == ["admitted", "dropped", "expired", "evicted"]

            # progressive validation: no section until a trainer reports windows (a binary model)
            assert await page.evaluate("document.getElementById('progressive').hidden") is True
            assert not PROGRESSIVE_PLOT_IDS & set(await page.evaluate("Object.keys(window.plots)"))
            scoring.set()
            await page.wait_for("!document.getElementById('progressive').hidden && "
                                + " && ".join(f"window.plots.{p} && window.plots.{p}.data[0].length > 3"
                                              for p in sorted(PROGRESSIVE_PLOT_IDS)), timeout_s=30)
            auc = await page.evaluate("(u => ({labels: u.series.slice(1).map(s => s.label), x: u.data[0], "
                                      "job: u.data[1], members: u.data.slice(2)}))(window.plots.progressive_auc)")
            assert auc["labels"] == ["job", *sorted(members)]
            assert auc["x"] == sorted(auc["x"]) and auc["x"][0] >= 100 and auc["x"][-1] > auc["x"][0]
            assert all(0.5 <= v <= 0.92 for v in auc["job"])
            assert all(any(v is not None for v in m) for m in auc["members"])
            assert auc["job"][-1] > auc["job"][0]  # the windows' AUC climbs
            line = await page.evaluate("document.getElementById('progressive-summary').textContent")
            assert line.startswith("latest: AUC 0.") and "records scored" in line, line
            prog_cells = await page.wait_for("(c => c.every(v => v !== '–') && c)([...document.querySelectorAll("
                                             "'#members tr')].map(tr => tr.children[8].textContent))", timeout_s=10)
            assert all(0.5 <= float(v) <= 0.92 for v in prog_cells), prog_cells

            # the serving replicas: no section until one reports; a row per replica and the line above it
            assert await page.evaluate("document.getElementById('serving').hidden") is True
            replicas = ["serve-a:8800", "serve-b:8800"]
            async with replicas_reporting(client, replicas):
                line = await page.wait_for(
                    "(t => !document.getElementById('serving').hidden && t.startsWith('2 of 2 replicas ready') && "
                    "!t.includes('– requests/s') && t)(document.getElementById('serving-summary').textContent)",
                    timeout_s=30)
                rate = re.search(r"ready · ([0-9.,]+) requests/s", line)
                assert rate and 100 <= float(rate[1].replace(",", "")) <= 600, line  # ~4 reports/s of +50 and +60
                assert re.search(r"latency p99 3\.[0-9]+ ms", line) and "serving lag 0.1" in line, line
                assert re.search(r"served AUC 0\.7[0-9]* \([0-9,]+ labelled\)", line), line
                cells = await page.evaluate("[...document.querySelectorAll('#serving-rows tr')]"
                                            ".map(tr => [...tr.children].map(td => td.textContent))")
            assert [c[0] for c in cells] == replicas, cells
            for name, ready, version, lag, per_s, p99, rows, *_ in cells:
                assert ready == "yes" and int(version) >= 1200 and 0 < float(lag) < 1, (name, ready, version, lag)
                assert float(per_s) > 0 and 2 < float(p99) < 4 and int(rows.replace(",", "")) >= 5000, cells

            # the joiners: no section until one reports; a row per joiner and the line above them
            assert await page.evaluate("document.getElementById('join').hidden") is True
            joiners = ["join-a", "join-b"]
            async with joiners_reporting(client, joiners):
                line = await page.wait_for(
                    "(t => !document.getElementById('join').hidden && t.startsWith('2 joiners on 4 partitions') && "
                    "!t.includes('(–/s)') && t)(document.getElementById('join-summary').textContent)", timeout_s=30)
                rate = re.search(r"joined \(([0-9.,]+)/s\)", line)
                assert rate and 200 <= float(rate[1].replace(",", "")) <= 1200, line  # ~4 reports/s of +100, twice
                assert "positive rate 10.0 %" in line and "dead letters: bad_event 3" in line, line
                assert re.search(r"late: after_decision 1, outside_window [0-9,]+ ·", line), line  # by reason, summed
                assert re.search(r"watermark lag 3(\.[0-9]+)? s \(furthest behind\)", line), line
                cells = await page.evaluate("[...document.querySelectorAll('#join-rows tr')]"
                                            ".map(tr => [...tr.children].map(td => td.textContent))")
                png = await page.screenshot()
            assert [c[0] for c in cells] == joiners and [c[1] for c in cells] == ["0,2", "1,3"], cells
            for _, _, joined, per_s, positives, negatives, pending, lag, *_ in cells:
                assert int(joined.replace(",", "")) > 0 and float(per_s.replace(",", "")) > 0, cells
                assert int(positives.replace(",", "")) < int(negatives.replace(",", "")), cells
                assert 500 <= int(pending) <= 540 and 1 <= float(lag) < 3.3, cells
            assert cells[0][8:10] == ["none", "none"], cells  # counts of 0 are none
            assert cells[1][8].startswith("after_decision 1, outside_window ") and cells[1][9] == "bad_event 3", cells
            assert page.errors() == []
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "dashboard.png").write_bytes(png)
    if os.environ.get("STREAMTRAIN_DOCS_SCREENSHOT") == "1":
        DOCS_IMG.parent.mkdir(parents=True, exist_ok=True)
        DOCS_IMG.write_bytes(png)
