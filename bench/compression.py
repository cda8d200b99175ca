"""Gradient compression against accuracy, and which optimizer a top-k codec trains best with.

In one run, everything real (Kafka, two trainers, Redis, the parameter server, the
coordinator), digits under SSP s = 2, the same record budget for every job:

1. **Bytes against accuracy**: ``none`` (fp32, dense Adam) against the sparse codec
   (:data:`SPARSE`: top-k with int8 values and error feedback, ``dgc``, the tensors below
   ``dense_below`` values dense): bytes per step on the wire (the encoded gradients the
   trainers pushed, dense tensors included, from the parameter server's
   ``applied_samples`` records) against fp32 of the whole model, and the final held-out
   accuracy of each, as a mean and spread over ``--runs`` runs (the digits test split has
   359 records: one record is 0.28 points).
2. **A small model with the job defaults**: a ~1,200-parameter plug-in MLP
   (:func:`bench.models.small_mlp`, 64-16-10) trained with the job's default codec, density, optimizer,
   learning rate and ``dense_below`` (every tensor of it dense in fp16), against the same
   defaults with ``dense_below`` 0 (every tensor top-k'd at 1 %: the old behaviour) and
   against ``none`` with dense Adam, ``--small-runs`` runs each.
3. **Density warm-up**: :data:`SPARSE` with DGC's warm-up (the density decays from 25 % to
   its target over the first :data:`WARMUP_STEPS` pushes of each trainer), ``--warmup-runs``
   runs, against section 1's runs without it.
4. **Time to 95 %** with the default codec (``topk+fp16`` at 1 %) for each optimizer:
   dense ``adam`` (to show what dense momentum does with sparse gradients),
   ``lazyadam`` and ``dgc``, plus ``none`` with ``adam`` for reference: seconds from
   the first applied update until the stored parameters score 95 %, the lowest score
   after that, and the final one.

Writes ``bench/results/compression.json``; prints the small model's gap, the bytes
ratio and the accuracy lost last.

    .venv/bin/python bench/compression.py [--records 120000] [--runs 5] [--small-runs 3] [--skip speed]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

from rich.console import Console
from rich.table import Table

from bench import harness
from bench.pipeline import time_to_accuracy
from coordinator.settings import CoordinatorSettings
from streamtrain.cluster import LOCAL_TRAINER, ClusterSpec
from trainers import build_model
from trainers.settings import TrainerSettings

SOURCE = "digits?repeat=0"
console = Console(width=120)

DENSE: dict[str, Any] = {"codec": "none", "optimizer": "adam", "lr": 0.001}
"""The uncompressed baseline: fp32 gradients, dense Adam (at 0.002 two stale trainers made it dip to 40%)."""
SPARSE: dict[str, Any] = {"codec": "topk+int8", "topk_density": 0.007, "dense_below": 11,
                          "optimizer": "dgc", "lr": 0.05}
"""The compressed job: top-k at 0.7 % with int8 values (a byte each, a float32 scale per 256) and
delta+varint indices, with DGC (momentum correction and masking on the trainers, SGD on the server),
which applies each accumulated value in full where lazy Adam normalises it away: at 120,000 records
DGC matched ``none`` in our runs (97.5 % and 96.9 % means of two) and lazy Adam at lr 0.005 did not
(96.5 %). ``dense_below`` 11 sends the 10-value output bias dense (int8); the 256-value biases dense
would cost ~470 bytes a step more, below 200x (docs/parameter-plane.md)."""
WARMUP_STEPS = 200
"""Warm-up length of section 3: about a fifth of each trainer's ~940 steps at 120,000 records."""
TRAINER_FIELDS = ("topk_density", "dense_below", "density_warmup_steps", "model", "seed")
"""Settings of a job that are the trainers' (the rest are the coordinator's)."""
SMALL_JOBS = ("defaults", "defaults, all top-k", "dense")
"""Section 2's jobs: the job defaults, the same with ``dense_below`` 0, and ``none`` with dense Adam."""
SMALL_MODEL = "bench.models:small_mlp"
"""The small plug-in model (:func:`bench.models.small_mlp`; the trainers import it from the repository)."""
OPTIMIZERS = {"adam": 0.001, "lazyadam": 0.005, "dgc": 0.1}
"""Optimizers compared with the default codec, at the learning rate each trains digits best with."""


def run(settings: dict[str, Any], records: int, workdir: Path, target: float = 0.95) -> dict[str, Any]:
    """One digits job with two trainers under SSP s = 2 and ``settings`` (the coordinator's job settings,
    and the trainers' :data:`TRAINER_FIELDS`)."""
    job = {k: v for k, v in settings.items() if k not in TRAINER_FIELDS}
    trainer = replace(LOCAL_TRAINER, eval_source="", **{k: v for k, v in settings.items() if k in TRAINER_FIELDS})
    spec = ClusterSpec(job="compression", topic="compression", trainers=0, producer=None,
                       coordinator=CoordinatorSettings(**job), trainer=trainer)
    shutil.rmtree(workdir, ignore_errors=True)
    result = time_to_accuracy(spec, SOURCE, records, target, workdir, trainers=2)
    after = [acc for sec, _, acc in result["curve"] if result["reached"] and sec >= result["seconds"]]
    result["lowest_after_target"] = min(after) if after else None
    return result


def _spread(values: list[float]) -> float:
    """Sample standard deviation (0 for one value)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _label(settings: dict[str, Any]) -> str:
    density = f" {settings['topk_density']:.1%}" if "topk_density" in settings else ""
    below = f", dense below {settings['dense_below']}" if "dense_below" in settings else ""
    return settings["codec"] + density + below


def _repeat(name: str, settings: dict[str, Any], runs: int, args: argparse.Namespace,
            fp32: int) -> dict[str, Any]:
    """``runs`` runs of ``settings``, run i with initial weights of seed ``--first-seed`` + i (with one
    seed, runs differ only by timing, and little: the data order is the same): bytes per step, the
    final accuracies, their mean and spread."""
    folder = re.sub(r"[^A-Za-z0-9]+", "-", name)  # Kafka's log.dirs is comma-separated
    seeds = range(args.first_seed, args.first_seed + runs)
    done = [run({**settings, "seed": seed}, args.records, args.workdir / f"{folder}-{seed}") for seed in seeds]
    per_step = statistics.fmean(r["grad_bytes_per_update"] for r in done)
    finals = [r["final_accuracy"] for r in done]
    out = {"settings": settings, "seeds": list(seeds), "bytes_per_step": per_step, "x_smaller": fp32 / per_step,
           "final_accuracy": statistics.fmean(finals), "spread": _spread(finals), "runs": finals}
    console.print(f"{name} ({_label(settings)}, {settings['optimizer']}): {per_step:,.0f} bytes/step "
                  f"({fp32 / per_step:.1f}x smaller than fp32), final accuracy {out['final_accuracy']:.4f} "
                  f"+- {out['spread']:.4f} ({', '.join(f'{r:.4f}' for r in finals)})")
    return out


def _table(title: str, rows: dict[str, dict[str, Any]]) -> Table:
    table = Table(title=title)
    for col in ("job", "codec", "optimizer", "bytes/step", "vs fp32", "final accuracy (mean +- sd)", "runs"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(name, _label(r["settings"]), r["settings"]["optimizer"], f"{r['bytes_per_step']:,.0f}",
                      f"{r['x_smaller']:.1f}x", f"{r['final_accuracy']:.2%} +- {r['spread']:.2%}",
                      ", ".join(f"{a:.2%}" for a in r["runs"]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=120_000,
                        help="digits records per job (the same for every job)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each codec for the mean accuracy")
    parser.add_argument("--small-runs", type=int, default=3, help="runs of each small-model job")
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first run's initial weights")
    parser.add_argument("--small-jobs", nargs="*", default=list(SMALL_JOBS), choices=SMALL_JOBS,
                        help="which small-model jobs to run")
    parser.add_argument("--warmup-runs", type=int, default=3, help="runs of the sparse job with the warm-up")
    parser.add_argument("--skip", nargs="*", default=[], choices=("sizes", "small", "warmup", "speed"),
                        help="sections to leave out")
    parser.add_argument("--workdir", type=Path, default=harness.RESULTS_DIR / "compression-run")
    parser.add_argument("--results", type=Path, default=harness.results_path("compression"),
                        help="where to write the results (JSON)")
    args = parser.parse_args()
    harness.start()
    fp32 = 4 * sum(p.numel() for p in build_model("digits-mlp").model.parameters())
    results: dict[str, Any] = {"records": args.records, "fp32_bytes_per_step": fp32}
    tables: list[Table] = []
    lines: list[str] = []
    defaults = TrainerSettings()
    job_defaults = {"codec": CoordinatorSettings().codec, "topk_density": defaults.topk_density,
                    "optimizer": CoordinatorSettings().optimizer, "lr": CoordinatorSettings().lr}

    if "small" not in args.skip:
        small_fp32 = 4 * sum(p.numel() for p in build_model(SMALL_MODEL).model.parameters())
        jobs = {"defaults": {**job_defaults, "dense_below": defaults.dense_below, "model": SMALL_MODEL},
                "defaults, all top-k": {**job_defaults, "dense_below": 0, "model": SMALL_MODEL},
                "dense": {**DENSE, "model": SMALL_MODEL}}
        small = {name: _repeat(f"small {name}", settings, args.small_runs, args, small_fp32)
                 for name, settings in jobs.items() if name in args.small_jobs}
        results["small_model"] = small
        tables.append(_table(f"{SMALL_MODEL} ({small_fp32 // 4:,} parameters) on digits, {args.records:,} records",
                             small))
        lines.append(f"small model ({small_fp32 // 4:,} parameters): " + ", ".join(
            f"{name} {r['final_accuracy']:.4f} +- {r['spread']:.4f}" for name, r in small.items()))
        if "defaults" in small and "dense" in small:
            gap = (small["dense"]["final_accuracy"] - small["defaults"]["final_accuracy"]) * 100
            lines.append(f"small model: job defaults {gap:+.2f} points behind dense (target <= 1)")

    if "speed" not in args.skip:
        default = {**job_defaults}
        speed = Table(title=f"time to 95% held-out accuracy with the default codec ({default['codec']} at "
                            f"{default['topk_density']:.0%}, dense below {defaults.dense_below})")
        for col in ("optimizer", "lr", "seconds to 95%", "lowest after", "final"):
            speed.add_column(col, justify="right")
        results["time_to_95"] = {}
        jobs_95 = [(name, {**default, "optimizer": name, "lr": lr})
                   for name, lr in OPTIMIZERS.items()] + [("adam, codec none", DENSE)]
        for label, settings in jobs_95:
            r = run(settings, args.records, args.workdir / f"speed-{label.replace(' ', '').replace(',', '-')}")
            results["time_to_95"][label] = {k: v for k, v in r.items() if k != "curve"} | {"settings": settings}
            console.print(f"{label}: 95% after {r['seconds']:.2f} s (reached: {r['reached']}), "
                          f"final {r['final_accuracy']:.4f}")
            speed.add_row(label, str(settings["lr"]), f"{r['seconds']:.2f}" if r["reached"] else "not reached",
                          "-" if r["lowest_after_target"] is None else f"{r['lowest_after_target']:.2%}",
                          f"{r['final_accuracy']:.2%}")
        tables.append(speed)

    if "sizes" not in args.skip:
        summary = {name: _repeat(name, settings, args.runs, args, fp32)
                   for name, settings in (("none", DENSE), ("sparse", SPARSE))}
        results["bytes_vs_accuracy"] = summary
        tables.append(_table(f"digits-mlp, {args.records:,} records, 2 trainers, SSP s=2: bytes per step "
                             "against accuracy", summary))
        sparse, dense = summary["sparse"], summary["none"]
        lines.append(f"accuracy: none {dense['final_accuracy']:.4f} +- {dense['spread']:.4f}, {_label(SPARSE)} "
                     f"{sparse['final_accuracy']:.4f} +- {sparse['spread']:.4f} "
                     f"({(dense['final_accuracy'] - sparse['final_accuracy']) * 100:+.2f} points lost, "
                     f"mean of {args.runs}; target <= 0.5)")
        lines.append(f"bytes per step vs fp32: {sparse['x_smaller']:.1f}x")

    if "warmup" not in args.skip:
        warm = _repeat("sparse, warm-up", {**SPARSE, "density_warmup_steps": WARMUP_STEPS}, args.warmup_runs,
                       args, fp32)
        results["warmup"] = warm
        tables.append(_table(f"density warm-up over {WARMUP_STEPS} steps", {"sparse, warm-up": warm}))
        lines.insert(0, f"warm-up ({WARMUP_STEPS} steps): {warm['final_accuracy']:.4f} +- {warm['spread']:.4f}, "
                        f"{warm['x_smaller']:.1f}x smaller than fp32")

    for table in tables:
        console.print(table)
    harness.finish("compression", results, lines, path=args.results)


if __name__ == "__main__":
    main()
