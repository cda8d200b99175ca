"""Online recommendation on MovieLens-100K, end to end, against a plain local PyTorch loop, in one run.

The data: MovieLens-100K's ratings replayed in time order (label 1 for a rating of 4 or more), the
first 90 % trained on once, the last 10 % by time held out (``datastream.movielens``). The model and
the job's settings: those of ``up --example movielens`` (``streamtrain.examples``): the ranking
model ``dlrm?schema=movielens`` (one table per feature, in the parameter plane), dense part by Adam
sent whole (``codec none``), rows by lazy Adam, tables ASP with a cached row used for at most 4 more
steps, dense part SSP s = 2, batch 64 (the trainers' default).

1. **Local loop** (the peer): the same model with one ``nn.EmbeddingBag(sparse=True)`` per feature
   holding every ID of the data set (mapped to rows up front, starting at the rows the parameter
   plane gives each ID), ``SparseAdam`` for the rows and ``Adam`` for the dense part, one thread, one
   pass in time order. Records/s over the pass (data loading excluded); held-out AUC and log loss,
   the mean over ``--seeds`` seeds (one seed's AUC moves by a few thousandths).
2. **Pipeline, one trainer and two trainers** (one thread each), everything real (Kafka, Redis, the
   coordinator, one parameter server); the train split is produced first into 4 partitions, so the
   producer is not what is measured. Records/s counts the records the server applied, from the
   first to the last applied update. Quality: the held-out AUC and log loss of what Redis holds at
   the end (``streamtrain.scoring.score_job``: the dense snapshot and the rows of the held-out IDs).
   Progressive validation (``docs/online.md``): each trainer scores every 2,000 of its records
   before training on them; the job's AUC over the first and the last tenth of the records scored.
   Each is run ``--repeats`` times and the figures are the means: one run's held-out AUC moves by
   up to 0.01 from one run to the next (the order in which two trainers' updates interleave).
3. **The serving feed at half capacity**: two trainers consume while the producer streams at half
   the records/s two trainers reached in (2); a consumer polls ``GET /v1/model/updates`` every 50 ms
   and measures, for each changelog entry, the time from its apply (Redis's clock) to the answer
   that carried it (``coordinator.feed_copy.measure_feed_lag``): p50 and p99.

Writes ``bench/results/recommendation.json``; prints the AUC gap last.

    .venv/bin/python bench/recommendation.py [--seeds 3] [--repeats 3] [--lag-s 40] [--row-prefetch D]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from sklearn.metrics import log_loss, roc_auc_score

from bench import harness
from coordinator.feed_copy import fetch_changes, measure_feed_lag
from coordinator.progressive import mean_auc
from coordinator.settings import CoordinatorSettings
from datastream import Examples, load_source, produce
from services.tables import initial_rows
from streamtrain.cluster import LOCAL_TRAINER, ClusterSpec, LocalCluster
from streamtrain.examples import EXAMPLES
from streamtrain.scoring import score_job
from trainers.models import build_model

console = Console(width=120)

EXAMPLE = EXAMPLES["movielens"]
SOURCE = str(EXAMPLE["source"])
MODEL = str(EXAMPLE["model"])
BATCH = LOCAL_TRAINER.batch_size
PARTITIONS = 4


# -- the peer: a plain local loop --------------------------------------------------------------------

def local_loop(seed: int) -> dict[str, float]:
    """One pass of a plain local PyTorch loop over the train split in time order; its records/s and
    held-out AUC and log loss."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    train = load_source(SOURCE, split="train").read()
    test = load_source(SOURCE, split="test").read()
    spec = build_model(MODEL, seed=seed)
    names = [t.name for t in spec.tables]
    bags, maps = {}, {}
    for table in spec.tables:
        ids = np.unique(np.concatenate([train.ids[table.name].values, test.ids[table.name].values]))
        bag = torch.nn.EmbeddingBag(ids.size, table.dim, mode=table.pooling, sparse=True)
        with torch.no_grad():  # the rows the parameter plane starts each ID with
            bag.weight.copy_(torch.from_numpy(initial_rows(table, ids)))
        bags[table.name], maps[table.name] = bag, ids
    row_lr = spec.tables[0].optimizer.lr

    def pooled(ex: Examples, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            col = ex.ids[name]
            lo, hi = int(col.offsets[start]), int(col.offsets[stop])
            out[name] = bags[name](torch.from_numpy(np.searchsorted(maps[name], col.values[lo:hi])),
                                   torch.from_numpy(col.offsets[start:stop] - lo))
        return out

    model = spec.model
    sparse = torch.optim.SparseAdam([b.weight for b in bags.values()], lr=row_lr)
    dense = torch.optim.Adam(model.parameters(), lr=float(EXAMPLE["lr"]))
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    t0 = time.perf_counter()
    for start in range(0, len(train), BATCH):
        stop = min(start + BATCH, len(train))
        loss = spec.loss_fn(model(x[start:stop], pooled(train, start, stop)), y[start:stop])
        sparse.zero_grad()
        dense.zero_grad()
        loss.backward()
        sparse.step()
        dense.step()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        logits = model(torch.from_numpy(test.x), pooled(test, 0, len(test))).double().numpy()
    p = 1.0 / (1.0 + np.exp(-logits))
    return {"seed": seed, "auc": float(roc_auc_score(test.y, logits)),
            "log_loss": float(log_loss(test.y, p, labels=[0, 1])), "records": len(train),
            "records_per_s": len(train) / seconds}


# -- the pipeline ---------------------------------------------------------------------------------

def job(name: str, row_prefetch: int = LOCAL_TRAINER.row_prefetch) -> ClusterSpec:
    """The example's job, with no trainer and no producer started (the bench adds them); ``row_prefetch``:
    the trainers' ``--row-prefetch``."""
    return ClusterSpec(
        job=name, topic=name, trainers=0, producer=None,
        coordinator=CoordinatorSettings(partitions=PARTITIONS, optimizer=str(EXAMPLE["optimizer"]),
                                        lr=float(EXAMPLE["lr"]), codec=str(EXAMPLE["codec"]),
                                        table_consistency=str(EXAMPLE["table_consistency"]),
                                        table_staleness=int(EXAMPLE["table_staleness"])),
        trainer=replace(LOCAL_TRAINER, model=MODEL, threads=1, eval_source="", prefetch=8,
                        row_prefetch=row_prefetch))


def pipeline(trainers: int, workdir: Path, row_prefetch: int = LOCAL_TRAINER.row_prefetch) -> dict[str, Any]:
    """One pass of the train split, produced first, through ``trainers`` trainers: records/s applied,
    the held-out AUC and log loss of what Redis holds, and the progressive validation."""
    spec = job("movielens", row_prefetch)
    with LocalCluster(spec, workdir=workdir) as cluster:
        report = produce(cluster.bootstrap, spec.topic, SOURCE, partitions=spec.partitions, shard_size=BATCH,
                         split="train")
        for _ in range(trainers):
            cluster.add_trainer()
        cluster.wait_consumed(timeout_s=1200)
        cluster.quiesce()
        entries = harness.applied_entries(cluster)
        progressive = cluster.progressive() or {}
        score = score_job(cluster.redis_url, spec.job, MODEL, SOURCE)
    samples = sum(e.batch_size for e in entries)
    span = (entries[-1].applied_ms - entries[0].applied_ms) / 1000
    series = progressive.get("job") or {}
    return {"trainers": trainers, "produced": report.records, "samples": samples, "span_s": span,
            "records_per_s": samples / span, "auc": score.auc, "log_loss": score.loss,
            "progressive_first": mean_auc(series, 0.0, 0.1) if series else None,
            "progressive_last": mean_auc(series, 0.9, 1.0) if series else None,
            "progressive_points": len(series.get("records", [])) if series else 0}


def _mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each figure over ``runs`` (None where a run has none)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = None if any(v is None for v in values) else float(np.mean(values))
    return out


def feed_lag(trainers: int, rate: float, seconds: float, workdir: Path) -> dict[str, Any]:
    """The feed's lag from apply to a polling consumer while ``trainers`` trainers consume a stream
    produced at ``rate`` records/s."""
    spec = job("movielens-feed")
    with LocalCluster(spec, workdir=workdir) as cluster:
        for _ in range(trainers):
            cluster.add_trainer()
        cluster.wait_for(lambda st: len(st.get("members", [])) >= trainers, timeout_s=120, what="trainers")
        stop = threading.Event()
        produced: dict[str, int] = {}

        def stream() -> None:
            report = produce(cluster.bootstrap, spec.topic, f"{SOURCE}?repeat=0", partitions=spec.partitions,
                             shard_size=BATCH, split="train", rate=rate, stop=stop)  # passes until stopped
            produced["records"] = report.records

        producer = threading.Thread(target=stream, daemon=True)
        producer.start()
        deadline = time.monotonic() + 300  # the coordinator's first feed answer imports torch: warm it
        while time.monotonic() < deadline:
            try:
                fetch_changes(cluster.coordinator_url, cluster.job_token, "0", limit=1)
                break
            except Exception:  # noqa: BLE001 - no model yet, or the coordinator still starting
                time.sleep(0.5)
        begun_ms = time.time() * 1000
        lag = measure_feed_lag(cluster.coordinator_url, cluster.job_token, seconds=seconds)
        ended_ms = time.time() * 1000
        stop.set()
        producer.join(timeout=120)
        entries = harness.applied_entries(cluster)
    applied = [e for e in entries if begun_ms <= e.applied_ms <= ended_ms]
    return {"rate": rate, "entries": int(lag.entries), "p50_ms": lag.p50_ms, "p99_ms": lag.p99_ms,
            "max_ms": lag.max_ms, "produced": produced.get("records"),
            "applied_per_s": sum(e.batch_size for e in applied) / ((ended_ms - begun_ms) / 1000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the local loop (its AUC is their mean)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each pipeline (its figures are their means)")
    ap.add_argument("--lag-s", type=float, default=40.0, help="seconds the feed's lag is measured")
    ap.add_argument("--row-prefetch", type=int, default=LOCAL_TRAINER.row_prefetch,
                    help="the trainers' --row-prefetch (batches whose rows they fetch ahead)")
    ap.add_argument("--workdir", default="/tmp/streamtrain-bench-recommendation")
    args = ap.parse_args()
    harness.start()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)

    console.print(f"[bold]local loop[/], {args.seeds} seed(s)")
    local_runs = [local_loop(seed) for seed in range(args.seeds)]
    for r in local_runs:
        console.print(r)
    local = {k: float(np.mean([r[k] for r in local_runs])) for k in ("auc", "log_loss", "records_per_s")}
    repeats: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for repeat in range(args.repeats):
        for trainers in (1, 2):
            console.print(f"[bold]pipeline[/], {trainers} trainer(s), run {repeat + 1} of {args.repeats}")
            repeats[trainers].append(pipeline(trainers, workdir / f"t{trainers}-{repeat}", args.row_prefetch))
            console.print(repeats[trainers][-1])
    runs = {trainers: _mean(got) for trainers, got in repeats.items()}
    half = runs[2]["records_per_s"] / 2
    console.print(f"[bold]feed lag[/] at half capacity: {half:,.0f} records/s, two trainers, {args.lag_s:.0f} s")
    lag = feed_lag(2, half, args.lag_s, workdir / "lag")
    console.print(lag)
    two = runs[2]
    ratios = {"one_over_local": runs[1]["records_per_s"] / local["records_per_s"],
              "two_over_local": two["records_per_s"] / local["records_per_s"],
              "auc_gap": local["auc"] - two["auc"]}
    table = Table(title="MovieLens-100K: the pipeline against a plain local loop (one run)")
    for col in ("", "records/s", "held-out AUC", "log loss", "progressive AUC first/last tenth"):
        table.add_column(col)
    table.add_row(f"local loop (mean of {args.seeds})", f"{local['records_per_s']:,.0f}", f"{local['auc']:.4f}",
                  f"{local['log_loss']:.4f}", "")
    for trainers, r in runs.items():
        prog = (f"{r['progressive_first']:.4f} / {r['progressive_last']:.4f}"
                if r["progressive_first"] is not None and r["progressive_last"] is not None else "")
        table.add_row(f"pipeline, {trainers} trainer(s) (mean of {args.repeats})", f"{r['records_per_s']:,.0f}",
                      f"{r['auc']:.4f}", f"{r['log_loss']:.4f}", prog)
    console.print(table)
    print(f"feed lag at half capacity ({half:,.0f} records/s offered, {lag['applied_per_s']:,.0f} applied, "
          f"{lag['entries']} entries): p50 {lag['p50_ms']:.0f} ms, p99 {lag['p99_ms']:.0f} ms")
    for trainers, r in runs.items():
        if r["progressive_first"] is not None:
            print(f"progressive AUC, {trainers} trainer(s): first tenth {r['progressive_first']:.4f}, "
                  f"last tenth {r['progressive_last']:.4f}")
    for trainers, got in repeats.items():
        print(f"held-out AUC, {trainers} trainer(s), each run: " + ", ".join(f"{r['auc']:.4f}" for r in got))
    print(f"held-out AUC: local loop {local['auc']:.4f} (log loss {local['log_loss']:.4f}), "
          f"pipeline 1 trainer {runs[1]['auc']:.4f} ({runs[1]['log_loss']:.4f}), "
          f"2 trainers {two['auc']:.4f} ({two['log_loss']:.4f})")
    harness.finish("recommendation", {"local_runs": local_runs, "local": local, "runs": runs, "repeats": repeats,
                                      "feed_lag": lag, "ratios": ratios}, [
        f"ratio pipeline(1 trainer)/local loop, movielens: {ratios['one_over_local']:.3f}",
        f"ratio pipeline(2 trainers)/local loop, movielens: {ratios['two_over_local']:.3f}",
        f"auc gap, local loop - pipeline, movielens: {ratios['auc_gap']:.4f}"])
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
