"""Soak: does anything grow with time alone? Memory of every process and of Redis over a long run.

Runs the local topology (:class:`streamtrain.cluster.LocalCluster`: Kafka, Redis,
the coordinator, a parameter server, two trainers and a producer streaming the
digits data set pass after pass at a fixed ``--rate``: what ``streamtrain up
--forever`` runs, rate-limited) for ``--minutes``, and every ``--every-s``
seconds samples the RSS of each process it started (``VmRSS`` of
``/proc/<pid>/status``) and Redis's ``used_memory`` (plus, for reading, the
lengths of the keys that could grow). After the warm-up (``--warmup-minutes``,
a quarter of the run by default) it fits each series' growth per hour: the
least-squares slope relative to the series' mean over the same samples.

The parameter server's audit horizon comes from ``STREAMTRAIN_PS_AUDIT_HORIZON_S``
(600 s by default); a short run sets it lower so that trimming happens in it.
Some series are sawtooths (the update log empties at every persist, about every
256 updates; the JVM heap between collections): a short run fits part of a tooth
and overstates growth either way, the default 20 minutes averages over many.

Writes ``bench/results/soak.json``; prints the largest growth last (target <= 5 % per hour).

    .venv/bin/python bench/soak.py [--minutes 20] [--rate 1500] [--warmup-minutes 5]
    STREAMTRAIN_PS_AUDIT_HORIZON_S=60 .venv/bin/python bench/soak.py --minutes 3 --warmup-minutes 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import redis as redis_lib
from rich.console import Console
from rich.table import Table

from bench import harness
from common.keys import JobKeys
from services import ParameterStore
from streamtrain.cluster import LOCAL_STREAM, ClusterSpec, LocalCluster
from streamtrain.launcher import ManagedProcess, RedisCluster

TARGET_PCT_PER_HOUR = 5.0
"""Largest growth per hour after the warm-up that we accept, in percent of the series' mean."""
console = Console(width=120)


def rss_kb(pid: int | None) -> int | None:
    """Resident set size of ``pid`` in KiB (None when it is gone)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def processes(cluster: LocalCluster) -> dict[str, int | None]:
    """Name -> pid of every process the cluster started."""
    procs: dict[str, ManagedProcess | None] = {}
    if isinstance(cluster.redis, RedisCluster):  # a Redis Cluster's nodes, each by name
        procs.update({f"redis-{i}": n for i, n in enumerate(cluster.redis.nodes)})
    else:
        procs["redis"] = cluster.redis
    procs.update({"coordinator": cluster.coordinator, "producer": cluster.producer})
    brokers = cluster.kafka.nodes if cluster.kafka is not None else []
    procs.update({"kafka" if len(brokers) == 1 else f"kafka-{b.node_id}": b for b in brokers})
    procs.update({"ps" if len(cluster.ps) == 1 else f"ps-{g}": p for g, p in enumerate(cluster.ps)})
    procs.update({f"trainer-{i}": t for i, t in enumerate(cluster.trainers)})
    return {name: p.pid if p is not None else None for name, p in procs.items()}


def count_keys(client: redis_lib.Redis, pattern: str) -> int:
    """Keys matching ``pattern`` (SCAN: the soak's Redis is a single node)."""
    return sum(1 for _ in client.scan_iter(match=pattern, count=1000))


def redis_sizes(client: redis_lib.Redis, keys: JobKeys, groups: int) -> dict[str, int]:
    """Redis's used_memory and the lengths of the job's keys that could grow (in the job's slot, and
    the gradient blobs in its ``groups`` groups' slots)."""
    pipe = client.pipeline(transaction=False)
    pipe.info("memory")
    pipe.xlen(keys.applied_samples)
    pipe.xlen(keys.update_log)
    pipe.hlen(keys.clocks)
    pipe.hlen(keys.departed)
    pipe.get(keys.unapplied)
    mem, samples, log, clocks, departed, unapplied = pipe.execute()
    return {"used_memory": int(mem["used_memory"]), "applied_samples": samples, "log": log,
            "unapplied": int(unapplied or 0), "clocks": clocks, "departed": departed,
            # updates some group has not reported yet, and gradient blobs (of logged updates not yet
            # persisted by their group, or orphans awaiting the sweep)
            "applied_by": count_keys(client, keys.applied_by("*")),
            "grad_blobs": sum(count_keys(client, keys.group(g).update_blob("*", "*")) for g in range(groups))}


def growth_pct_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) per hour, relative to the mean value, in percent."""
    n = len(points)
    if n < 2:
        return float("nan")
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0 or mv == 0:
        return float("nan")
    slope = sum((t - mt) * (v - mv) for t, v in points) / var  # per second
    return 100.0 * slope * 3600.0 / mv


def run(args: argparse.Namespace) -> dict[str, Any]:
    # the services read their variables (STREAMTRAIN_PS_AUDIT_HORIZON_S, ...) over the local defaults
    spec = ClusterSpec(producer=replace(LOCAL_STREAM, source="digits?repeat=0", rate=args.rate)
                       ).with_environment(os.environ)
    keys = JobKeys(spec.job)
    samples: list[dict[str, Any]] = []
    with LocalCluster(spec, workdir=args.workdir) as cluster:
        client = redis_lib.Redis.from_url(cluster.redis_url)
        try:
            cluster.wait_for(lambda st: len(st["members"]) == spec.trainers and (st["versions"]["model"] or 0) > 0,
                             timeout_s=180, what="the trainers training")
            groups = ParameterStore(client, spec.job).meta().groups
            t0 = time.monotonic()
            end = t0 + args.minutes * 60
            while True:
                cluster.raise_if_crashed()
                now = time.monotonic()
                rss = {name: rss_kb(pid) for name, pid in processes(cluster).items()}
                sample: dict[str, Any] = {"t_s": round(now - t0, 2), "rss_kb": rss,
                                          "redis": redis_sizes(client, keys, groups)}
                samples.append(sample)
                sizes = sample["redis"]
                print(f"{sample['t_s']:6.0f}s  rss MiB " + " ".join(f"{k} {v / 1024:.0f}" for k, v in rss.items()
                                                                   if v is not None)
                      + f" | redis used {sizes['used_memory'] / 2**20:.1f} MiB, applied_samples "
                      f"{sizes['applied_samples']}, log {sizes['log']}, blobs {sizes['grad_blobs']}", flush=True)
                if now >= end:
                    break
                time.sleep(min(args.every_s, max(0.0, end - time.monotonic())))
        finally:
            client.close()
    warmup_s = args.warmup_minutes * 60
    steady = [s for s in samples if s["t_s"] >= warmup_s]
    series: dict[str, list[tuple[float, float]]] = {}
    for s in steady:
        for name, kb in s["rss_kb"].items():
            if kb is not None:
                series.setdefault(f"rss {name}", []).append((s["t_s"], kb * 1024))
        series.setdefault("redis used_memory", []).append((s["t_s"], s["redis"]["used_memory"]))
    fits = {name: {"mean_bytes": sum(v for _, v in pts) / len(pts), "first_bytes": pts[0][1],
                   "last_bytes": pts[-1][1], "growth_pct_per_hour": growth_pct_per_hour(pts), "samples": len(pts)}
            for name, pts in series.items()}
    return {"minutes": args.minutes, "warmup_minutes": args.warmup_minutes, "every_s": args.every_s,
            "rate": args.rate, "audit_horizon_s": os.environ.get("STREAMTRAIN_PS_AUDIT_HORIZON_S", "600 (default)"),
            "fits": fits, "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the run")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="samples left out of the fit (default: a quarter of the run)")
    parser.add_argument("--rate", type=float, default=1500.0, help="records/s the producer streams")
    parser.add_argument("--every-s", type=float, default=10.0, help="sampling period")
    parser.add_argument("--workdir", type=Path, default=harness.RESULTS_DIR / "soak-run")
    args = parser.parse_args()
    if args.minutes <= 0 or args.every_s <= 0:
        parser.error("--minutes and --every-s must be > 0")
    if args.warmup_minutes is None:
        args.warmup_minutes = args.minutes / 4
    if not 0 <= args.warmup_minutes < args.minutes:
        parser.error("--warmup-minutes must be in [0, --minutes)")
    harness.start()
    shutil.rmtree(args.workdir, ignore_errors=True)  # logs of the previous run; data starts empty
    results = run(args)
    table = Table(title=f"growth after a {args.warmup_minutes:g}-minute warm-up, {args.rate:,.0f} records/s")
    for col in ("series", "mean", "first", "last", "growth %/h"):
        table.add_column(col, justify="left" if col == "series" else "right")
    fits = results["fits"]
    for name, f in sorted(fits.items()):
        table.add_row(name, f"{f['mean_bytes'] / 2**20:.1f} MiB", f"{f['first_bytes'] / 2**20:.1f} MiB",
                      f"{f['last_bytes'] / 2**20:.1f} MiB", f"{f['growth_pct_per_hour']:+.2f}")
    console.print(table)
    rates = [f["growth_pct_per_hour"] for f in fits.values()]
    worst = max((r for r in rates if r == r), default=float("nan"))  # r == r: not NaN
    results["max_growth_pct_per_hour"] = worst
    harness.finish("soak", results,
                   [f"growth per hour after warm-up: max {worst:.2f}% (target <= {TARGET_PCT_PER_HOUR:g}%)"])


if __name__ == "__main__":
    main()
