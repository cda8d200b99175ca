"""The joiner: throughput against a transactional copy, latency past the decidable moment, memory against the
pending impressions, and calibration with negative downsampling.

All on one Kafka broker started here (a LocalCluster of its own for the calibration), in this run:

(a) **throughput**: ``--impressions`` impressions of the ``clicks`` example's stream and their delayed clicks
    (``streamtrain produce-events``'s generator, unpaced), then, from the same two topics, ``--rounds`` times
    alternately

    - *the peer*: a plain kafka-python consumer (a group of its own, read committed) and a transactional
      producer copying every message's bytes to a topic, committing the records and the input offsets
      (``send_offsets_to_transaction``) together every 100 ms, as the joiner does;
    - *ours*: ``streamtrain join`` (a process, a fresh app id: an empty state), the same commit interval.

    Each is timed from its partitions being assigned to its last commit (ours: to its ``/metrics`` saying
    every impression is joined). Both read every input event (impressions, clicks, punctuations): the ratio
    is input events/s, ours over the peer's, best round of each.
(b) **latency**: ``--latency-s`` seconds of events paced in event time (an event is sent when the wall clock
    reaches its event time) through a joiner, and a read-committed reader noting when each labelled record
    becomes readable. An impression's label is decidable at its click (a positive) or once the watermark can
    pass its window (a negative: impression time + window + allowed lateness); the latency is from that
    moment to the record being readable, for every impression decidable before the events end.
(c) **memory**: a joiner's peak RSS (``VmHWM``) holding ``--memory`` pending impressions (a window of a day
    and a label no feedback has: none decides), and holding the most ``--max-pending`` allows when given
    the largest of them (the oldest decided early).
(d) **calibration**: ``up --example clicks`` (the events producer, the joiner, two trainers, a replica) with
    ``--negative-rate 1`` and ``0.1`` on ``--calibration-records`` records: the held-out impressions' mean
    predicted probability against their observed click rate, scored from Redis and served by the replica.

Writes ``bench/results/join.json``; prints the ratio and the p99 last.

    .venv/bin/python bench/join.py [--impressions 100000] [--latency-s 30] [--memory 25000,100000]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.structs import OffsetAndMetadata
from prometheus_client.parser import text_string_to_metric_families

from bench import harness
from datastream.clickevents import FEEDBACK, IMPRESSION, ClickEvents, click_stream
from datastream.events_producer import EventsReport, produce_events
from datastream.join.events import encode_punctuation
from datastream.topics import MAX_MESSAGE_BYTES, ensure_topic
from streamtrain.examples import CLICKS_SOURCE
from streamtrain.launcher import KafkaBroker, free_port, wait_until

PARTITIONS = 4
"""Partitions of every topic."""
WINDOW_S = 10.0
"""The join window (``up --join``'s)."""
LATENESS_S = 1.0
"""The allowed lateness (``up --join``'s)."""
DELAY_MEAN_S = 2.0
"""Mean click delay (``up --join``'s)."""
COMMIT_MS = 100
"""Commit interval of the joiner and the peer."""


def joiner_command(bootstrap: str, impressions: str, feedback: str, topic: str, app: str, metrics_port: int,
                   *flags: str) -> list[str]:
    """``streamtrain join`` on these topics with this app id, its metrics on ``metrics_port``."""
    return [sys.executable, "-m", "streamtrain.cli", "join", "--bootstrap", bootstrap, "--impressions", impressions,
            "--feedback", feedback, "--topic", topic, "--app-id", app, "--instance-id", "bench",
            "--window-s", str(WINDOW_S), "--allowed-lateness-s", str(LATENESS_S),
            "--commit-interval-ms", str(COMMIT_MS), "--partitions", str(PARTITIONS),
            "--metrics-port", str(metrics_port), *flags]


class JoinerProcess:
    """One ``streamtrain join`` process, its output in a file; stopped (SIGTERM) on exit."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log_path = log
        self.port = int(command[command.index("--metrics-port") + 1])
        self._out = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT,
                                     env=harness.child_environment())

    def __enter__(self) -> JoinerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def assigned(self) -> bool:
        """True once it said which partitions it joins (after restoring their state), raising if it exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the joiner exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        return re.search(r"joining partitions \[[0-9]", self.log()) is not None

    def log(self) -> str:
        """What it printed so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def metrics(self) -> dict[str, float]:
        """Its ``/metrics`` samples, by name (labels dropped: the ones read here have none)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    def peak_rss_mb(self) -> float:
        """Its peak resident set (``VmHWM``), MB."""
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM in /proc/<pid>/status")

    def stop(self) -> str:
        """SIGTERM (it commits and prints its counts), wait; its last line."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._out.close()
        lines = [line for line in self.log().splitlines() if line.startswith("joined ")]
        return lines[-1] if lines else ""


def wait_metric(joiner: JoinerProcess, name: str, want: float, timeout_s: float, interval_s: float = 0.05) -> float:
    """Poll ``joiner``'s ``/metrics`` until ``name`` reaches ``want``; the monotonic time it was seen there."""
    def reached() -> float:  # 0.0 (falsy) until then
        if joiner.proc.poll() is not None:
            raise RuntimeError(f"the joiner exited with {joiner.proc.returncode}:\n{joiner.log()[-3000:]}")
        try:
            value = joiner.metrics().get(name, 0.0)
        except OSError:  # not serving yet
            return 0.0
        return time.monotonic() if value >= want else 0.0

    return wait_until(reached, timeout_s, interval_s=interval_s, what=f"the joiner's {name} to reach {want:g}")


# -- (a) throughput -----------------------------------------------------------------------------------------

class _Assigned(ConsumerRebalanceListener):
    """Notes when partitions were assigned."""

    def __init__(self) -> None:
        self.at: float | None = None

    def on_partitions_revoked(self, revoked: Any) -> None:
        pass

    def on_partitions_assigned(self, assigned: Any) -> None:
        if assigned and self.at is None:
            self.at = time.monotonic()


def copy_pass(bootstrap: str, inputs: list[str], expected: int, timeout_s: float) -> float:
    """The peer: copy every message of ``inputs`` (``expected`` in all) to a fresh topic in transactions with
    the input offsets, every :data:`COMMIT_MS`; seconds from assignment to the last commit."""
    tag = uuid.uuid4().hex[:8]
    out_topic = f"bench-join-copy-{tag}"
    ensure_topic(bootstrap, out_topic, PARTITIONS)
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"bench-copy-{tag}", acks="all",
                             enable_idempotence=True, linger_ms=5, batch_size=256 * 1024,
                             max_request_size=MAX_MESSAGE_BYTES)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=f"bench-copy-{tag}", enable_auto_commit=False,
                             isolation_level="read_committed", auto_offset_reset="earliest",
                             partition_assignment_strategy=[RangePartitionAssignor], max_poll_records=10_000)
    try:
        producer.init_transactions()
        listener = _Assigned()
        consumer.subscribe(inputs, listener=listener)
        copied = committed = 0
        offsets: dict[TopicPartition, OffsetAndMetadata] = {}
        in_txn, last_commit = False, time.monotonic()
        deadline = time.monotonic() + timeout_s
        while committed < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the copy committed {committed} of {expected} messages in {timeout_s} s")
            for tp, msgs in consumer.poll(timeout_ms=COMMIT_MS).items():
                if not in_txn:
                    producer.begin_transaction()
                    in_txn = True
                for m in msgs:
                    producer.send(out_topic, key=m.key, value=m.value, partition=tp.partition)
                copied += len(msgs)
                offsets[tp] = OffsetAndMetadata(msgs[-1].offset + 1, "", -1)
            if in_txn and (time.monotonic() - last_commit >= COMMIT_MS / 1000 or copied == expected):
                producer.send_offsets_to_transaction(offsets, consumer.group_metadata())
                producer.commit_transaction()
                in_txn, committed, last_commit = False, copied, time.monotonic()
        assert listener.at is not None
        return time.monotonic() - listener.at
    finally:
        consumer.close()
        producer.close(timeout=5)


def join_pass(bootstrap: str, imps: str, fb: str, impressions: int, workdir: Path, timeout_s: float
              ) -> tuple[float, str]:
    """Ours: a fresh joiner over the two topics until every impression is joined; seconds from its assignment
    to the commit that joined the last, and its last line."""
    tag = uuid.uuid4().hex[:8]
    command = joiner_command(bootstrap, imps, fb, f"bench-join-out-{tag}", f"bench-join-{tag}",
                             free_port("127.0.0.1"))
    with JoinerProcess(command, workdir / f"join-{tag}.log") as joiner:
        wait_until(joiner.assigned, 120, interval_s=0.02, what="the joiner to take its partitions")
        started = time.monotonic()
        done = wait_metric(joiner, "streamtrain_join_joined_total", impressions, timeout_s)
        return done - started, joiner.stop()


def throughput(bootstrap: str, impressions: int, rounds: int, workdir: Path) -> dict[str, Any]:
    """Section (a)."""
    tag = uuid.uuid4().hex[:8]
    imps, fb = f"bench-join-imps-{tag}", f"bench-join-fb-{tag}"
    events = ClickEvents(stream=click_stream(CLICKS_SOURCE), rate_per_s=1000.0, delay_mean_s=DELAY_MEAN_S,
                         partitions=PARTITIONS)
    report: EventsReport = produce_events(bootstrap, imps, fb, events, limit=impressions, partitions=PARTITIONS,
                                          final_watermark_s=WINDOW_S + 60.0, window_s=WINDOW_S)
    if report.failed or report.interrupted:
        raise RuntimeError(f"producing the events failed: {report}")
    inputs = report.impressions + report.feedback + report.punctuations
    print(f"produced {report.impressions:,} impressions and {report.feedback:,} clicks "
          f"({report.events_per_s:,.0f} events/s acknowledged)")
    peer: list[float] = []
    ours: list[float] = []
    last = ""
    timeout_s = max(300.0, impressions / 200)
    for r in range(rounds):
        peer.append(copy_pass(bootstrap, [imps, fb], inputs, timeout_s))
        seconds, last = join_pass(bootstrap, imps, fb, report.impressions, workdir, timeout_s)
        ours.append(seconds)
        print(f"round {r + 1}: transactional copy {peer[-1]:.2f} s, joiner {ours[-1]:.2f} s")
    best_peer, best_ours = min(peer), min(ours)
    return {"impressions": report.impressions, "clicks": report.feedback, "input_events": inputs,
            "peer_s": peer, "ours_s": ours, "joiner_last_line": last,
            "peer_events_per_s": inputs / best_peer, "ours_events_per_s": inputs / best_ours,
            "ours_joined_per_s": report.impressions / best_ours, "ratio": best_peer / best_ours}


# -- (b) latency --------------------------------------------------------------------------------------------

class CommittedReader:
    """Reads ``topic`` read-committed on a thread of its own, noting the wall time each key became readable."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.arrived: dict[bytes, float] = {}
        self._stop = threading.Event()
        # fetch_max_wait_ms bounds what the reader itself adds: a fetch answers once data is readable
        self._consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                       isolation_level="read_committed", fetch_max_wait_ms=50)
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        self._consumer.assign(tps)
        self._consumer.seek_to_beginning(*tps)
        self._thread = threading.Thread(target=self._run, name="committed-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for msgs in self._consumer.poll(timeout_ms=100).values():
                now = time.time()
                for m in msgs:
                    self.arrived.setdefault(m.key, now)

    def close(self) -> None:
        """Stop reading."""
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


@dataclass
class Sent:
    """What :func:`paced_send` sent."""

    imp_index: np.ndarray
    """Record number of each impression sent."""
    imp_ms: np.ndarray
    """Its event time."""
    click_index: np.ndarray
    """Record number of each click's impression."""
    click_ms: np.ndarray
    """The click's event time."""
    horizon_ms: int
    """The lowest of the input partitions' last event times: the watermark the events themselves reach is this
    less the allowed lateness (the end's punctuation moves it further, and is not measured)."""
    lag_s: np.ndarray
    """How far behind its event time the sender handed each event to the producer, seconds."""


def paced_send(bootstrap: str, imps: str, fb: str, events: ClickEvents, limit: int) -> Sent:
    """Send the events of ``limit`` impressions, each once the wall clock reaches its event time, then a
    punctuation on every partition that moves event time past every window."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=1)
    topics = {IMPRESSION: imps, FEEDBACK: fb}
    imp_index, imp_ms, click_index, click_ms, lags = [], [], [], [], []
    last: dict[tuple[int, int], int] = {}
    try:
        for block in events.blocks(limit):
            t = block.t_ms.tolist()
            kinds, parts = block.kind.tolist(), block.partition.tolist()
            lag = np.empty(len(t))
            for j, kind in enumerate(kinds):
                ahead = t[j] / 1000 - time.time()
                if ahead > 0.0005:
                    time.sleep(ahead)
                lag[j] = time.time() - t[j] / 1000
                producer.send(topics[kind], block.values[j], key=block.keys[j], partition=parts[j])
                last[kind, parts[j]] = t[j]
            lags.append(lag)
            imp, click = block.kind == IMPRESSION, block.kind == FEEDBACK
            imp_index.append(block.index[imp])
            imp_ms.append(block.t_ms[imp])
            click_index.append(block.index[click])
            click_ms.append(block.t_ms[click])
        end = encode_punctuation(max(last.values()) + round((WINDOW_S + 60) * 1000))
        for topic in (imps, fb):
            for p in range(PARTITIONS):
                producer.send(topic, end, partition=p)
        producer.flush(60)
    finally:
        producer.close(timeout=10)
    if len(last) < 2 * PARTITIONS:
        raise RuntimeError(f"the latency run's events left input partitions empty ({sorted(last)}): run it longer")
    return Sent(np.concatenate(imp_index), np.concatenate(imp_ms), np.concatenate(click_index),
                np.concatenate(click_ms), min(last.values()), np.concatenate(lags))


def _quantiles(values: np.ndarray) -> dict[str, float | int]:
    if not len(values):
        return {"count": 0}
    return {"count": len(values), "p50_s": float(np.percentile(values, 50)),
            "p99_s": float(np.percentile(values, 99)), "max_s": float(values.max())}


def latency(bootstrap: str, seconds: float, rate: float, workdir: Path) -> dict[str, Any]:
    """Section (b)."""
    tag = uuid.uuid4().hex[:8]
    imps, fb, out = f"bench-lat-imps-{tag}", f"bench-lat-fb-{tag}", f"bench-lat-out-{tag}"
    for topic in (imps, fb, out):
        ensure_topic(bootstrap, topic, PARTITIONS)
    command = joiner_command(bootstrap, imps, fb, out, f"bench-lat-{tag}", free_port("127.0.0.1"))
    with JoinerProcess(command, workdir / f"latency-{tag}.log") as joiner:
        wait_until(joiner.assigned, 120, interval_s=0.05, what="the joiner to take its partitions")
        reader = CommittedReader(bootstrap, out)
        try:
            events = ClickEvents(stream=click_stream(CLICKS_SOURCE), rate_per_s=rate, delay_mean_s=DELAY_MEAN_S,
                                 partitions=PARTITIONS, start_ms=round(time.time() * 1000) + 2000)
            sent = paced_send(bootstrap, imps, fb, events, round(seconds * rate))
            wait_metric(joiner, "streamtrain_join_joined_total", len(sent.imp_index), 120, interval_s=0.5)
            wait_until(lambda: len(reader.arrived) >= len(sent.imp_index), 60, interval_s=0.2,
                       what="every labelled record to be read")
        finally:
            reader.close()
        last_line = joiner.stop()
    window_ms, lateness_ms = round(WINDOW_S * 1000), round(LATENESS_S * 1000)
    click_of = dict(zip(sent.click_index.tolist(), sent.click_ms.tolist(), strict=True))
    positive: list[float] = []
    negative: list[float] = []
    for i, t in zip(sent.imp_index.tolist(), sent.imp_ms.tolist(), strict=True):
        c = click_of.get(i)
        readable = reader.arrived[f"i{i}".encode()]
        if c is not None and c - t <= window_ms:  # decidable at its click
            positive.append(readable - c / 1000)
        elif t + window_ms + lateness_ms <= sent.horizon_ms:  # once the events' watermark passes its window
            negative.append(readable - (t + window_ms + lateness_ms) / 1000)
    both = np.array(positive + negative)
    return {"seconds": seconds, "impressions_per_s": rate, "impressions": len(sent.imp_index),
            "measured": len(both), **_quantiles(both), "positives": _quantiles(np.array(positive)),
            "negatives": _quantiles(np.array(negative)), "sender_lag": _quantiles(sent.lag_s),
            "joiner_last_line": last_line}


# -- (c) memory ---------------------------------------------------------------------------------------------

def memory_run(bootstrap: str, impressions: int, max_pending: int | None, workdir: Path) -> dict[str, Any]:
    """A joiner over ``impressions`` fresh impressions (and their clicks) of which none decides (a window of a
    day, and a label no feedback event has: the clicks are counted and ignored), unless ``max_pending`` (per
    partition) decides the oldest early; its peak RSS once every impression is consumed."""
    tag = uuid.uuid4().hex[:8]
    imps, fb = f"bench-mem-imps-{tag}", f"bench-mem-fb-{tag}"
    events = ClickEvents(stream=click_stream(CLICKS_SOURCE), rate_per_s=1000.0, delay_mean_s=DELAY_MEAN_S,
                         partitions=PARTITIONS)
    report = produce_events(bootstrap, imps, fb, events, limit=impressions, partitions=PARTITIONS,
                            final_watermark_s=0.0, window_s=WINDOW_S)
    if report.failed or report.interrupted or report.impressions != impressions:
        raise RuntimeError(f"producing the events failed: {report}")
    command = joiner_command(bootstrap, imps, fb, f"bench-mem-out-{tag}", f"bench-mem-{tag}", free_port("127.0.0.1"),
                             "--retain-s", "0", "--label", "purchase",
                             *(["--max-pending", str(max_pending)] if max_pending else []))
    command[command.index("--window-s") + 1] = "86400"
    with JoinerProcess(command, workdir / f"memory-{tag}.log") as joiner:
        held = impressions if not max_pending else min(impressions, max_pending * PARTITIONS)
        wait_metric(joiner, "streamtrain_join_pending", held, 600, interval_s=0.5)
        if held < impressions:  # and the rest decided early: every impression consumed
            wait_metric(joiner, "streamtrain_join_decided_early_total", impressions - held, 600, interval_s=0.5)
        metrics = joiner.metrics()
        run = {"impressions": impressions, "max_pending": max_pending,
               "pending": int(metrics["streamtrain_join_pending"]),
               "decided_early": int(metrics.get("streamtrain_join_decided_early_total", 0)),
               "peak_rss_mb": joiner.peak_rss_mb()}
    print(f"memory: {impressions:,} impressions, --max-pending {max_pending or 'default'}: {run['pending']:,} "
          f"pending, {run['decided_early']:,} decided early, peak RSS {run['peak_rss_mb']:.1f} MB")
    return run


def memory(bootstrap: str, sizes: list[int], max_pending: int | None, workdir: Path) -> dict[str, Any]:
    """Section (c): a joiner holding each of ``sizes`` pending impressions, and one given the largest that may
    hold ``max_pending`` per partition; the slope: MB per 1,000 pending impressions between the two largest
    sizes held whole."""
    runs = [memory_run(bootstrap, n, None, workdir) for n in sorted(sizes)]
    if max_pending:
        runs.append(memory_run(bootstrap, max(sizes), max_pending, workdir))
    whole = [r for r in runs if r["max_pending"] is None]
    slope = None
    if len(whole) >= 2:
        a, b = whole[-2], whole[-1]
        slope = (b["peak_rss_mb"] - a["peak_rss_mb"]) / (b["pending"] - a["pending"]) * 1000
    return {"runs": runs, "mb_per_1000_pending": slope}


# -- (d) calibration ----------------------------------------------------------------------------------------

def _score(redis_url: str, job: str, model: str, source: str) -> dict[str, Any]:
    from streamtrain.scoring import score_job
    from streamtrain.up import HELD_OUT_LIMIT

    score = score_job(redis_url, job, model, source, limit=HELD_OUT_LIMIT)
    return {"auc": score.auc, "mean_predicted": score.mean_predicted, "observed_rate": score.observed_rate,
            "held_out": score.samples, "version": score.version}


def _rate(value: float | None) -> str:
    """A rate as the calibration lines print it; ``none`` when the replica had scored nothing."""
    return "none" if value is None else f"{value:.4f}"


def calibration(records: int, negative_rate: float, workdir: Path) -> dict[str, Any]:
    """``up --example clicks --negative-rate R --max-records N`` as a LocalCluster. Mid-stream (once 70 % of the
    impressions are joined) the held-out impressions are scored from Redis and sent, labelled, to the replica,
    whose status says what it served; once every joined record is applied, scored from Redis again (after the
    end's punctuation decided the last window's impressions, negatives all, at once)."""
    from datastream.producer import ScoreSampler
    from datastream.sources import TEST_EVERY, load_source
    from streamtrain.cluster import LocalCluster
    from streamtrain.up import HELD_OUT_LIMIT, add_arguments, cluster_spec, held_out, replica_status, settings_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    s = settings_of(parser.parse_args(["--example", "clicks", "--negative-rate", str(negative_rate),
                                       "--max-records", str(records)]), {})
    spec = cluster_spec(s, {})
    impressions = records - records // TEST_EVERY  # the train split
    cluster = LocalCluster(spec, workdir=workdir / f"calibration-{negative_rate:g}")
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.cleanup)
        stack.callback(cluster.stop)
        started = time.monotonic()
        cluster.start()
        cluster.wait_for(lambda st: (st.get("join") or {}).get("joined", 0) >= 0.7 * impressions, timeout_s=900,
                         what="70 % of the impressions to be joined")
        mid = _score(cluster.redis_url, spec.job, s.model, held_out(s))
        url = cluster.replica_url(0)
        test = load_source(held_out(s), split="test").read(limit=HELD_OUT_LIMIT)
        sampler = ScoreSampler(url, cluster.job_token, every=1, time_share=1.0)
        try:
            for first in range(0, len(test), 500):
                sampler.before_send(test.slice(first, min(len(test), first + 500)), first)
        finally:
            sampler.close()
        if sampler.failed:
            raise RuntimeError(f"the replica refused {sampler.failed} held-out records: {sampler.last_error}")
        time.sleep(2.5)  # the replica recomputes its served scores at most every 2 s
        served = replica_status(url, cluster.job_token) or {}
        mid.update({"served": sampler.scored, "served_model_version": served.get("model_version"),
                    **{k: served.get(k) for k in ("served_mean_predicted", "served_observed_rate", "served_auc")}})
        st = cluster.wait_consumed(timeout_s=900)
        join = st["join"]
        end = _score(cluster.redis_url, spec.job, s.model, held_out(s))
        seconds = time.monotonic() - started
    out = {"negative_rate": negative_rate, "records": records, "seconds": seconds, "joined": join["joined"],
           "positives": join["positives"], "negatives_dropped": join["negatives_dropped"],
           "written": join["joined"] - join["negatives_dropped"], "mid_stream": mid, "end": end}
    print(f"calibration, negative rate {negative_rate:g}: {out['written']:,} of {out['joined']:,} joined impressions "
          f"written; mid-stream: AUC {mid['auc']:.4f}, mean predicted {mid['mean_predicted']:.4f} against observed "
          f"{mid['observed_rate']:.4f} (served: {_rate(mid['served_mean_predicted'])} against "
          f"{_rate(mid['served_observed_rate'])}); "
          f"at the end: AUC {end['auc']:.4f}, mean predicted {end['mean_predicted']:.4f}")
    return out


# -- main ---------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impressions", type=int, default=100_000, help="impressions of the throughput runs")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each counts")
    parser.add_argument("--latency-s", type=float, default=30.0, help="seconds of paced events of the latency run")
    parser.add_argument("--latency-rate", type=float, default=1000.0, help="impressions/s of the latency run")
    parser.add_argument("--memory", default="25000,100000",
                        help="pending impressions of the memory runs, comma-separated (empty: skip them)")
    parser.add_argument("--max-pending", type=int, default=5000,
                        help="--max-pending (per partition) of the bounded memory run; 0: none")
    parser.add_argument("--calibration-records", type=int, default=60_000,
                        help="records of the clicks stream each calibration run reads (0: skip them)")
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    args = parser.parse_args()
    harness.start()
    if args.rounds < 1 or args.impressions < 1:
        parser.error("--rounds and --impressions must be at least 1")
    sizes = [int(v) for v in args.memory.split(",") if v.strip()]
    results: dict[str, Any] = {"window_s": WINDOW_S, "allowed_lateness_s": LATENESS_S, "commit_ms": COMMIT_MS,
                               "partitions": PARTITIONS, "source": CLICKS_SOURCE}
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-join-")))
        bootstrap = args.bootstrap or stack.enter_context(KafkaBroker(log_level="WARN")).bootstrap
        results["throughput"] = throughput(bootstrap, args.impressions, args.rounds, workdir)
        results["latency"] = latency(bootstrap, args.latency_s, args.latency_rate, workdir)
        lat = results["latency"]
        for what, q in (("positives", lat["positives"]), ("negatives", lat["negatives"]),
                        ("the sender behind event time", lat["sender_lag"])):
            print(f"latency, {what}: {q['count']:,}, p50 {q.get('p50_s', 0):.3f} s, p99 {q.get('p99_s', 0):.3f} s, "
                  f"max {q.get('max_s', 0):.3f} s")
        if sizes:
            results["memory"] = memory(bootstrap, sizes, args.max_pending or None, workdir)
    if args.calibration_records:
        with tempfile.TemporaryDirectory(prefix="bench-join-cal-") as cal:
            results["calibration"] = [calibration(args.calibration_records, r, Path(cal)) for r in (1.0, 0.1)]
    t = results["throughput"]
    print(f"transactional copy (peer): {t['peer_events_per_s']:>10,.0f} input events/s")
    print(f"streamtrain join (ours)  : {t['ours_events_per_s']:>10,.0f} input events/s "
          f"({t['ours_joined_per_s']:,.0f} impressions joined/s)")
    for run in results.get("memory", {}).get("runs", []):
        bound = f" (--max-pending {run['max_pending']}, {run['decided_early']:,} decided early)" \
            if run["max_pending"] else ""
        print(f"joiner peak RSS: {run['peak_rss_mb']:.1f} MB at {run['pending']:,} pending impressions{bound}")
    if results.get("memory", {}).get("mb_per_1000_pending") is not None:
        print(f"memory: {results['memory']['mb_per_1000_pending']:.2f} MB per 1,000 pending impressions")
    results["ratio"] = t["ratio"]
    harness.finish("join", results, [
        f"join latency p99 s past the window: {lat['p99_s']:.3f}",
        f"ratio joined records/s / raw consume+produce records/s (input events/s): {t['ratio']:.2f}"])


if __name__ == "__main__":
    main()
