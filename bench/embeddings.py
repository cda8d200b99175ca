"""Embedding tables in the parameter plane against a plain local PyTorch loop, in one run.

The stream: the ``clicks`` source shaped like Criteo (26 categorical features with
Zipf-distributed IDs, exponent 1.1, from a vocabulary of 10 million IDs in all; 13
dense features; a hidden logistic truth that drifts slowly). The model: the built-in
ranking model (``dlrm``, embedding dimension 16), batch 512, tables updated by lazy
Adam (the rows' ``SparseAdam``), the dense part by Adam.

1. **Peer**: a plain local PyTorch loop over the same training records, in memory:
   one ``nn.EmbeddingBag(sparse=True)`` per feature holding every row the stream
   touches (IDs mapped to rows up front, as a user with data at rest would), the
   same dense module, ``SparseAdam`` for the tables and ``Adam`` for the dense part,
   one thread. Samples/s over the pass (data loading excluded).
2. **Pipeline, one trainer** (one thread) and **two trainers** (one thread each):
   everything real (Kafka, Redis, the coordinator, the parameter server); the data
   is produced first, so the producer is not what is measured; samples/s counts the
   samples the server applied, from the first to the last applied update. Dense part
   SSP s = 2 (the job default); tables ASP with a cached row used for at most 4 more
   steps (``--table-consistency asp --table-staleness 4``: 8 or 16 cache more rows
   but cost AUC, 0.039 at 16 in one run). One shard group (the default): on two
   cores a second server process only adds its fixed costs (2 groups: 0.32 of the
   local loop against 0.42 with one, in the runs that chose this).
3. What moves and what it costs: the bytes the trainer's row pulls read per step
   over the rows the batch needs (unique IDs x dim x 4), Redis's memory of the rows
   (``MEMORY USAGE``) over their raw bytes (values and optimizer state), and the
   trainer's peak RSS at two table sizes (a short run and the full one).
4. Quality: held-out AUC and log loss, on the test-split records of the last 10 % of
   the stream, of the pipeline's parameters (dense snapshot and rows read from Redis)
   and of the local loop's.
5. CPU: each process's CPU (user + system, all its threads and children, from
   ``/proc/<pid>/stat``: ``bench.harness.CpuSampler``) over the window samples/s
   counts, per 1,000 records applied: every trainer, the parameter server, the
   coordinator, Redis and the Kafka broker, and their sum; against the local loop's
   process CPU over its timed loop (``ratio pipeline CPU / local loop CPU``). And
   Redis's CPU per applied update, and where it went: Redis's own account of its
   commands (``INFO commandstats``, from the trainers' start to the last record
   consumed), the costliest per applied update.
6. Configurations: the runs above are of the default one (``--value-dtype``: the
   rows' values in Redis, the model's ``value_dtype`` option; ``--row-prefetch D``:
   the trainers' setting, batches whose rows they fetch ahead), and the ratios are
   its. ``--dtype-sweep float16,bfloat16`` and ``--prefetch-sweep 0,1,4`` also run
   one trainer per configuration that changes one knob from the default (each dtype
   at the default depth, each depth at the default dtype), against the same local
   loop, and print per configuration samples/s, held-out AUC and its gap, Redis
   bytes per row and CPU per 1,000 records (a configuration that fails is reported
   and skipped); without them the run is the default's alone, as fast as before.

Writes ``bench/results/embeddings.json``; prints the ratios last.

    .venv/bin/python bench/embeddings.py [--records 200000] [--vocab 10000000]
        [--value-dtype float32] [--row-prefetch D] [--dtype-sweep D,D] [--prefetch-sweep N,N]
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import numpy as np
import redis as redis_lib
import torch
from rich.console import Console
from rich.table import Table

from bench import harness
from bench.pipeline import step_phases
from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from datastream import load_source, produce
from datastream.examples import Examples
from services import ParameterStore, connect
from services.protocol import AccountingRecord
from services.tables.rows import row_dtype
from services.tables.store import pull_rows
from streamtrain.cluster import LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.launcher import free_port
from trainers.models import build_model
from trainers.tables import plan_lookups, pool

console = Console(width=120)

BATCH = 512
DIM = 16
ROW_LR = 0.01
GROUPS = 1
TABLE_S = 4

DENSE_LR = 0.001
DTYPES = ("float32", "float16", "bfloat16")
"""The rows' value dtypes the bench compares (the model's ``value_dtype`` option)."""


def source_spec(vocab: int, limit: int) -> str:
    return f"clicks?features=26&dense=13&vocab={vocab}&zipf=1.1&seed=7&limit={limit}"


def model_spec(value_dtype: str = "float32") -> str:
    """The ranking model; ``value_dtype`` other than float32 is its ``value_dtype`` option (rows' values in Redis)."""
    dtype = "" if value_dtype == "float32" else f"&value_dtype={value_dtype}"
    return f"dlrm?features=26&dense=13&dim={DIM}&row_lr={ROW_LR}{dtype}"


@dataclass(frozen=True)
class Config:
    """A configuration of the pipeline's tables the bench compares."""

    value_dtype: str = "float32"
    """The rows' values in Redis: the model's ``value_dtype`` option."""
    row_prefetch: int = LOCAL_TRAINER.row_prefetch
    """The trainers' ``row_prefetch`` (``--row-prefetch``): batches whose rows are fetched ahead."""

    @property
    def label(self) -> str:
        return f"{self.value_dtype}, row prefetch {self.row_prefetch}"


def held_out(vocab: int, limit: int) -> Examples:
    """The test-split records of the last 10 % of the stream's ``limit`` records."""
    test = load_source(source_spec(vocab, limit), split="test").read()
    return test.slice(int(0.9 * len(test)), len(test))


# -- the peer: a plain local loop --------------------------------------------------------------------

def local_loop(vocab: int, limit: int, threads: int) -> dict[str, Any]:
    """One pass of a plain local PyTorch loop over the training records in memory."""
    torch.set_num_threads(threads)
    train = load_source(source_spec(vocab, limit), split="train").read()
    evals = held_out(vocab, limit)
    spec = build_model(model_spec())
    model = spec.model
    names = [t.name for t in spec.tables]
    bags, maps = {}, {}
    rows = 0
    for name in names:  # every ID the stream touches gets a row (the eval set's too): a vocabulary
        ids = np.unique(np.concatenate([train.ids[name].values, evals.ids[name].values]))
        maps[name] = ids
        rows += ids.size
        bag = torch.nn.EmbeddingBag(ids.size, DIM, mode="sum", sparse=True)
        with torch.no_grad():  # the same initial rows the parameter plane gives each ID
            from services.tables import initial_rows
            bag.weight.copy_(torch.from_numpy(initial_rows(spec.tables[names.index(name)], ids)))
        bags[name] = bag
    index = {name: torch.from_numpy(np.searchsorted(maps[name], train.ids[name].values)) for name in names}
    offsets = {name: train.ids[name].offsets for name in names}
    x = torch.from_numpy(train.x).float()
    y = torch.from_numpy(train.y)
    sparse = torch.optim.SparseAdam([b.weight for b in bags.values()], lr=ROW_LR)
    dense = torch.optim.Adam(model.parameters(), lr=DENSE_LR)
    n = len(train)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for start in range(0, n - BATCH + 1, BATCH):
        stop = start + BATCH
        pooled = {}
        for name in names:
            lo, hi = int(offsets[name][start]), int(offsets[name][stop])
            pooled[name] = bags[name](index[name][lo:hi],
                                      torch.from_numpy(offsets[name][start:stop] - lo))
        loss = spec.loss_fn(model(x[start:stop], pooled), y[start:stop])
        sparse.zero_grad()
        dense.zero_grad()
        loss.backward()
        sparse.step()
        dense.step()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = n // BATCH
    auc, logloss = _score_local(model, bags, maps, names, evals, spec)
    return {"samples": steps * BATCH, "samples_per_s": steps * BATCH / seconds, "seconds": seconds, "rows": rows,
            "auc": auc, "log_loss": logloss, "cpu_s": cpu, "cpu_ms_per_1k": cpu * 1e6 / (steps * BATCH)}


@torch.no_grad()
def _score_local(model: torch.nn.Module, bags: dict, maps: dict, names: list[str], evals: Examples,
                 spec: object) -> tuple[float, float]:
    from sklearn.metrics import log_loss, roc_auc_score
    pooled = {name: bags[name](torch.from_numpy(np.searchsorted(maps[name], evals.ids[name].values)),
                               torch.from_numpy(evals.ids[name].offsets[:-1])) for name in names}
    logits = model(torch.from_numpy(evals.x).float(), pooled).numpy()
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    return float(roc_auc_score(evals.y, logits)), float(log_loss(evals.y, p, labels=[0, 1]))


# -- the pipeline ---------------------------------------------------------------------------------

def job(name: str, threads: int, metrics_port: int, config: Config) -> ClusterSpec:
    trainer = replace(LOCAL_TRAINER, model=model_spec(config.value_dtype), batch_size=BATCH, threads=threads,
                      eval_source="", prefetch=8, metrics_port=metrics_port, row_prefetch=config.row_prefetch)
    return ClusterSpec(job=name, topic=name, trainers=0, producer=None,
                       coordinator=CoordinatorSettings(partitions=4, ps_groups=GROUPS, optimizer="adam", lr=DENSE_LR,
                                                       codec="none", table_consistency="asp", table_staleness=TABLE_S),
                       trainer=trainer)


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _rss_mb(pid: int, field: str = "VmHWM") -> float:
    """A process's peak (``VmHWM``) or current (``VmRSS``) resident memory, MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _watch_memory(cluster: LocalCluster, out: list[tuple[float, int, float]]) -> None:
    """Every 2 s until the stream is consumed: the tables' rows and the first trainer's resident memory."""
    t0 = time.monotonic()
    while not cluster.consumed(cluster.status() or {}):
        try:
            rows, _ = _rows(cluster, usage=False)
            out.append((time.monotonic() - t0, rows, _rss_mb(cluster.trainers[0].pid or 0, "VmRSS")))
        except (OSError, redis_lib.RedisError):
            return
        time.sleep(2.0)


def _rows(cluster: LocalCluster, *, usage: bool = True) -> tuple[int, int]:
    """(rows of every table over every group, Redis bytes of their hashes by MEMORY USAGE, all of
    each: ``SAMPLES 0``; 0 without ``usage``)."""
    client = redis_lib.Redis.from_url(cluster.redis_url)
    try:
        keys = [JobKeys(cluster.spec.job).group(g).table_rows(f"c{i}") for g in range(GROUPS) for i in range(1, 27)]
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.hlen(k)
            if usage:
                pipe.memory_usage(k, samples=0)
        got = pipe.execute()
    finally:
        client.close()
    if not usage:
        return sum(got), 0
    return sum(got[0::2]), sum(v or 0 for v in got[1::2])


def pipeline(vocab: int, limit: int, trainers: int, threads: int, workdir: Path,
             config: Config = Config()) -> dict[str, Any]:
    """Samples/s the servers applied with ``trainers`` trainers on pre-produced records, what it moved, and
    the CPU each process spent over the same window (from the first to the last applied update)."""
    port = free_port() if trainers == 1 else 0  # trainers of one cluster share their settings: one port
    spec = job("emb", threads, port, config)
    with LocalCluster(spec, workdir=workdir) as cluster:
        report = produce(cluster.bootstrap, spec.topic, source_spec(vocab, limit), partitions=spec.partitions,
                         shard_size=BATCH, split="train")
        for _ in range(trainers):
            cluster.add_trainer()
        memory: list[tuple[float, int, float]] = []  # (seconds, rows, the first trainer's RSS MB)
        watch = threading.Thread(target=_watch_memory, args=(cluster, memory), daemon=True)
        watch.start()
        commands = harness.redis_commands(cluster.redis_url)
        with harness.CpuSampler(harness.cluster_pids(cluster)) as cpu:
            cluster.wait_consumed(timeout_s=1800)
            commands = harness.command_usage(commands, harness.redis_commands(cluster.redis_url))
            metrics = _metrics(port) if port else {}
            rss = _rss_mb(cluster.trainers[0].pid or 0)
            phases = step_phases(cluster)
            cluster.quiesce()
        client = redis_lib.Redis.from_url(cluster.redis_url)
        try:
            raw = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(JobKeys(spec.job).applied_samples))
            entries = [AccountingRecord.from_fields(f) for _, f in raw]
        finally:
            client.close()
        entries = [e for e in entries if e.batch_size > 0]
        rows, redis_bytes = _rows(cluster)
        score = _score_pipeline(cluster, held_out(vocab, limit), config) if trainers == 1 else None
    samples = sum(e.batch_size for e in entries)
    span = (entries[-1].applied_ms - entries[0].applied_ms) / 1000
    cpu_s = cpu.between(entries[0].applied_ms / 1000, entries[-1].applied_ms / 1000)
    lookups = metrics.get("streamtrain_row_cache_hits_total", 0) + metrics.get("streamtrain_row_cache_misses_total", 0)
    out: dict[str, Any] = {
        "trainers": trainers, "samples": samples, "produced": report.records, "samples_per_s": samples / span,
        "span_s": span, "updates": len(entries), "rows": rows, "redis_bytes": redis_bytes,
        "pull_bytes": metrics.get("streamtrain_row_pull_bytes_total", 0.0), "row_lookups": lookups,
        "cache_hit_rate": metrics.get("streamtrain_row_cache_hit_rate"), "trainer_peak_rss_mb": rss,
        "step_ms": phases, "memory": memory, "config": config.label, "cpu_s": cpu_s,
        "cpu_ms_per_1k": {name: s * 1e6 / samples for name, s in cpu_s.items()},
        "cpu_ms_per_1k_sum": sum(cpu_s.values()) * 1e6 / samples,
        "redis_cpu_ms_per_update": cpu_s.get("redis", math.nan) * 1000 / len(entries),
        "redis_commands": {name: {"calls": c, "usec": u, "ms_per_update": u / 1000 / len(entries)}
                           for name, (c, u) in commands.items()}}
    if score is not None:
        out.update(auc=score[0], log_loss=score[1])
    return out


@torch.no_grad()
def _score_pipeline(cluster: LocalCluster, evals: Examples, config: Config) -> tuple[float, float]:
    """AUC and log loss of the parameters the job stores (a dense snapshot, and the rows of the held-out
    records' IDs as they are now), scored like the local loop's."""
    from sklearn.metrics import log_loss, roc_auc_score

    spec = build_model(model_spec(config.value_dtype))
    tables = {t.name: t for t in spec.tables}
    client = connect(cluster.redis_url)
    try:
        store = ParameterStore(client, cluster.spec.job)
        spec.model.load_state_dict(store.pull().tensors)
        groups = store.meta().groups
        lookups = plan_lookups(tables, evals.ids, len(evals))
        got = pull_rows(client, cluster.spec.job, tables, groups, {n: lk.ids for n, lk in lookups.items()})
    finally:
        client.close()
    pooled, _ = pool(lookups, {n: r.values for n, r in got.tables.items()}, torch.device("cpu"))
    logits = spec.model(torch.from_numpy(evals.x).float(), pooled).numpy()
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    return float(roc_auc_score(evals.y, logits)), float(log_loss(evals.y, p, labels=[0, 1]))


def sweep_configs(default: Config, dtypes: list[str], depths: list[int]) -> list[Config]:
    """One knob at a time from the default: every listed value dtype at the default prefetch depth, and
    every listed depth at the default dtype (none when both lists are empty: no sweep)."""
    configs = [Config(d, default.row_prefetch) for d in dtypes] + [Config(default.value_dtype, p) for p in depths]
    return list(dict.fromkeys(configs))


def _cpu_table(local: dict[str, Any], runs: dict[str, dict[str, Any]]) -> Table:
    """CPU ms per 1,000 records of every process of each run, their sum, and Redis's per applied update."""
    order = list(dict.fromkeys(n for r in runs.values() for n in r["cpu_ms_per_1k"]))
    names = sorted(order, key=lambda n: (not n.startswith("trainer"), order.index(n)))
    table = Table(title="CPU ms per 1,000 records (pipeline: from the first to the last applied update; "
                        "local loop: its timed loop)")
    for col in ("", "local loop", *(f"pipeline {name}" for name in runs)):
        table.add_column(col)
    for n in names:
        table.add_row(n, "", *(f"{r['cpu_ms_per_1k'][n]:.1f}" if n in r["cpu_ms_per_1k"] else ""
                               for r in runs.values()))
    table.add_row("sum", f"{local['cpu_ms_per_1k']:.1f}", *(f"{r['cpu_ms_per_1k_sum']:.1f}" for r in runs.values()))
    table.add_row("Redis ms per applied update", "", *(f"{r['redis_cpu_ms_per_update']:.1f}" for r in runs.values()))
    return table


def _sweep_table(local: dict[str, Any], runs: dict[str, dict[str, Any]]) -> Table:
    """One row per configuration (one trainer each): throughput, quality, Redis bytes and CPU."""
    table = Table(title="configurations, 1 trainer each (CPU: ms per 1,000 records; Redis: ms per applied update)")
    table.add_column("", no_wrap=True)
    for col in ("samples/s", "/ loop", "AUC", "AUC gap", "Redis B/row", "CPU", "trainer", "Redis"):
        table.add_column(col)
    for label, r in runs.items():
        table.add_row(label, f"{r['samples_per_s']:,.0f}", f"{r['samples_per_s'] / local['samples_per_s']:.3f}",
                      f"{r['auc']:.4f}", f"{local['auc'] - r['auc']:.4f}", f"{r['redis_bytes'] / r['rows']:.0f}",
                      f"{r['cpu_ms_per_1k_sum']:.0f}", f"{r['cpu_ms_per_1k'].get('trainer 1', math.nan):.0f}",
                      f"{r['redis_cpu_ms_per_update']:.1f}")
    return table


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _dtypes(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in out if v not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"value dtypes are {', '.join(DTYPES)}, not {', '.join(bad)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=250_000,
                    help="records of the stream (its train split is trained on)")
    ap.add_argument("--vocab", type=int, default=10_000_000, help="IDs in all, over the 26 features")
    ap.add_argument("--small", type=int, default=50_000, help="records of the short run (the smaller tables)")
    ap.add_argument("--threads", type=int, default=1, help="threads of the local loop and of each trainer")
    ap.add_argument("--value-dtype", default="float32", choices=DTYPES,
                    help="the rows' values in Redis (the model's value_dtype option), default configuration")
    ap.add_argument("--row-prefetch", type=int, default=LOCAL_TRAINER.row_prefetch,
                    help="the trainers' --row-prefetch, default configuration")
    ap.add_argument("--dtype-sweep", type=_dtypes, default=[], metavar="D,D",
                    help="also run one trainer with each of these value dtypes (at the default depth)")
    ap.add_argument("--prefetch-sweep", type=_ints, default=[], metavar="N,N",
                    help="also run one trainer with each of these --row-prefetch depths (at the default dtype)")
    ap.add_argument("--workdir", default="/tmp/streamtrain-bench-embeddings")
    args = ap.parse_args()
    default = Config(args.value_dtype, args.row_prefetch)
    harness.start()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)

    console.print(f"[bold]local loop[/] over {args.records:,} records (train split), vocabulary {args.vocab:,}")
    local = local_loop(args.vocab, args.records, args.threads)
    console.print(local)
    runs = {}
    for name, trainers, limit in (("small", 1, args.small), ("one", 1, args.records), ("two", 2, args.records)):
        console.print(f"[bold]pipeline[/] {name}: {trainers} trainer(s), {limit:,} records")
        runs[name] = pipeline(args.vocab, limit, trainers, args.threads, workdir / name, default)
        console.print(runs[name])
    sweep, failed = {}, {}  # the configurations other than the default, one trainer each
    for i, config in enumerate(sweep_configs(default, args.dtype_sweep, args.prefetch_sweep)):
        if config != default:
            console.print(f"[bold]pipeline[/] {config.label}: 1 trainer, {args.records:,} records")
            try:
                sweep[config.label] = pipeline(args.vocab, args.records, 1, args.threads, workdir / f"sweep{i}",
                                               config)
            except Exception as exc:  # noqa: BLE001 - one configuration failing leaves the others
                failed[config.label] = f"{type(exc).__name__}: {exc}"
                console.print(f"[red]{config.label} failed:[/] {failed[config.label][-2000:]}")
                continue
            console.print(sweep[config.label])
    one, two, small = runs["one"], runs["two"], runs["small"]
    stored = row_dtype(build_model(model_spec(default.value_dtype)).tables[0])
    raw_bytes = stored["values"].itemsize + stored["state"].itemsize  # a row's values and optimizer state, as stored
    ratios = {
        "pull_bytes_per_needed": one["pull_bytes"] / (one["row_lookups"] * DIM * 4),
        "redis_bytes_per_raw_row": one["redis_bytes"] / one["rows"] / raw_bytes,
        "two_over_one": two["samples_per_s"] / one["samples_per_s"],
        "one_over_local": one["samples_per_s"] / local["samples_per_s"],
        "auc_gap": local["auc"] - one["auc"],
        "pipeline_cpu_over_local": one["cpu_ms_per_1k_sum"] / local["cpu_ms_per_1k"],
    }
    table = Table(title="embeddings: the pipeline against a plain local loop (one run)")
    for col in ("", "samples/s", "rows", "AUC", "log loss", "peak RSS MB", "cache hits"):
        table.add_column(col)
    table.add_row("local loop", f"{local['samples_per_s']:,.0f}", f"{local['rows']:,}", f"{local['auc']:.4f}",
                  f"{local['log_loss']:.4f}", "", "")
    for name, r in runs.items():
        table.add_row(f"pipeline {name} ({r['trainers']} trainer)", f"{r['samples_per_s']:,.0f}", f"{r['rows']:,}",
                      f"{r['auc']:.4f}" if r.get("auc") is not None else "",
                      f"{r['log_loss']:.4f}" if r.get("log_loss") is not None else "",
                      f"{r['trainer_peak_rss_mb']:.0f}", f"{r['cache_hit_rate']:.2f}" if r["cache_hit_rate"] else "")
    console.print(table)
    console.print(_cpu_table(local, runs))
    if sweep:
        console.print(_sweep_table(local, {f"{default.label} (default)": one, **sweep}))
    console.print(f"one trainer, ms per step: { {k: round(v, 1) for k, v in one['step_ms'].items()} }")
    for name, run in runs.items():  # where Redis's time went (its own account, from the trainers' start)
        top = list(run["redis_commands"].items())[:8]
        console.print(f"Redis, pipeline {name}, ms per applied update by command: " + ", ".join(
            f"{cmd} {v['ms_per_update']:.1f} ({v['calls'] / run['updates']:.1f} calls)" for cmd, v in top))
    curve = one["memory"]
    if curve:
        console.print("one trainer's resident memory as the tables grow: " + ", ".join(
            f"{rows:,} rows {rss:.0f} MB" for _, rows, rss in curve[::max(1, len(curve) // 8)]))
    cpu_one = ", ".join(f"{n} {v:.0f}" for n, v in one["cpu_ms_per_1k"].items())
    narrow = [(label, r) for label, r in sweep.items()  # the other dtypes at the default depth
              if not label.startswith(f"{default.value_dtype},") and label.endswith(f" {default.row_prefetch}")]
    lines = [f"redis bytes per row, {label.split(',')[0]} / {default.value_dtype}: "
             f"{(r['redis_bytes'] / r['rows']) / (one['redis_bytes'] / one['rows']):.3f} "
             f"(held-out AUC {r['auc']:.4f} against {one['auc']:.4f})" for label, r in narrow]
    harness.finish("embeddings", {"records": args.records, "vocab": args.vocab, "config": default.label,
                                  "local": local, "runs": runs, "sweep": sweep, "sweep_failed": failed,
                                  "ratios": ratios}, [
        f"trainer peak RSS: {small['trainer_peak_rss_mb']:.0f} MB at {small['rows']:,} rows",
        f"trainer peak RSS: {one['trainer_peak_rss_mb']:.0f} MB at {one['rows']:,} rows",
        f"pull bytes per step / (unique ids x dim x 4): {ratios['pull_bytes_per_needed']:.3f}",
        f"redis bytes per row / raw row bytes: {ratios['redis_bytes_per_raw_row']:.3f}",
        *lines,
        (f"held-out AUC: pipeline {one['auc']:.4f}, local loop {local['auc']:.4f}; "
         f"log loss: pipeline {one['log_loss']:.4f}, local loop {local['log_loss']:.4f}"),
        (f"CPU ms per 1,000 records: pipeline (1 trainer) {one['cpu_ms_per_1k_sum']:.0f} ({cpu_one}); "
         f"local loop {local['cpu_ms_per_1k']:.0f}"),
        f"Redis CPU per applied update (1 trainer): {one['redis_cpu_ms_per_update']:.1f} ms",
        f"auc gap, local loop - pipeline, embeddings: {ratios['auc_gap']:.4f}",
        f"ratio 2 trainers / 1 trainer, embeddings: {ratios['two_over_one']:.3f}",
        f"ratio 1 trainer / local loop, embeddings: {ratios['one_over_local']:.3f}",
        f"ratio pipeline CPU / local loop CPU, embeddings: {ratios['pipeline_cpu_over_local']:.3f}",
    ])
    shutil.rmtree(workdir, ignore_errors=True)
    assert math.isfinite(ratios["one_over_local"])


if __name__ == "__main__":
    main()
