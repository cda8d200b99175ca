"""Whole-pipeline throughput against a plain local PyTorch loop, recovery and freshness.

In one run:

1. **Ceiling**: a plain local PyTorch loop (same model, batch size, thread count
   and optimizer, data already in memory) for the digits MLP (64-256-256-10,
   batch 64) and a ~1.86M-parameter MLP (784-1024-1024-10, batch 128) on
   synthetic data.
2. **Pipeline**: the same models trained through everything real — Kafka,
   trainers, Redis, the parameter server, the coordinator — with one and with
   two trainers, under SSP with the job default s = 2, and for the larger model
   with one trainer also at s = 8 and 32. The data is produced first, so the
   producer is not what is measured; samples/s counts the samples the
   parameter server applied, over the span from the first to the last applied
   update.
3. **Recovery**: with two trainers on an unbounded rate-limited digits stream,
   SIGKILL one and time until every partition it owned is consumed again
   (its committed offset moves), at the default lease.
4. **Freshness**: p50/p99 seconds from a batch's produce timestamp to the
   parameter version that holds its gradient, from the parameter server's
   ``applied_samples`` records of that same rate-limited run.

Writes ``bench/results/pipeline.json``; prints the one-trainer pipeline/ceiling
ratio of the larger model last.

    .venv/bin/python bench/pipeline.py [--records-large 24000] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this folder is first on sys.path and bench/datastream.py would hide the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import redis as redis_lib  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from datastream import load_source, produce  # noqa: E402
from streamtrain.cluster import ClusterSpec, LocalCluster  # noqa: E402
from streamtrain.keys import JobKeys  # noqa: E402
from trainers import build_model  # noqa: E402

RESULTS = _HERE / "results" / "pipeline.json"
console = Console()

MODELS = {
    "digits-mlp": {"batch": 64, "source": "digits?repeat=0", "eval": "digits", "codec": "topk+fp16",
                   "density": 0.05},
    "mlp-2m": {"batch": 128, "source": "synthetic?features=784&classes=10&seed=1", "eval": "",
               "codec": "topk+fp16", "density": 0.01},
}


def ceiling(model: str, batch: int, threads: int, source: str, records: int) -> float:
    """Samples/s of a plain local loop: forward, backward, Adam step, data in memory."""
    torch.set_num_threads(threads)
    x, y = load_source(source, split="train").read(limit=records)
    x, y = torch.from_numpy(x).float(), torch.from_numpy(y).long()
    spec = build_model(model)
    opt = torch.optim.Adam(spec.model.parameters(), lr=0.001)
    steps = len(x) // batch

    def epoch(n: int) -> None:
        for i in range(n):
            xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
            opt.zero_grad(set_to_none=True)
            spec.loss_fn(spec.model(xb), yb).backward()
            opt.step()

    epoch(min(steps, 20))  # warm-up
    t0 = time.perf_counter()
    epoch(steps)
    return steps * batch / (time.perf_counter() - t0)


def applied_entries(cluster: LocalCluster) -> list[dict[bytes, bytes]]:
    client = redis_lib.Redis.from_url(cluster.redis_url)
    try:
        return [fields for _, fields in client.xrange(JobKeys(cluster.spec.job).applied_samples)]
    finally:
        client.close()


def pipeline(model: str, trainers: int, threads: int, records: int, workdir: Path,
             staleness: int = 2) -> dict[str, float]:
    """Samples/s the parameter server applied with ``trainers`` trainers on pre-produced data,
    under SSP with bound ``staleness``."""
    m = MODELS[model]
    spec = ClusterSpec(job="bench", topic="bench", partitions=4, trainers=0, model=model,
                       batch_size=m["batch"], threads=threads, codec=m["codec"],
                       topk_density=m["density"], source=None, eval_source="", staleness=staleness,
                       extra_trainer_args=("--prefetch", "8"))
    with LocalCluster(spec, workdir=workdir) as cluster:
        source = m["source"]
        report = produce(cluster.bootstrap, spec.topic, source, partitions=spec.partitions,
                         shard_size=m["batch"], limit=records, split="train")
        for _ in range(trainers):
            cluster.add_trainer()
        t0 = time.monotonic()
        cluster.wait_consumed(timeout_s=900)
        wall = time.monotonic() - t0
        cluster.quiesce()
        entries = [e for e in applied_entries(cluster) if int(e[b"batch_size"]) > 0]
    samples = sum(int(e[b"batch_size"]) for e in entries)
    span = (int(entries[-1][b"applied_ms"]) - int(entries[0][b"applied_ms"])) / 1000
    assert samples == report.records, f"applied {samples} samples of {report.records} produced"
    return {"samples": samples, "samples_per_s": samples / span, "span_s": span,
            "wall_with_startup_s": wall, "updates": len(entries)}


def recovery_and_freshness(threads: int, workdir: Path, rate: float) -> dict[str, float]:
    """Kill one of two trainers on a rate-limited unbounded stream; time until every partition
    it owned is consumed again. Freshness comes from the same run's applied records."""
    spec = ClusterSpec(job="recovery", topic="recovery", partitions=4, trainers=2, threads=threads,
                       source="digits?repeat=0", rate=rate, eval_source="")
    with LocalCluster(spec, workdir=workdir) as cluster:
        before = cluster.wait_for(lambda s: len(s["members"]) == 2 and (s["versions"]["max"] or 0) >= 200,
                                  timeout_s=120, what="two trainers training")
        time.sleep(5)  # steady state, for freshness
        kill_ms = time.time() * 1000
        t_kill = time.monotonic()
        cluster.kill_trainer(0)
        moved_at, victim = _wait_partitions_consumed(cluster, before)
        time.sleep(3)  # and after recovery
        entries = [e for e in applied_entries(cluster) if int(e[b"batch_size"]) > 0]

    def quantiles(selected: list[dict[bytes, bytes]]) -> tuple[float, float, int]:
        fresh = sorted((int(e[b"applied_ms"]) - int(e[b"produced_ts_ms"])) / 1000 for e in selected)
        return statistics.median(fresh), fresh[min(len(fresh) - 1, int(0.99 * len(fresh)))], len(fresh)

    steady = quantiles([e for e in entries if int(e[b"applied_ms"]) < kill_ms])
    whole = quantiles(entries)
    return {"recovery_s": moved_at - t_kill, "victim": victim, "rate_records_per_s": rate,
            "freshness_p50_s": steady[0], "freshness_p99_s": steady[1], "freshness_batches": steady[2],
            "freshness_with_kill_p50_s": whole[0], "freshness_with_kill_p99_s": whole[1]}


def _wait_partitions_consumed(cluster: LocalCluster, before: dict) -> tuple[float, str]:
    """(monotonic time, victim id) once the member that vanished has had every partition it
    owned before the kill consumed again by a new owner (committed offset moved past its value)."""
    owners = {p["partition"]: (p["owner"], p["committed"] or 0) for p in before["partitions"]}
    ids = {m["member_id"] for m in before["members"]}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = cluster.status()
        if st is not None:
            gone = ids - {m["member_id"] for m in st["members"]}
            if gone:
                victim = gone.pop()
                parts = {p["partition"]: p for p in st["partitions"]}
                owned = [q for q, (owner, _) in owners.items() if owner == victim]
                if all(parts[q]["owner"] not in (None, victim) and (parts[q]["committed"] or 0) > owners[q][1]
                       for q in owned):
                    return time.monotonic(), victim
        time.sleep(0.02)
    raise TimeoutError("the killed trainer's partitions were not consumed again within 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records-small", type=int, default=40_000, help="digits records per pipeline run")
    parser.add_argument("--records-large", type=int, default=24_000, help="784-wide records per pipeline run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the ceiling and each trainer")
    parser.add_argument("--rate", type=float, default=2000.0, help="records/s of the recovery/freshness stream")
    parser.add_argument("--workdir", type=Path, default=_HERE / "results" / "pipeline-run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    shutil.rmtree(args.workdir, ignore_errors=True)  # logs of the previous run; data starts empty
    results: dict[str, object] = {"machine": platform.processor() or platform.machine(),
                                  "threads": args.threads}
    table = Table(title="pipeline vs plain local PyTorch loop (samples/s)")
    for col in ("model", "batch", "ceiling", "1 trainer", "ratio", "2 trainers", "ratio"):
        table.add_column(col, justify="right")
    for model, records in (("digits-mlp", args.records_small), ("mlp-2m", args.records_large)):
        m = MODELS[model]
        ceil = ceiling(model, m["batch"], args.threads, m["source"], min(records, 20_000))
        console.print(f"{model}: ceiling {ceil:,.0f} samples/s")
        one = pipeline(model, 1, args.threads, records, args.workdir / f"{model}-1")
        console.print(f"{model}: 1 trainer {one['samples_per_s']:,.0f} samples/s")
        two = pipeline(model, 2, max(1, args.threads // 2), records, args.workdir / f"{model}-2")
        console.print(f"{model}: 2 trainers {two['samples_per_s']:,.0f} samples/s")
        results[model] = {"ceiling_samples_per_s": ceil, "one_trainer": one, "two_trainers": two,
                          "ratio_one": one["samples_per_s"] / ceil, "ratio_two": two["samples_per_s"] / ceil}
        table.add_row(model, str(m["batch"]), f"{ceil:,.0f}", f"{one['samples_per_s']:,.0f}",
                      f"{one['samples_per_s'] / ceil:.2f}", f"{two['samples_per_s']:,.0f}",
                      f"{two['samples_per_s'] / ceil:.2f}")
    sweep = Table(title="mlp-2m, 1 trainer: SSP bound s against throughput (samples/s)")
    for col in ("s", "samples/s", "ratio to ceiling"):
        sweep.add_column(col, justify="right")
    ceil = results["mlp-2m"]["ceiling_samples_per_s"]
    results["staleness_sweep"] = {}
    for s in (2, 8, 32):
        rate = (results["mlp-2m"]["one_trainer"] if s == 2 else pipeline(
            "mlp-2m", 1, args.threads, args.records_large, args.workdir / f"mlp-2m-s{s}", staleness=s)
        )["samples_per_s"]
        results["staleness_sweep"][s] = rate
        sweep.add_row(str(s), f"{rate:,.0f}", f"{rate / ceil:.2f}")
    rf = recovery_and_freshness(max(1, args.threads // 2), args.workdir / "recovery", args.rate)
    results["recovery_freshness"] = rf
    console.print(table)
    console.print(sweep)
    console.print(f"recovery after a trainer SIGKILL (lease 3 s): {rf['recovery_s']:.2f} s "
                  f"until its partitions were consumed again")
    console.print(f"freshness at {args.rate:,.0f} records/s, steady state: p50 {rf['freshness_p50_s']:.3f} s, "
                  f"p99 {rf['freshness_p99_s']:.3f} s over {rf['freshness_batches']} batches; "
                  f"including the kill: p50 {rf['freshness_with_kill_p50_s']:.3f} s, "
                  f"p99 {rf['freshness_with_kill_p99_s']:.3f} s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {RESULTS}")
    print(f"ratio pipeline(1 trainer)/ceiling, mlp-2m: {results['mlp-2m']['ratio_one']:.2f}")


if __name__ == "__main__":
    main()
